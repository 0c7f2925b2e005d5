"""The timing loop: one task in every mode, measured the same way, checked for the same loss.

For each mode a fresh task is built from the same seed (so every mode starts from the same
parameters) and trained on the same minibatch sequence (``tasks_data.minibatches``):

1. the first minibatch is the correctness probe: its loss (before any update) must agree across
   modes within float32 tolerance, else the run stops with :class:`CorrectnessError`. It also
   serves as warm-up, as do the next ``warmup`` minibatches;
2. then minibatches are timed until ``seconds`` have passed (at least ``min_timed``): each is
   forward + backward (``Task.step``) + the optimizer update (timed here): ``torch.optim.Adam``
   for the dense parameters and ``torch.optim.SparseAdam`` for the embedding tables, which then
   only touches the rows used in the minibatch (DyNet's sparse updates);
3. then dev minibatches are timed, forward only (predictions), for ``eval_seconds``.

A result is the medians of those minibatches: instances/s, seconds per phase, kernel launches
and their lower bound, input copies made and avoided, nodes, plus peak memory (peak RSS of the
process during the mode, the high-water mark reset per mode; on CUDA the peak allocated), and
the achieved GFLOP/s next to the machine's GEMM peak (``flops``: the flybatch modes count their
matrix products' FLOPs; the other modes get flybatch's count of the same minibatches).
Every mode runs in a fresh Python process of its own (`run_mode_alone`), as the DyNet peers
always have: a mode run after others in one process inherits their allocator state (the
``none`` mode's ~25k launches a minibatch of small tensors left glibc's malloc ~2x slower:
the parser's agenda mode trained 6-8% slower after it, 2026-11-24), while the DyNet peers
started afresh. DyNet peers run in the venv of the DyNet build ``Settings.dynet`` names
(``make peers`` installs both, see :data:`DYNET_VENVS`) with the same initial parameters
(``--init``, from ``Task.export_spec``); their records say which DyNet ran (``dynet``).
Results go to stdout (a progress bar on stderr) and are appended as JSON lines to ``out``.

Data-parallel (``torchrun --nproc-per-node N -m flybatch.bench TASK --distributed``): every
rank runs the same modes on its shard of every global minibatch, training and evaluation alike,
with ``flybatch.distributed`` (see :func:`run_mode`); only rank 0 prints and writes results,
and the DyNet peers are skipped. Every record carries ``world_size``, ``per_process`` and
``total`` (training instances per wall second of the timed loop, each process's and the job's)
and the same for evaluation (``eval_per_process``, ``eval_total``).
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import flybatch.distributed as fbd
from flybatch import _core, kernels, lstm_layer, tree_lstm
from flybatch.bench.flops import MinibatchFlops, gemm_peak
from flybatch.bench.tasks import EXTRA_MODES, MODES, create, task_class
from flybatch.bench.tasks.base import StepResult
from flybatch.bench.tasks_data import (IdTree, TaskData, eval_batches, minibatches, prepare,
                                       tree_nodes)

# Which kernels ran a mode's training steps, launches per path (recorded when any ran): the
# LSTM layers (flybatch/lstm_layer.py), the Tree-LSTM cells (tree_lstm.py: fused or torch
# ops) and the products of shared weights and fused cells (kernels.py: oneDNN or default).
KERNEL_COUNTS = {"lstm_paths": lstm_layer.lstm_counts,
                 "tree_lstm_paths": tree_lstm.tree_lstm_counts,
                 "gemm_paths": kernels.gemm_counts}

PEER_MODES = ("dynet-noauto", "dynet-depth", "dynet-agenda")
ALL_MODES = MODES + EXTRA_MODES + PEER_MODES
REPO = Path(__file__).resolve().parents[3]
# The DyNet builds `make peers` installs (scripts/install-peers.sh), by release. The default,
# 2.2, trained faster on treelstm and bilstm-synthetic when both were measured (2026-11-23, two
# rounds each on a shared machine), level on the taggers, slower on the parser (~10% train, ~25%
# eval): pass --dynet 2.1.2 to meet the stronger peer there.
DYNET_VENVS = {"2.1.2": ".venv-peers", "2.2": ".venv-peers-22"}
DYNET_PREFERRED = "2.2"
LR = 0.001
RTOL, ATOL = 1e-4, 1e-3  # first-loss agreement: float32 sums of thousands of terms


class CorrectnessError(RuntimeError):
    """Two modes computed different losses on the same first minibatch."""


@dataclass
class Settings:
    batch_size: int = 64
    seconds: float = 10.0          # timed training per mode
    eval_seconds: float | None = None  # default max(1, seconds / 4)
    warmup: int = 1                # untimed minibatches after the first (correctness) one
    eval_warmup: int = 1           # untimed evaluation minibatches
    min_timed: int = 3
    threads: int = 1
    device: str = "cpu"
    seed: int = 0
    n_synthetic: int = 2000
    data_dir: str | None = None
    out: str = "bench-results/results.jsonl"
    distributed: bool = False      # --distributed: data-parallel over torchrun's processes
    dynet: str | None = None       # DyNet build of the dynet-* modes; None: default_dynet()
    run_id: str = field(default_factory=lambda: datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))

    @property
    def eval_budget(self) -> float:
        return self.eval_seconds if self.eval_seconds is not None else max(1.0, self.seconds / 4)


# ---- optimizer ---------------------------------------------------------------------------------
class Optimizer:
    """Adam for dense parameters, SparseAdam (rows used only) for the embedding tables: the
    same for every torch mode. Adam is torch's fused one (`fused=True`, one kernel over all
    parameters; ~0.3 ms a step for the treelstm and parser tasks' ~0.7M numbers where the
    default multi-tensor one took ~0.85, 1 thread, 2026-11-24); DyNet's peers run DyNet's
    own C++ Adam."""

    def __init__(self, task, lr: float = LR):
        self.params = list(task.params.values())
        self.dense = torch.optim.Adam(task.dense_params, lr=lr, fused=True)
        self.sparse = torch.optim.SparseAdam(task.sparse_params, lr=lr) \
            if task.sparse_params else None

    def step(self) -> None:
        self.dense.step()
        if self.sparse is not None:
            self.sparse.step()
        for p in self.params:
            p.grad = None


# ---- memory --------------------------------------------------------------------------------------
def reset_peak_memory(device: torch.device) -> float:
    """Return freed memory to the OS and reset the peak; returns the RSS now (MB)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:  # glibc keeps freed blocks; give them back so the previous mode's peak does not count
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:  # Linux: "5" resets the peak RSS (VmHWM) of the process to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status_mb("VmRSS:")


