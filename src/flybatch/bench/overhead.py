"""`python -m flybatch.bench overhead`: what flybatch itself costs per node, at four graph sizes.

The graph is a minibatch of RNN-like sequences of random lengths (a lookup, an affine
transform, an add and a tanh per step; a loss per sequence), the shape of the paper's workloads.
Building is timed from the first op call to the last (Python only: no torch work happens then),
scheduling is `scheduling.schedule` on the whole graph. Costs per node should be flat across
sizes (linear total cost); the floors (issue 10) are 0.5 us per node for building, 0.15 us for
agenda scheduling and 0.1 us for depth scheduling. One thread: the cost of flybatch itself.
Memory is the growth of the resident set over the first build of each size (the benchmark's
own per-instance data included), once built and once scheduled with the schedule alive, for
the first strategy; the floor is 100 B per node, meaningful at the large sizes.

It also times incremental forwards of about 75 nodes (`--forward-steps`): 15 parsers each score
one transition (concat of four encoder states, affine, tanh, product, loss) and ask for the
values, as the parser benchmark does about 110 times a minibatch. A forward costs scheduling,
read planning, and one torch call per batch and gather; the tensors are tiny (16 wide). The
forward's fixed cost is its time minus the time inside its batch kernels (the graph's
`kernel_seconds` counter, on for these forwards only): what it costs beyond its kernels, which
issue 10 wants at or below 100 us. Two layouts: the features read rows of ONE earlier result
(the parser's, whose BiLSTM outputs are one batch) and rows scattered over the results of every
encoder step.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import statistics
import time

import torch
import torch.nn.functional as F

import flybatch as fb
from flybatch import scheduling

HIDDEN = 16
OPS_PER_STEP = 4  # lookup, affine, add, tanh


def _model_and_data(n_nodes: int, seed: int):
    """(W, U, b, E, O), and word ids and labels of sequences making about `n_nodes` nodes."""
    torch.manual_seed(seed)
    W = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN))
    U = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN))
    b = torch.nn.Parameter(torch.zeros(HIDDEN))
    E = torch.nn.Parameter(torch.randn(1000, HIDDEN))
    O = torch.nn.Parameter(torch.randn(5, HIDDEN))
    rng = random.Random(seed)
    lengths, total = [], 0
    while total < n_nodes:
        length = rng.randint(5, 60)
        lengths.append(length)
        total += OPS_PER_STEP * length + 2
    words = [[rng.randrange(1000) for _ in range(n)] for n in lengths]
    labels = [rng.randrange(5) for _ in lengths]
    return (W, U, b, E, O), words, labels


def build(n_nodes: int, strategy: str, seed: int = 0) -> tuple[fb.Graph, float]:
    """A graph of about `n_nodes` nodes; returns it and the seconds spent building it."""
    (W, U, b, E, O), words, labels = _model_and_data(n_nodes, seed)
    graph = fb.Graph(strategy=strategy)
    start = time.perf_counter()
    losses = []
    for sentence, label in zip(words, labels):
        h = fb.zeros(HIDDEN, graph=graph)
        for w in sentence:
            h = fb.tanh(fb.affine(W, h, b) + fb.matmul(U, fb.lookup(E, w, graph=graph)))
        losses.append(fb.pick_neg_log_softmax(fb.matmul(O, h), label))
    seconds = time.perf_counter() - start
    return graph, seconds


def build_torch_native(n_nodes: int, seed: int = 0) -> tuple[int, float, int]:
    """The same graph written as plain torch code inside `with fb.Graph()` (the capture layer
    records each torch call); returns its nodes, the seconds spent and the torch calls made."""
    (W, U, b, E, O), words, labels = _model_and_data(n_nodes, seed)
    labels = [torch.tensor(label) for label in labels]
    zero = torch.zeros(HIDDEN)
    calls = sum(4 * len(sentence) + 2 for sentence in words)
    with fb.Graph() as graph:
        start = time.process_time()  # CPU time: less sensitive to a loaded machine than wall
        for sentence, label in zip(words, labels):
            h = zero
            for w in sentence:  # E[w], F.linear twice, +, tanh
                h = torch.tanh(F.linear(h, W, b) + F.linear(E[w], U))
            F.cross_entropy(F.linear(h, O), label)
        seconds = time.process_time() - start
        nodes = graph.n_nodes
    return nodes, seconds, calls


def measure_capture(n_nodes: int, repeats: int) -> dict:
    per_call, per_node, fb_per_node = [], [], []
    build_torch_native(200)  # first calls meet new signatures: output shapes from meta tensors
    for r in range(repeats):
        gc.collect()
        nodes, seconds, calls = build_torch_native(n_nodes, seed=r)
        per_call.append(seconds / calls * 1e6)
        per_node.append(seconds / nodes * 1e6)
        gc.collect()
        start = time.process_time()
        graph, _ = build(n_nodes, "agenda", seed=r)
        fb_per_node.append((time.process_time() - start) / graph.n_nodes * 1e6)
        graph.close()
    return {"nodes": n_nodes, "capture_us_per_call": statistics.median(per_call),
            "capture_us_per_node": statistics.median(per_node),
            "fb_ops_us_per_node": statistics.median(fb_per_node)}


def resident_bytes() -> int:
    """The resident memory of this process now (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return 0


def measure(n_nodes: int, strategy: str, repeats: int, memory: bool) -> dict:
    """Build and schedule `repeats` graphs; with `memory`, also the bytes per node of the first
    (measure the first graph of a size only: glibc keeps the blocks freed while an earlier
    graph's columns grew, so a later one at the same size reads up to ~30 B/node higher)."""
    build_us, schedule_us, batches, bytes_per_node = [], [], 0, {}
    for r in range(repeats):
        gc.collect()
        before = resident_bytes()
        graph, seconds = build(n_nodes, strategy, seed=r)
        n = graph.n_nodes
        built = resident_bytes()
        graph._grow_positions(n)
        start = time.perf_counter()
        plan = scheduling.schedule(graph, 0, n)
        schedule_us.append((time.perf_counter() - start) / n * 1e6)
        build_us.append(seconds / n * 1e6)
        batches = len(plan)
        if memory and r == 0:
            bytes_per_node = {"built_bytes_per_node": (built - before) / n,
                              "scheduled_bytes_per_node": (resident_bytes() - before) / n}
        graph.close()
    return {"nodes": n, "strategy": strategy, "build_us_per_node": statistics.median(build_us),
            "schedule_us_per_node": statistics.median(schedule_us), "batches": batches,
            **bytes_per_node}


PARSERS, FEATURES = 15, 4


def measure_forward(strategy: str, steps: int, scattered: bool, seed: int = 0) -> dict:
    """Median microseconds of an incremental forward of one scoring step of every parser: in
    all, inside its batch kernels, and the rest (its fixed cost)."""
    torch.manual_seed(seed)
    W, W_out = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN)), torch.nn.Parameter(
        torch.randn(HIDDEN, HIDDEN))
    U = torch.nn.Parameter(torch.randn(HIDDEN, FEATURES * HIDDEN))
    b = torch.nn.Parameter(torch.zeros(HIDDEN))
    O = torch.nn.Parameter(torch.randn(3, HIDDEN))
    E = torch.nn.Parameter(torch.randn(1000, HIDDEN))
    rng = random.Random(seed)
    seconds, kernel_seconds, nodes = [], [], 0
    with fb.Graph(strategy=strategy) as graph:
        encoded = []
        for _ in range(PARSERS):
            h, states = fb.zeros(HIDDEN), []
            for _ in range(rng.randint(10, 40)):
                h = fb.tanh(fb.affine(W, h, b) + fb.lookup(E, rng.randrange(1000)))
                # The output projection of every token is one batch (one result), as a
                # BiLSTM's outputs are; without it the states live in one result per step.
                states.append(h if scattered else fb.relu(fb.matmul(W_out, h)))
            encoded.append(states)
        graph.forward()
        graph.kernel_seconds = 0.0
        for step in range(steps):
            before = graph.n_nodes
            for states in encoded:
                features = fb.concat([rng.choice(states) for _ in range(FEATURES)])
                scores = fb.matmul(O, fb.tanh(fb.affine(U, features, b)))
                fb.pick_neg_log_softmax(scores, rng.randrange(3))
            nodes = graph.n_nodes - before
            in_kernels = graph.kernel_seconds
            start = time.perf_counter()
            graph.forward()
            seconds.append(time.perf_counter() - start)
            kernel_seconds.append(graph.kernel_seconds - in_kernels)
    warm = len(seconds) // 10  # the first forwards warm torch's caches up
    fixed = [s - k for s, k in zip(seconds[warm:], kernel_seconds[warm:])]
    return {"nodes": nodes, "strategy": strategy,
            "reads": "scattered" if scattered else "one result",
            "forward_us": statistics.median(seconds[warm:]) * 1e6,
            "kernel_us": statistics.median(kernel_seconds[warm:]) * 1e6,
            "fixed_us": statistics.median(fixed) * 1e6}


