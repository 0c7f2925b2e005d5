"""Scheduling: group the pending nodes of a graph into batches, each run as one kernel.

A `Schedule` is plain data (lists of node ids in row order), so it can be printed, counted and
tested without running anything. Three strategies:

- `none`: one batch per node, in creation order (the unbatched baseline).
- `depth` (TensorFlow Fold): nodes of equal signature at equal depth form one batch.
- `agenda` (DyNet's autobatcher): keep the ready nodes bucketed by signature; repeatedly run ALL
  ready nodes of the signature with the lowest average depth (cheap ops first on ties), which
  lets e.g. every loss wait until the longest sequence is done and then run as one batch.

Both batching strategies work per batch on numpy arrays, never per node in Python. Scheduling also
fixes where each node's value will live (`graph.node_batch/node_row`) and orders the rows of each
batch by where its most recent input lives, so that the next batch usually finds its inputs as a
contiguous, in-order run of an earlier result and reads them without a copy.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from . import signatures

if TYPE_CHECKING:
    from .graph import Graph

_ROW_BITS = 32  # a (batch, row) position packed into one sortable int


@dataclass
class Schedule:
    """The batches of one forward, with the argument arrays the executor reads them through."""

    start: int                 # first pending node id
    first_batch: int           # global index of batches[0] in graph.values
    batches: list[np.ndarray]  # node ids of each batch, in row order
    arg_ptr: np.ndarray        # args of pending node v: arg_flat[arg_ptr[v-start]:arg_ptr[v-start+1]]
    arg_flat: np.ndarray

    def __len__(self) -> int:
        return len(self.batches)

    def describe(self, graph: "Graph") -> str:
        """One line per batch: global index, size and readable signature."""
        return "\n".join(
            f"{self.first_batch + i:5d}  x{len(b):<5d} {signatures.describe(graph.sigs[int(b[0])])}"
            for i, b in enumerate(self.batches))

    def __repr__(self) -> str:
        nodes = sum(len(b) for b in self.batches)
        return f"Schedule({len(self.batches)} batches, {nodes} nodes)"


def schedule(graph: "Graph", start: int, end: int) -> Schedule:
    """Batch the nodes `start..end-1` of `graph` with the graph's strategy."""
    n = end - start
    arg_lists = graph.args[start:end]
    lens = np.fromiter(map(len, arg_lists), np.int64, n)
    arg_ptr = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=arg_ptr[1:])
    arg_flat = np.fromiter(chain.from_iterable(arg_lists), np.int64, int(arg_ptr[-1]))
    plan = Schedule(start, len(graph.values), [], arg_ptr, arg_flat)
    if graph.strategy == "none":
        nodes = np.arange(start, end)
        graph.node_batch[start:end] = plan.first_batch + np.arange(n)
        graph.node_row[start:end] = 0
        plan.batches = list(nodes.reshape(n, 1))
        return plan
    sigs = np.array(graph.sigs[start:end], np.int64)
    depths = np.array(graph.depths[start:end], np.int64)
    placer = _Placer(graph, plan, lens)
    if graph.strategy == "depth":
        _depth(sigs, depths, placer)
    else:
        _agenda(graph, plan, sigs, depths, lens, placer)
    return plan


