"""Torch ops and autograd nodes of one benchmark task's training step, counted.

    PYTHONPATH=<checkout>/src python scripts/step_ops.py TASK [MODE] [--data-dir D] [--all]

prints one JSON line: the top-level torch ops the forward ran, the autograd nodes backward
evaluated and the torch ops they ran, per step (a minibatch of 64, after two warm-up steps),
and with `--all` the counts by name. Unlike time on a shared machine, these counts do not
move between runs, so they show what a change to a kernel removed even when
`scripts/step_phases.py` cannot resolve its few per cent.
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
from torch.profiler import ProfilerActivity, profile

from flybatch.bench.tasks import create
from flybatch.bench.tasks_data import minibatches, prepare

_NODE = "autograd::engine::evaluate_function: "


def _counts(events) -> collections.Counter:
    """(forward op | backward node | backward op, name) -> calls: torch ops not called by
    another torch op, on the side of the autograd node they ran under, if any."""
    counts: collections.Counter = collections.Counter()
    for event in events:
        if event.name.startswith(_NODE):
            counts["backward node", event.name[len(_NODE):]] += 1
            continue
        if not event.name.startswith("aten::"):
            continue
        parent, in_backward, top = event.cpu_parent, False, True
        while parent is not None:
            in_backward |= parent.name.startswith(_NODE)
            top &= not parent.name.startswith("aten::")
            parent = parent.cpu_parent
        if top:
            counts["backward op" if in_backward else "forward op", event.name] += 1
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("task")
    ap.add_argument("mode", nargs="?", default="auto")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--all", action="store_true", help="also the counts by name")
    args = ap.parse_args()
    torch.set_num_threads(1)
    data = prepare(args.task, args.data_dir, 0)
    task = create(args.task, data, "cpu", 0)
    batches = minibatches(data.train, 64, 0)

    def step() -> None:
        task.step(args.mode, next(batches), train=True)
        for p in task.params.values():
            p.grad = None

    step()
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    counts = _counts(prof.events())
    totals = collections.Counter()
    for (side, _), n in counts.items():
        totals[side] += n
    line = {"task": args.task, "mode": args.mode, **dict(sorted(totals.items()))}
    if args.all:
        line["by_name"] = {f"{side}: {name}": n for (side, name), n in sorted(counts.items())}
    print(json.dumps(line))


if __name__ == "__main__":
    main()
