"""Medians of one benchmark task's training step, for A/B runs of two checkouts.

    PYTHONPATH=<checkout>/src taskset -c 1 python scripts/step_phases.py TASK [MODE] [--data-dir D]

prints one JSON line: the CPU milliseconds of a training step (thread time, so that other
processes on a shared machine count less), the phases the graph reports (build, schedule,
forward, backward, wall ms), the kernel launches and the first loss, as medians over `--steps`
minibatches after `--warmup`. Alternate it between the two checkouts, a few times each, and
compare medians: one process per run, the same minibatches in each. Gradients are dropped
after each step, as the benchmark's optimizer update does (accumulated over steps, the
embedding table's sparse gradient grows and its accumulation would be timed too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from flybatch.bench.tasks import create
from flybatch.bench.tasks_data import minibatches, prepare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("task")
    ap.add_argument("mode", nargs="?", default="auto")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    data = prepare(args.task, args.data_dir, 0)
    task = create(args.task, data, "cpu", 0)
    batches = minibatches(data.train, 64, 0)

    def step():
        result = task.step(args.mode, next(batches), train=True)
        for p in task.params.values():
            p.grad = None
        return result

    first = step()
    for _ in range(args.warmup):
        step()
    cpu, phases, launches = [], [], []
    for _ in range(args.steps):
        start = time.thread_time()
        result = step()
        cpu.append(time.thread_time() - start)
        phases.append(result.seconds)
        if result.stats is not None:
            launches.append(result.stats.batches)
    names = sorted({name for p in phases for name in p})
    print(json.dumps({
        "task": args.task, "mode": args.mode,
        "step_cpu_ms": round(1e3 * statistics.median(cpu), 1),
        **{f"{name}_ms": round(1e3 * statistics.median(p.get(name, 0.0) for p in phases), 1)
           for name in names},
        "launches": statistics.median(launches) if launches else None,
        "first_loss": round(first.loss, 4)}))


if __name__ == "__main__":
    main()