def peak_memory_mb(device: torch.device, baseline: float) -> dict[str, float]:
    """Peak RSS during the mode, and its growth over the RSS when the mode started."""
    peak = _status_mb("VmHWM:") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = {"peak_rss_mb": peak, "peak_rss_growth_mb": max(0.0, peak - baseline)}
    if device.type == "cuda":
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def _status_mb(key: str) -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


# ---- progress bar --------------------------------------------------------------------------------
class Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, label: str, budget: float, stream=sys.stderr):
        self.label, self.budget, self.stream = label, budget, stream  # None: quiet
        self.tty = stream is not None and stream.isatty()
        self.start = time.perf_counter()
        self.last = 0.0

    def update(self, done: int, phase: str) -> None:
        now = time.perf_counter()
        elapsed = now - self.start
        if self.stream is None or (not self.tty and now - self.last < 5.0):
            return
        self.last = now
        frac = min(1.0, elapsed / self.budget) if self.budget > 0 else 1.0
        bar = "#" * int(20 * frac) + "." * (20 - int(20 * frac))
        line = f"{self.label:32s} [{bar}] {phase:5s} {done:4d} minibatches {elapsed:6.1f}s"
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r" + " " * 90 + "\r")
            self.stream.flush()


# ---- one mode ------------------------------------------------------------------------------------
def _median_phases(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}


def _cost(instance: Any) -> float:
    """An instance's work, to balance a minibatch's shards over the ranks (``fbd.shard``):
    tree nodes for the Tree-LSTM, tokens for the taggers and the parser."""
    if isinstance(instance, IdTree):
        return float(sum(1 for _ in tree_nodes(instance)))
    words = getattr(instance, "words", None)
    return float(len(words)) if words is not None else 1.0


def _shard(batch: list) -> list:
    """This rank's part of a global minibatch (the whole minibatch in one process)."""
    return fbd.shard(batch, cost=_cost) if fbd.is_distributed() else batch


