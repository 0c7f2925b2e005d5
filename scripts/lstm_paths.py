"""Paired A/B of the LSTM layer's kernel paths (flybatch/lstm_layer.py) in one benchmark task.

    PYTHONPATH=<checkout>/src taskset -c 1 python scripts/lstm_paths.py TASK [A B] [--pairs N]
        [--data-dir D] [--eval]

trains each minibatch once on path A and once on path B (default "onednn" and "auto"), the
order alternating from pair to pair, and prints one JSON line: the median thread-CPU
milliseconds of a step per path and the median of the pairs' B / A ratios. Paired on the same
minibatch in one process, the comparison is steadier than separate processes on a machine
whose speed drifts; run it with A = B too, to see the noise (a ratio of 0.97 or 1.03 is
within it on a shared machine). The LSTM launches per path are printed as well.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from flybatch import lstm_layer
from flybatch.bench.tasks import create
from flybatch.bench.tasks_data import minibatches, prepare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("task")
    ap.add_argument("paths", nargs="*", default=["onednn", "auto"])
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--eval", action="store_true", help="forward only (evaluation steps)")
    args = ap.parse_args()
    if len(args.paths) != 2:
        ap.error("give two paths (A B), or none")
    torch.set_num_threads(1)
    data = prepare(args.task, args.data_dir, 0)
    task = create(args.task, data, "cpu", 0)
    batches = minibatches(data.train, 64, 0)
    before = dict(lstm_layer.lstm_counts)

    def step_ms(path: str, batch: list) -> float:
        lstm_layer.set_lstm(path)
        start = time.thread_time()
        task.step("agenda", batch, train=not args.eval)
        elapsed = time.thread_time() - start
        for p in task.params.values():
            p.grad = None
        return 1e3 * elapsed

    for _ in range(args.warmup):
        batch = next(batches)
        for path in args.paths:
            step_ms(path, batch)
    times: list[list[float]] = [[], []]
    for pair in range(args.pairs):
        batch = next(batches)
        for k in ((0, 1) if pair % 2 == 0 else (1, 0)):
            times[k].append(step_ms(args.paths[k], batch))
    print(json.dumps({
        "task": args.task, "eval": args.eval, "pairs": args.pairs, "A": args.paths[0],
        "B": args.paths[1],
        "A_step_cpu_ms": round(statistics.median(times[0]), 1),
        "B_step_cpu_ms": round(statistics.median(times[1]), 1),
        "median_B_over_A": round(statistics.median(b / a for a, b in zip(*times)), 3),
        "lstm_launches": {p: n - before[p] for p, n in lstm_layer.lstm_counts.items()},
    }))


if __name__ == "__main__":
    main()
