"""`python -m flybatch.bench quality`: batching quality on the literature's workload families.

For each family of `workloads.py` and each strategy: kernel launches per minibatch, the lower
bound (`stats().lower_bound`) and the tight bound (`stats().tight_bound`, which counts
signatures that interleave differently on different paths), the ratio of launches to each, and
scheduling cost per node. One training graph
per (family, strategy), float32, 1 thread. Launches are exact; scheduling us/node is the median
over `--repeats` builds of the same graph (a single cold call is spiky: the process shares its
core, and one descheduling can multiply one forward's time several times).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import flybatch as fb
from flybatch.bench import workloads

STRATEGIES = ("depth", "agenda", "auto")


def measure(fam: workloads.Family, strategy: str, n_instances: int, seed: int,
            repeats: int = 1) -> dict:
    """One family's graph under one strategy, built `repeats` times (the launches of every
    build are the same; the scheduling time is their median)."""
    items = workloads.instances(fam, n_instances, seed)
    us_per_node = []
    for _ in range(repeats):
        with fb.Graph(strategy=strategy) as g:
            fb.esum(workloads.build(fb, fam, workloads.make_params(), items)).backward()
            stats = g.stats()
        us_per_node.append(stats.seconds["schedule"] / stats.nodes * 1e6)
    return {"family": fam.name, "strategy": strategy, "nodes": stats.nodes,
            "launches": stats.batches, "bound": stats.lower_bound, "tight": stats.tight_bound,
            "schedule_us_per_node": statistics.median(us_per_node), "repeats": repeats}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flybatch.bench quality",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=20, help="instances per minibatch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--repeats", type=int, default=5,
                        help="builds per (family, strategy); us/node is their median")
    parser.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(fam, s, args.instances, args.seed, args.repeats)
            for fam in workloads.FAMILIES for s in args.strategies]
    print("| family | strategy | nodes | launches | lower bound | ratio | tight bound | ratio "
          f"| schedule us/node (median of {args.repeats}) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['family']} | {r['strategy']} | {r['nodes']} | {r['launches']} | "
              f"{r['bound']} | {r['launches'] / r['bound']:.2f} | "
              f"{r['tight']} | {r['launches'] / r['tight']:.2f} | "
              f"{r['schedule_us_per_node']:.2f} |")
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps({"task": "quality", **r}) + "\n")


if __name__ == "__main__":
    main()