def run_mode(task_name: str, mode: str, data: TaskData, s: Settings,
             flops: MinibatchFlops | None = None) -> dict[str, Any]:
    """Train and evaluate one mode; returns its result record (no I/O). A flybatch mode's
    steps record their model FLOPs in `flops`.

    Under ``torchrun ... --distributed`` (a process group made by ``fbd.init``) every rank
    draws the same global minibatches, trains on its shard (split by cost: tree nodes or
    tokens), and ``fbd.step`` sums the gradients over the ranks before the update, so the
    parameters stay identical on every rank and equal one process's. The first-minibatch loss
    is summed over the ranks (the whole minibatch's loss), the timed loops stop on every rank
    at the same step (``fbd.any_rank``), and evaluation is sharded the same way. Throughput is
    gathered from every rank (``fbd.gather_throughput``): ``per_process`` and ``total`` (all
    instances over the slowest rank's time). In one process these are local no-ops.
    """
    device = torch.device(s.device)
    ctx = fbd.context()
    distributed = ctx.distributed
    torch.manual_seed(s.seed)
    task = create(task_name, data, device, s.seed)
    opt = Optimizer(task)
    params = list(task.params.values())
    batches = minibatches(data.train, s.batch_size, s.seed)
    bar = Progress(f"{task_name} {mode}", s.seconds + s.eval_budget,
                   stream=sys.stderr if ctx.is_main else None)
    baseline = reset_peak_memory(device)

    def train_step(batch: list) -> tuple[StepResult, dict[str, float], int]:
        """This rank's shard: forward + backward, the gradient sum over ranks, the update.
        Returns the step's result, its extra phases (allreduce, update) and its instances."""
        mine = _shard(batch)
        kernels.flops.reset()
        with fbd.step(params):  # failure check + gradient all-reduce; a no-op in one process
            r = task.step(mode, mine, train=True) if mine else StepResult(0.0)
            t0 = time.perf_counter()
        t1 = time.perf_counter()  # all-reduce, including the wait for the slowest rank
        opt.step()
        task.sync()
        extra = {"allreduce": t1 - t0} if distributed else {}
        return r, {**extra, "update": time.perf_counter() - t1}, len(mine)

    first, _, _ = train_step(next(batches))
    first_loss = fbd.sum_scalars([first.loss])[0]  # the whole minibatch's loss
    for _ in range(s.warmup):
        train_step(next(batches))
    timed, stats, sizes = [], [], []
    before = {name: dict(counts) for name, counts in KERNEL_COUNTS.items()}
    start = time.perf_counter()
    while not fbd.any_rank(len(timed) >= s.min_timed and time.perf_counter() - start >= s.seconds):
        r, extra, n = train_step(next(batches))
        if r.stats is not None and flops is not None:  # flybatch ran the step's products
            flops.record(mode, 1 + s.warmup + len(timed), kernels.flops.total)
        timed.append({**r.seconds, **extra, "total": r.wall + sum(extra.values())})
        sizes.append(n)
        if r.stats is not None:
            stats.append(r.stats)
        bar.update(len(timed), "train")
    train_wall = time.perf_counter() - start
    kernel_paths = {name: {path: n - before[name][path] for path, n in counts.items()
                           if n > before[name][path]}
                    for name, counts in KERNEL_COUNTS.items()}
    split = _build_split(train_step, batches) if stats else None

    def eval_step(batch: list) -> tuple[StepResult, int]:
        mine = _shard(batch)
        with fbd.guard():  # a rank failing in evaluation stops every rank
            r = task.step(mode, mine, train=False) if mine else StepResult(float("nan"))
        return r, len(mine)

    dev = [b for b in eval_batches(data.dev, s.batch_size) if len(b) == s.batch_size] \
        or [list(data.dev)]
    for k in range(s.eval_warmup):
        eval_step(dev[k % len(dev)])
    etimes, esizes = [], []
    start = time.perf_counter()
    while not fbd.any_rank(len(etimes) >= s.min_timed
                           and time.perf_counter() - start >= s.eval_budget):
        r, n = eval_step(dev[len(etimes) % len(dev)])
        etimes.append(r.wall)
        esizes.append(n)
        bar.update(len(etimes), "eval")
    eval_wall = time.perf_counter() - start
    bar.close()
    train_tp = fbd.gather_throughput(sum(sizes), train_wall)
    eval_tp = fbd.gather_throughput(sum(esizes), eval_wall)

    med = _median_phases(timed)
    total = med.pop("total")
    rec: dict[str, Any] = {
        "task": task_name, "mode": mode,
        # one process: median instances / median seconds per minibatch; distributed: the job's
        # instances over the slowest rank's timed span (below)
        "train_per_s": train_tp.total if distributed else statistics.median(sizes) / total,
        "eval_per_s": eval_tp.total if distributed else
        statistics.median(esizes) / statistics.median(etimes),
        "first_loss": first_loss,
        "seconds_per_minibatch": total,
        "seconds": med,
        "timed_minibatches": len(timed), "timed_eval_minibatches": len(etimes),
        # instances / wall seconds of the timed loops, per process and for the whole job
        "world_size": ctx.world_size,
        "per_process": train_tp.per_process, "total": train_tp.total,
        "eval_per_process": eval_tp.per_process, "eval_total": eval_tp.total,
        **peak_memory_mb(device, baseline),
    }
    if split:
        rec["build_split"] = split
    rec.update((name, paths) for name, paths in kernel_paths.items() if paths)
    if stats:
        def med_of(attr):
            return statistics.median(getattr(st, attr) for st in stats)
        rec.update(launches=med_of("batches"), lower_bound=med_of("lower_bound"),
                   launches_over_bound=med_of("launches_over_bound"),
                   gathers=med_of("gathers"), gathers_avoided=med_of("gathers_avoided"),
                   nodes=med_of("nodes"))
    return rec


