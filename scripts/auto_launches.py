"""Launches of a strategy on every `bench quality` family, for checking a scheduler change.

    PYTHONPATH=<checkout>/src python scripts/auto_launches.py > new.txt
    PYTHONPATH=<checkout>/src python scripts/auto_launches.py --against old.txt

prints one line per graph, `family instances seed launches`, over the families of
`flybatch.bench.workloads` at 8, 20 and 40 instances, seeds 0-2 (one forward each). With
`--against` (a file this script wrote for another checkout) it prints instead the totals and
every graph that launches more or fewer, and exits 1 if any launches more: a change to `auto`
that is meant to be faster only must print no difference.
"""

from __future__ import annotations

import argparse
import sys

import torch

import flybatch as fb
from flybatch.bench import workloads

SIZES = (8, 20, 40)
SEEDS = (0, 1, 2)


def launches(strategy: str) -> dict[tuple[str, int, int], int]:
    counts = {}
    for fam in workloads.FAMILIES:
        for size in SIZES:
            for seed in SEEDS:
                items = workloads.instances(fam, size, seed)
                with fb.Graph(strategy=strategy) as g:
                    fb.esum(workloads.build(fb, fam, workloads.make_params(), items))
                    g.forward()
                    counts[fam.name, size, seed] = g.stats().batches
    return counts


def read(path: str) -> dict[tuple[str, int, int], int]:
    counts = {}
    with open(path) as f:
        for line in f:
            name, size, seed, n = line.split()
            counts[name, int(size), int(seed)] = int(n)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--against", help="launches of another checkout, as this script prints them")
    args = ap.parse_args()
    torch.set_num_threads(1)
    counts = launches(args.strategy)
    if not args.against:
        for (name, size, seed), n in counts.items():
            print(name, size, seed, n)
        return
    old = read(args.against)
    print(f"{len(counts)} graphs: {sum(old.values())} launches before, {sum(counts.values())} now")
    worse = False
    for key, n in counts.items():
        if key in old and n != old[key]:
            print(f"  {key[0]} x{key[1]} seed {key[2]}: {old[key]} -> {n}")
            worse |= n > old[key]
    sys.exit(1 if worse else 0)


if __name__ == "__main__":
    main()
