"""`python -m flybatch.bench quality`: batching quality on the literature's workload families.

For each family of `workloads.py` and each strategy: kernel launches per minibatch, the lower
bound (`stats().lower_bound`) and the tight bound (`stats().tight_bound`, which counts
signatures that interleave differently on different paths), the ratio of launches to each, and
scheduling cost per node. One training graph
per (family, strategy), float32, 1 thread; launches are exact, times are one run's.
"""

from __future__ import annotations

import argparse
import json

import torch

import flybatch as fb
from flybatch.bench import workloads

STRATEGIES = ("depth", "agenda", "auto")


def measure(fam: workloads.Family, strategy: str, n_instances: int, seed: int) -> dict:
    params = workloads.make_params()
    items = workloads.instances(fam, n_instances, seed)
    with fb.Graph(strategy=strategy) as g:
        fb.esum(workloads.build(fb, fam, params, items)).backward()
        stats = g.stats()
    return {"family": fam.name, "strategy": strategy, "nodes": stats.nodes,
            "launches": stats.batches, "bound": stats.lower_bound, "tight": stats.tight_bound,
            "schedule_us_per_node": stats.seconds["schedule"] / stats.nodes * 1e6}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flybatch.bench quality",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=20, help="instances per minibatch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(fam, s, args.instances, args.seed)
            for fam in workloads.FAMILIES for s in args.strategies]
    print("| family | strategy | nodes | launches | lower bound | ratio | tight bound | ratio "
          "| schedule us/node |")
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