def _bytes(row: dict, key: str) -> str:
    return f"{row[key]:.0f}" if key in row else "-"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flybatch.bench overhead",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000, 1_000_000])
    parser.add_argument("--strategies", nargs="+", default=["agenda", "depth"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--forward-steps", type=int, default=300,
                        help="incremental forwards timed per strategy (0: none)")
    parser.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    rows = [measure(size, s, args.repeats if size < 1_000_000 else 1,
                    memory=s == args.strategies[0])
            for size in args.sizes for s in args.strategies]
    print("| nodes | strategy | build us/node | schedule us/node | batches | B/node built | "
          "B/node scheduled |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['nodes']} | {row['strategy']} | {row['build_us_per_node']:.2f} | "
              f"{row['schedule_us_per_node']:.2f} | {row['batches']} | "
              f"{_bytes(row, 'built_bytes_per_node')} | "
              f"{_bytes(row, 'scheduled_bytes_per_node')} |")
    # Torch-native code (capture/): the same model as torch calls, recorded one call each.
    captured = [measure_capture(size, args.repeats) for size in args.sizes if size <= 100_000]
    print()
    print("| nodes | torch-native build us/call | us/node | fb ops build us/node |")
    print("|---|---|---|---|")
    for row in captured:
        print(f"| {row['nodes']} | {row['capture_us_per_call']:.2f} | "
              f"{row['capture_us_per_node']:.2f} | {row['fb_ops_us_per_node']:.2f} |")
    forwards = [measure_forward(s, args.forward_steps, scattered)
                for scattered in (False, True) for s in args.strategies
                if args.forward_steps]
    if forwards:
        print()
        print("| forward of | reads | strategy | us/forward | in kernels | fixed cost |")
        print("|---|---|---|---|---|---|")
        for row in forwards:
            print(f"| {row['nodes']} nodes | {row['reads']} | {row['strategy']} | "
                  f"{row['forward_us']:.0f} | {row['kernel_us']:.0f} | {row['fixed_us']:.0f} |")
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps({"task": "overhead", **row}) + "\n")
            for row in captured:
                f.write(json.dumps({"task": "overhead-capture", **row}) + "\n")
            for row in forwards:
                f.write(json.dumps({"task": "overhead-forward", **row}) + "\n")


if __name__ == "__main__":
    main()