def run_mode_alone(task_name: str, mode: str, s: Settings,
                   flops: MinibatchFlops | None = None) -> dict[str, Any]:
    """`run_mode` in a fresh Python process (`_mode_process`), on the same data (`prepare` is
    deterministic) and settings; the FLOPs its steps recorded are merged into
    `flops`. Its progress bar writes to this process's stderr."""
    program = "import sys; from flybatch.bench.runner import _mode_process; " \
              "_mode_process(sys.argv[1:])"
    cmd = [sys.executable, "-c", program, task_name, mode, json.dumps(asdict(s))]
    src = str(Path(__file__).resolve().parents[2])  # the directory of this flybatch
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [src] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"{task_name} {mode}: its process failed (exit {proc.returncode}); "
                           f"its stderr is above")
    out = json.loads(lines[-1])
    if "error" in out:  # what run_mode raised there, raised here as the same kind
        kind = _MODE_ERRORS.get(out["error"], RuntimeError)
        raise kind(out["message"])
    if flops is not None:
        for index, count in out["flops"].items():
            flops.record(out["record"]["mode"], int(index), count)
    return out["record"]


def _mode_process(argv: list[str]) -> None:
    """The program of `run_mode_alone`: TASK MODE SETTINGS-JSON; prints one JSON line, the
    mode's record and the FLOPs of the minibatches its steps counted."""
    task_name, mode, settings = argv
    s = Settings(**json.loads(settings))
    torch.set_num_threads(s.threads)
    torch.set_num_interop_threads(s.threads)
    data = _load(task_name, s)
    flops = MinibatchFlops(task_name, data, s.batch_size, s.seed, s.warmup, s.device, _shard)
    try:
        rec = run_mode(task_name, mode, data, s, flops)
    except Exception as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e)}), flush=True)
        raise
    counted = flops.known if mode in flops.recorded_by else {}
    print(json.dumps({"record": rec, "flops": counted}), flush=True)


# The errors of a mode's process that `run_mode_alone` raises as themselves (the benchmark's
# main loop skips a task on these); any other as a RuntimeError with its message.
_MODE_ERRORS = {e.__name__: e for e in (ImportError, LookupError, NotImplementedError,
                                        ValueError, CorrectnessError)}


def _build_split(train_step, batches, steps: int = 3) -> dict[str, float]:
    """A flybatch mode's build time per training minibatch split in two, median seconds over
    `steps` more minibatches run with flybatch's own-time clock on (`_core.measure_own_time`;
    off in the timed loop, since it reads the clock twice per op call): ``flybatch``, its op
    calls (rules, Python ops, fb.nn modules, recording torch calls), and ``user``, the rest:
    the task's own per-instance Python (and, under torch-native capture, torch's dispatch of
    each call to the capture mode, which happens before flybatch's code is reached)."""
    was = _core.measure_own_time(True)
    try:
        rows = [train_step(next(batches))[0].seconds for _ in range(steps)]
    finally:
        _core.measure_own_time(was)
    own = [r.get("build_flybatch", 0.0) for r in rows]
    return {"flybatch": statistics.median(own),
            "user": statistics.median(r["build"] - o for r, o in zip(rows, own))}


