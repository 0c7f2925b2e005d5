"""What a graph did: nodes, kernel launches, batch sizes, copies, time, and the best possible.

`lower_bound` is the number of launches no schedule can beat (the bound ED-Batch uses): one
launch runs nodes of one signature, and nodes of the same signature on one dependency path must
run in different launches, so a signature needs at least as many launches as the most nodes of
it on any path. Value requests split a graph into forwards whose nodes cannot share launches,
so the bound is summed over the forwards that computed the nodes (pending nodes: one more).
Computed by dynamic programming over depth levels, vectorised over signatures.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import TYPE_CHECKING, Callable

import numpy as np

from . import signatures

if TYPE_CHECKING:
    from .graph import Graph


@dataclass
class Stats:
    strategy: str
    nodes: int
    batches: int                       # kernel launches of non-leaf ops
    batch_sizes: Counter               # size -> launches
    by_signature: Counter              # readable signature -> launches
    gathers: int                       # input copies made (index_select / cat)
    gathers_avoided: int               # inputs read as a view (contiguous run or shared node)
    seconds: dict = field(default_factory=dict)  # build, schedule, forward, backward
    _bound: Callable[[], int] = field(default=lambda: 0, repr=False, compare=False)

    @cached_property
    def lower_bound(self) -> int:
        """Launches no schedule can beat; computed on first use (it is a pass over the graph)."""
        return self._bound()

    @property
    def launches_over_bound(self) -> float:
        return self.batches / self.lower_bound if self.lower_bound else 1.0

    def __str__(self) -> str:
        lines = [
            f"strategy {self.strategy}: {self.nodes} nodes, {self.batches} launches "
            f"(lower bound {self.lower_bound}, ratio {self.launches_over_bound:.2f})",
            f"gathers {self.gathers} made, {self.gathers_avoided} avoided; time "
            + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.seconds.items()),
            f"{'launches':>9}  signature",
        ]
        for sig, n in self.by_signature.most_common():
            lines.append(f"{n:9d}  {sig}")
        return "\n".join(lines)


def collect(graph: "Graph") -> Stats:
    sizes = Counter(size for _, size in graph.launches)
    by_sig = Counter(signatures.describe(sig, graph) for sig, _ in graph.launches)
    return Stats(graph.strategy, graph.n_nodes, len(graph.launches), sizes, by_sig,
                 graph.gathers, graph.gathers_avoided, dict(graph.seconds),
                 partial(lower_bound, graph, graph.n_nodes))


def lower_bound(graph: "Graph", n: int | None = None) -> int:
    """The lower bound over the first `n` nodes (default: all), summed over forwards."""
    n = graph.n_nodes if n is None else n
    if n == 0:
        return 0
    leaf = np.fromiter((op.leaf for op in graph.ops[:n]), bool, n)
    sigs = np.array(graph.sigs[:n], np.int64)
    # Depths count pending inputs only (see Graph.add), so order levels by the forward that
    # computed a node first, then by depth: every edge goes to a later level.
    depths = np.array(graph.depths[:n], np.int64)
    segment = np.searchsorted(np.array(graph.forward_ends, np.int64), np.arange(n), side="right")
    depths = segment * (int(depths.max()) + 1) + depths
    compute = np.flatnonzero(~leaf)
    if len(compute) == 0:
        return 0
    _, sig_of = np.unique(sigs[compute], return_inverse=True)
    dense = np.full(n, -1, np.int64)
    dense[compute] = sig_of
    n_sigs = int(sig_of.max()) + 1
    # count[v, s]: most nodes of signature s on any path ending at v.
    count = np.zeros((n, n_sigs), np.int32)
    ends = np.array(graph.arg_end[:n], np.int64)
    lens = np.diff(ends, prepend=0)
    dst = np.repeat(np.arange(n), lens)
    src = np.array(graph.arg_flat[:int(ends[-1])], np.int64)
    # Nodes computed by different forwards can never share a launch (a value was asked for in
    # between), so the bound is taken per forward: edges into a later forward start afresh.
    same_forward = segment[src] == segment[dst]
    src, dst = src[same_forward], dst[same_forward]
    edge_level = depths[dst]
    order = np.argsort(edge_level, kind="stable")
    src, dst, edge_level = src[order], dst[order], edge_level[order]
    node_order = compute[np.argsort(depths[compute], kind="stable")]
    node_levels = depths[node_order]
    for level in np.unique(node_levels):
        lo, hi = np.searchsorted(edge_level, [level, level + 1])
        if hi > lo:
            np.maximum.at(count, dst[lo:hi], count[src[lo:hi]])
        a, b = np.searchsorted(node_levels, [level, level + 1])
        at = node_order[a:b]
        count[at, dense[at]] += 1
    starts = np.r_[0, [e for e in graph.forward_ends if e < n]].astype(np.int64)
    return int(np.maximum.reduceat(count, starts, axis=0).sum())