class _Placer:
    """Appends batches to the plan, choosing the row order and recording node positions."""

    def __init__(self, graph: "Graph", plan: Schedule, lens: np.ndarray):
        self.graph, self.plan, self.lens = graph, plan, lens

    def place(self, local: np.ndarray) -> None:
        plan, graph = self.plan, self.graph
        nodes = local + plan.start
        if len(nodes) > 1 and self.lens[local[0]] > 0:
            nodes = nodes[self._row_order(local)]
        batch = plan.first_batch + len(plan.batches)
        graph.node_batch[nodes] = batch
        graph.node_row[nodes] = np.arange(len(nodes))
        plan.batches.append(nodes)

    def _row_order(self, local: np.ndarray) -> np.ndarray:
        """Sort rows by the position of the input fed by the most recent earlier batch.

        That input is usually the recurrent one (the previous step's state, a child's output),
        and rows that follow its order let the next gather be a zero-copy view.
        """
        k = min(int(self.lens[local[0]]), 4)
        cols = self.plan.arg_flat[self.plan.arg_ptr[local][:, None] + np.arange(k)]
        src = self.graph.node_batch[cols]
        varying = (cols != cols[:1]).any(axis=0)
        if not varying.any():
            return np.arange(len(local))
        recency = np.where(varying, src.max(axis=0), -1)
        j = int(recency.argmax())
        key = (src[:, j] << _ROW_BITS) | self.graph.node_row[cols[:, j]]
        return np.argsort(key, kind="stable")


def _depth(sigs: np.ndarray, depths: np.ndarray, placer: _Placer) -> None:
    order = np.lexsort((sigs, depths))
    d, s = depths[order], sigs[order]
    cuts = np.flatnonzero((d[1:] != d[:-1]) | (s[1:] != s[:-1])) + 1
    for group in np.split(order, cuts):
        placer.place(np.sort(group))


def _agenda(graph: "Graph", plan: Schedule, sigs: np.ndarray, depths: np.ndarray,
            lens: np.ndarray, placer: _Placer) -> None:
    n = len(sigs)
    start = plan.start
    # Edges between pending nodes, and each node's consumers as a CSR array.
    dst_all = np.repeat(np.arange(n), lens)
    inside = plan.arg_flat >= start
    src, dst = plan.arg_flat[inside] - start, dst_all[inside]
    waiting = np.bincount(dst, minlength=n)
    consumers = dst[np.argsort(src, kind="stable")]
    cons_ptr = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(src, minlength=n), out=cons_ptr[1:])

    # Priority of a signature: the average depth of its pending nodes; cheap ops first on ties.
    uniq, sig_of = np.unique(sigs, return_inverse=True)
    first_of = np.zeros(len(uniq), np.int64)
    first_of[sig_of[::-1]] = np.arange(n)[::-1]
    avg_depth = np.bincount(sig_of, weights=depths) / np.bincount(sig_of)
    costly = np.array([not graph.ops[start + int(f)].cheap for f in first_of])
    priority = np.empty(len(uniq), np.int64)
    priority[np.lexsort((uniq, costly, avg_depth))] = np.arange(len(uniq))

    ready: dict[int, list[np.ndarray]] = {}
    heap: list[int] = []

    def make_ready(nodes: np.ndarray) -> None:
        groups = sig_of[nodes]
        order = np.argsort(groups, kind="stable")
        nodes, groups = nodes[order], groups[order]
        cuts = np.flatnonzero(groups[1:] != groups[:-1]) + 1
        for part, g in zip(np.split(nodes, cuts), groups[np.r_[0, cuts]]):
            bucket = ready.setdefault(int(g), [])
            if not bucket:
                heapq.heappush(heap, int(priority[g]))
            bucket.append(part)

    sig_at_priority = np.argsort(priority)
    make_ready(np.flatnonzero(waiting == 0))
    while heap:
        g = int(sig_at_priority[heapq.heappop(heap)])
        parts = ready.pop(g)
        batch = parts[0] if len(parts) == 1 else np.sort(np.concatenate(parts))
        placer.place(batch)
        begin, stop = cons_ptr[batch], cons_ptr[batch + 1]
        counts = stop - begin
        total = int(counts.sum())
        if total == 0:
            continue
        offsets = np.repeat(begin - np.cumsum(counts) + counts, counts)
        released = consumers[offsets + np.arange(total)]
        nodes, hits = np.unique(released, return_counts=True)
        waiting[nodes] -= hits
        now_ready = nodes[waiting[nodes] == 0]
        if len(now_ready):
            make_ready(now_ready)