# ---- DyNet peers ---------------------------------------------------------------------------------
def peer_python(dynet: str | None = None) -> Path:
    """The interpreter of DyNet build `dynet` (default :func:`default_dynet`);
    FLYBATCH_PEERS_PYTHON overrides it (a DyNet installed elsewhere)."""
    if os.environ.get("FLYBATCH_PEERS_PYTHON"):
        return Path(os.environ["FLYBATCH_PEERS_PYTHON"])
    return REPO / DYNET_VENVS[dynet or default_dynet()] / "bin/python"


def default_dynet() -> str:
    """The preferred DyNet build when its venv exists, else any installed one."""
    for release in (DYNET_PREFERRED, *DYNET_VENVS):
        if (REPO / DYNET_VENVS[release] / "bin/python").exists():
            return release
    return DYNET_PREFERRED


def peers_available(dynet: str | None = None) -> str | None:
    """None when DyNet build `dynet` can run, else why not."""
    python = peer_python(dynet)
    label = f"DyNet {dynet or default_dynet()}"
    if not python.exists():
        return f"{label} not installed: run `make peers`"
    probe = subprocess.run([str(python), "-c", "import dynet_config"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"{label} not importable by {python}: run `make peers`"
    return None


def run_peer(task_name: str, mode: str, data: TaskData, s: Settings) -> dict[str, Any]:
    """One ``dynet-*`` mode in a subprocess, from the same initial parameters."""
    task = create(task_name, data, "cpu", s.seed)
    with tempfile.TemporaryDirectory() as tmp:
        init = Path(tmp) / "init.npz"
        np.savez(init, **task.export_spec())
        cmd = [str(peer_python(s.dynet)), "-m", "flybatch.bench.dynet_peer", task_name,
               "--strategy", mode.split("-", 1)[1], "--batch-size", str(s.batch_size),
               "--seconds", str(s.seconds), "--eval-seconds", str(s.eval_budget),
               "--threads", str(s.threads), "--init", str(init), "--seed", str(s.seed),
               "--n-synthetic", str(s.n_synthetic), "--warmup", str(1 + s.warmup),
               "--min-timed", str(s.min_timed)]
        if s.data_dir:
            cmd += ["--data-dir", s.data_dir]
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
        print(f"{task_name} {mode}: running DyNet peer ...", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"{mode} failed (exit {proc.returncode}):\n{tail}")
    peer = json.loads(lines[-1])
    rec = {"task": task_name, "mode": mode, "dynet": peer.get("dynet"),
           "train_per_s": peer["train_per_s"],
           "eval_per_s": peer["eval_per_s"], "first_loss": peer["first_loss"],
           "seconds": peer.get("seconds", {}), "peak_rss_mb": peer.get("peak_rss_mb"),
           "timed_minibatches": peer.get("timed_minibatches"),
           "timed_eval_minibatches": peer.get("timed_eval_minibatches")}
    rec["seconds_per_minibatch"] = sum(rec["seconds"].values()) or None
    return rec


# ---- correctness ---------------------------------------------------------------------------------
def check_losses(task_name: str, losses: dict[str, float]) -> str:
    """The correctness line; raises CorrectnessError when a mode disagrees."""
    ref_mode, ref = next(iter(losses.items()))
    bad = {m: v for m, v in losses.items()
           if not (math.isfinite(v) and abs(v - ref) <= ATOL + RTOL * abs(ref))}
    worst = max(abs(v - ref) / max(abs(ref), 1e-12) for v in losses.values())
    line = (f"correctness {task_name}: first-minibatch loss "
            + ", ".join(f"{m} {v:.6g}" for m, v in losses.items())
            + f" -> {'OK' if not bad else 'MISMATCH'} (max rel diff {worst:.1e}"
            + f", tolerance {RTOL:.0e} rel + {ATOL:.0e})")
    if bad:
        raise CorrectnessError(line + f"; {sorted(bad)} differ from {ref_mode}")
    return line


# ---- one task ------------------------------------------------------------------------------------
def environment(s: Settings) -> dict[str, Any]:
    return {"run_id": s.run_id, "date": datetime.date.today().isoformat(),
            "machine": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "threads": s.threads, "device": s.device,
            "torch": torch.__version__, "python": platform.python_version(),
            "batch_size": s.batch_size, "seconds": s.seconds}


def _load(task_name: str, s: Settings) -> TaskData:
    """The task's data, its objects frozen out of the cyclic GC: the data set is hundreds of
    thousands of long-lived Python objects, which every full collection would otherwise rescan,
    in every mode, mid-minibatch."""
    data = prepare(task_name, s.data_dir, seed=s.seed, n_synthetic=s.n_synthetic)
    gc.collect()
    gc.freeze()
    return data


def run_task(task_name: str, modes: list[str], s: Settings) -> list[dict[str, Any]]:
    """Every mode of one task; appends each result to ``s.out`` as it is made."""
    data = _load(task_name, s)
    real = s.data_dir is not None and task_name != "bilstm-synthetic"
    meta = {**environment(s), "data": "real" if real else "synthetic",
            "train_size": len(data.train), "dev_size": len(data.dev)}
    why_no_peers = peers_available(s.dynet) \
        if any(m in PEER_MODES for m in modes) and not s.distributed else None
    main = fbd.context().is_main  # under --distributed only rank 0 writes results
    peak = gemm_peak(s.device)
    meta.update(peak.record())
    flops = MinibatchFlops(task_name, data, s.batch_size, s.seed, s.warmup, s.device, _shard)
    records, losses = [], {}
    for mode in modes:
        if mode in PEER_MODES:
            if s.distributed:
                print(f"{mode}: skipped (--distributed: the DyNet peer runs in one process)",
                      flush=True)
                continue
            if why_no_peers:
                print(f"{mode}: skipped ({why_no_peers})", flush=True)
                continue
            if s.device != "cpu":
                print(f"{mode}: skipped (the DyNet peer runs on CPU only)", flush=True)
                continue
            try:
                rec = run_peer(task_name, mode, data, s)
            except RuntimeError as e:
                print(f"{task_name} {mode}: FAILED: {e}", flush=True)
                continue
        elif mode not in task_class(task_name).modes():  # another task's own mode
            print(f"{mode}: skipped (not a mode of {task_name}; its modes: "
                  f"{' '.join(task_class(task_name).modes())})", flush=True)
            continue
        elif s.distributed:  # every rank runs its part of the mode in its own process already
            rec = run_mode(task_name, mode, data, s, flops)
        else:
            rec = run_mode_alone(task_name, mode, s, flops)
        rec = {**meta, **rec, **flops.result(rec, peak)}
        losses[mode] = rec["first_loss"]
        if main:
            _append(s.out, rec)
            print(_summary(rec), flush=True)
        records.append(rec)
        check_losses(task_name, losses)  # fail loudly, as soon as a mode disagrees
    if losses:
        line = check_losses(task_name, losses)
        if main:
            print(line, flush=True)
    return records


def _summary(r: dict[str, Any]) -> str:
    extra = ""
    if "launches" in r:
        extra = (f", {r['launches']:.0f} launches ({r['launches_over_bound']:.2f}x bound), "
                 f"{r['gathers']:.0f} copies ({r['gathers_avoided']:.0f} avoided)")
    if r.get("world_size", 1) > 1:
        extra += (f"; {r['world_size']} processes: train "
                  + " + ".join(f"{x:.1f}" for x in r["per_process"]) + f" = {r['total']:.1f}/s")
    if r.get("lstm_paths"):
        extra += "; LSTM layers " + ", ".join(f"{p} x{n}" for p, n in r["lstm_paths"].items())
    if r.get("tree_lstm_paths"):
        extra += "; Tree-LSTM cells " + ", ".join(
            f"{p} x{n}" for p, n in r["tree_lstm_paths"].items())
    if r.get("gemm_paths"):
        extra += "; products " + ", ".join(f"{p} x{n}" for p, n in r["gemm_paths"].items())
    if r.get("dynet"):
        extra += f" (DyNet {r['dynet']})"
    if "gflop_per_s" in r:
        extra += f"; {r['gflop_per_s']:.1f} GFLOP/s, {r['percent_of_peak']:.0f}% of peak"
    return (f"{r['task']:16s} {r['mode']:13s} train {r['train_per_s']:8.1f}/s  "
            f"eval {r['eval_per_s']:8.1f}/s  loss0 {r['first_loss']:.6g}{extra}")


def _append(path: str, rec: dict[str, Any]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("a") as f:
        f.write(json.dumps(rec) + "\n")
