"""python -m flybatch.bench: benchmark flybatch against eager, hand-batched and DyNet.

    python -m flybatch.bench TASK [--modes ...] [--data-dir DIR] [--batch-size 64]
                                  [--seconds S] [--threads N] [--device D]
    python -m flybatch.bench all --quick          # every task, synthetic data, a few minutes
    python -m flybatch.bench report [--out FILE] [--run-id ID]   # tables + charts again
    torchrun --nproc-per-node 2 -m flybatch.bench TASK --distributed [...]  # data-parallel
    python -m flybatch.bench overhead [--sizes 10000 100000 1000000]  # cost per node
    python -m flybatch.bench quality [--instances 20]   # launches vs bound, literature models

TASK: bilstm-synthetic, bilstm, bilstm-char, treelstm, parser, or all. Results are appended
as JSON lines to --out (default bench-results/results.jsonl); the markdown table (the paper's
Table 1) is printed and written next to it as table.md, with throughput.png and
breakdown.png (the paper's Figure 2).
"""

from __future__ import annotations

import argparse
import os
import sys

# Modes and tasks are spelled out here (not imported) so that the thread variables below are
# set before torch is imported.
TASKS = ("bilstm-synthetic", "bilstm", "bilstm-char", "treelstm", "parser")
MODES = ("eager", "none", "depth", "agenda", "auto", "manual", "parser-auto", "parser-seq",
         "torch-native", "fb-unfused", "dynet-noauto", "dynet-depth", "dynet-agenda")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m flybatch.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("task", choices=TASKS + ("all", "report"))
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), metavar="MODE",
                    help=f"modes to run (default all): {' '.join(MODES)}")
    ap.add_argument("--data-dir", default=None,
                    help="benchmark data root (sst/, wikiner/, ud-english/); default synthetic")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=None,
                    help="timed training per mode (default 10; 1 with --quick)")
    ap.add_argument("--eval-seconds", type=float, default=None,
                    help="timed evaluation per mode (default max(1, seconds/4))")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed minibatches after the first one (default 1; 0 with --quick)")
    ap.add_argument("--min-timed", type=int, default=None,
                    help="time at least this many minibatches (default 3; 1 with --quick)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-synthetic", type=int, default=None,
                    help="synthetic train instances (default 2000; 256 with --quick)")
    ap.add_argument("--quick", action="store_true",
                    help="short runs: seconds 1, eval 0.5, at least 1 timed minibatch, the first "
                         "(correctness) minibatch the only warm-up, 256 synthetic instances")
    ap.add_argument("--out", default="bench-results/results.jsonl")
    ap.add_argument("--distributed", action="store_true",
                    help="data-parallel over the processes torchrun starts (flybatch."
                         "distributed): each trains and evaluates its shard of every minibatch, "
                         "gradients are summed; reports throughput per process and in total; "
                         "rank 0 prints and writes; DyNet modes are skipped")
    ap.add_argument("--dynet", choices=("2.1.2", "2.2"), default=None,
                    help="DyNet build of the dynet-* modes, as `make peers` installs them "
                         "(default 2.2, the faster, when installed)")
    ap.add_argument("--run-id", default=None, help="report: only this run (default the last)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["overhead"]:  # the per-node cost microbenchmark has its own options
        from flybatch.bench import overhead
        overhead.main(argv[1:])
        return 0
    if argv[:1] == ["quality"]:  # launches vs the lower bound on the literature's families
        from flybatch.bench import quality
        quality.main(argv[1:])
        return 0
    args = parse_args(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)

    import torch  # noqa: E402  (after the thread variables)

    from flybatch.bench import report

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(args.threads)
    out_dir = os.path.dirname(args.out) or "."

    if args.task == "report":
        records = report.load(args.out)
        run_id = args.run_id or (records[-1]["run_id"] if records else None)
        return _report([r for r in records if r.get("run_id") == run_id], out_dir)

    if args.distributed:
        import flybatch.distributed as fbd

        wanted = torch.device(args.device)
        ctx = fbd.init(timeout=120, device="cpu" if wanted.type == "cpu" else None)
        try:
            if ctx.device.type != wanted.type:
                print(f"error: --device {args.device} but this process got {ctx.device}",
                      file=sys.stderr)
                return 2
            if args.batch_size < ctx.world_size:
                print(f"error: --batch-size {args.batch_size} is smaller than the "
                      f"{ctx.world_size} processes", file=sys.stderr)
                return 2
            if ctx.distributed:
                args.device = str(ctx.device)  # cuda:LOCAL_RANK under NCCL
            if not ctx.is_main:  # one report: the other ranks keep only their stderr
                sys.stdout = open(os.devnull, "w")
            return _bench(args)
        finally:
            fbd.shutdown()
    if int(os.environ.get("WORLD_SIZE") or 1) > 1:
        print("error: started as one of several processes (WORLD_SIZE="
              f"{os.environ['WORLD_SIZE']}) without --distributed: each would run the whole "
              "benchmark on its own; add --distributed", file=sys.stderr)
        return 2
    return _bench(args)


def _bench(args: argparse.Namespace) -> int:
    """Run the tasks of `args` (a world of one, or this rank's part under --distributed)."""
    import flybatch.distributed as fbd
    from flybatch.bench import runner

    is_main = fbd.context().is_main  # a world of one without --distributed
    out_dir = os.path.dirname(args.out) or "."
    quick = args.quick
    s = runner.Settings(
        batch_size=args.batch_size,
        seconds=args.seconds if args.seconds is not None else (1.0 if quick else 10.0),
        eval_seconds=args.eval_seconds if args.eval_seconds is not None else
        (0.5 if quick else None),
        warmup=args.warmup if args.warmup is not None else (0 if quick else 1),
        min_timed=args.min_timed if args.min_timed is not None else (1 if quick else 3),
        eval_warmup=0 if quick else 1,
        threads=args.threads, device=args.device, seed=args.seed,
        n_synthetic=args.n_synthetic if args.n_synthetic is not None else (256 if quick else 2000),
        data_dir=args.data_dir, out=args.out, distributed=args.distributed, dynet=args.dynet)
    if args.run_id:
        s.run_id = args.run_id
    tasks = list(TASKS) if args.task == "all" else [args.task]
    print(f"flybatch bench run {s.run_id}: tasks {' '.join(tasks)}; modes {' '.join(args.modes)};"
          f" batch {s.batch_size}, {s.threads} thread(s), device {s.device}, "
          f"data {args.data_dir or 'synthetic'}", flush=True)
    if is_main:
        from flybatch.bench.flops import gemm_peak

        print(gemm_peak(s.device), flush=True)
    records, failed = [], []
    for task in tasks:
        try:
            records += runner.run_task(task, list(args.modes), s)
        except runner.CorrectnessError as e:
            print(f"\nFAILED: {e}\n", file=sys.stderr, flush=True)
            failed.append(task)
        except (ImportError, LookupError, NotImplementedError) as e:
            print(f"{task}: not available ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
            failed.append(task)
    if is_main:
        _report(records, out_dir)
    if failed:
        print(f"FAILED tasks: {' '.join(failed)}", file=sys.stderr, flush=True)
        return 1
    return 0


def _report(records, out_dir: str) -> int:
    from flybatch.bench import report

    table = report.markdown(records)
    print("\n" + table)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(table)
    for p in report.charts(records, out_dir):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
