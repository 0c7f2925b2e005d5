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
            f"{self.first_batch + i:5d}  x{len(b):<5d} "
            f"{signatures.describe(graph.sigs[int(b[0])], graph)}"
            for i, b in enumerate(self.batches))

    def __repr__(self) -> str:
        nodes = sum(len(b) for b in self.batches)
        return f"Schedule({len(self.batches)} batches, {nodes} nodes)"


def schedule(graph: "Graph", start: int, end: int) -> Schedule:
    """Batch the nodes `start..end-1` of `graph` with the graph's strategy."""
    n = end - start
    first_arg = graph.arg_end[start - 1] if start else 0
    arg_ptr = np.empty(n + 1, np.int64)
    arg_ptr[0] = first_arg
    arg_ptr[1:] = graph.arg_end[start:end]
    arg_flat = np.array(graph.arg_flat[first_arg:int(arg_ptr[-1])], np.int64)
    arg_ptr -= first_arg
    lens = np.diff(arg_ptr)
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
    if graph.strategy == "depth" or _one_depth_per_signature(sigs, depths):
        # (With one depth per signature, the agenda's groups are exactly the depth batches.)
        _depth(sigs, depths, placer)
    else:
        _agenda(graph, plan, sigs, depths, lens, placer)
    return plan


def _one_depth_per_signature(sigs: np.ndarray, depths: np.ndarray) -> bool:
    """Whether all pending nodes of each signature sit at one depth.

    Then no path holds two nodes of one signature, every (signature, rank) group of the agenda
    is a whole signature, and batching by (depth, signature) is the same schedule, far cheaper.
    Typical of the small incremental forwards of one step of many instances.
    """
    key = sigs * (int(depths.max()) + 1) + depths
    return len(np.unique(key)) == len(np.unique(sigs))


def csr_rows(ptr: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Indices of the entries of `rows` in a CSR layout (`ptr`), concatenated in order."""
    begin = ptr[rows]
    counts = ptr[rows + 1] - begin
    return np.repeat(begin - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))


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
    """DyNet's agenda, completed by per-signature ranks so it reaches the lower bound.

    rank(v) = the most nodes of v's signature on any path ending at v. Nodes of equal signature
    and rank never depend on each other, and a signature needs at least max-rank launches, so
    the ideal schedule runs each (signature, rank) group as ONE batch. The agenda therefore runs
    a group as soon as ALL its nodes are ready; among complete groups, DyNet's priority decides
    (lowest average depth of the signature, cheap ops first). Only when no group is complete
    (groups that wait on each other) does it fall back to DyNet's rule: run the ready nodes of
    the best-priority group now. Losses after sequences of different lengths, for instance,
    are all rank 1 of their signature, so they wait until the longest sequence is done.
    """
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

    uniq, sig_of = np.unique(sigs, return_inverse=True)
    first_of = np.zeros(len(uniq), np.int64)
    first_of[sig_of[::-1]] = np.arange(n)[::-1]
    first_ops = [graph.ops[start + f] for f in first_of.tolist()]
    leaf_sig = np.array([op.leaf for op in first_ops])
    from_compute = ~leaf_sig[sig_of[src]]  # a leaf adds nothing to another signature's count
    rank = _signature_ranks(sig_of, len(uniq), depths, src[from_compute], dst[from_compute])

    # DyNet's priority of a signature: lowest average depth first, cheap ops first on ties.
    avg_depth = np.bincount(sig_of, weights=depths) / np.bincount(sig_of)
    costly = np.array([not op.cheap for op in first_ops])
    sig_priority = np.empty(len(uniq), np.int64)
    sig_priority[np.lexsort((uniq, costly, avg_depth))] = np.arange(len(uniq))

    # One group per (signature, rank); a group's priority: its signature's, then its rank.
    group_key = sig_priority[sig_of] * (int(rank.max()) + 1) + rank
    group_priority, group_of, remaining = np.unique(group_key, return_inverse=True,
                                                     return_counts=True)
    ready_count = np.zeros(len(group_priority), np.int64)
    ready: dict[int, list[np.ndarray]] = {}
    complete: list[int] = []  # heap of complete group ids (ids are in priority order)

    def make_ready(nodes: np.ndarray) -> None:
        groups = group_of[nodes]
        if groups.min() == groups.max():  # the common case: one group
            g = int(groups[0])
            ready.setdefault(g, []).append(nodes)
            ready_count[g] += len(nodes)
            if ready_count[g] == remaining[g]:
                heapq.heappush(complete, g)
            return
        order = np.argsort(groups, kind="stable")
        nodes, groups = nodes[order], groups[order]
        cuts = np.flatnonzero(groups[1:] != groups[:-1]) + 1
        for part, g in zip(np.split(nodes, cuts), groups[np.r_[0, cuts]].tolist()):
            ready.setdefault(g, []).append(part)
            ready_count[g] += len(part)
            if ready_count[g] == remaining[g]:
                heapq.heappush(complete, g)

    make_ready(np.flatnonzero(waiting == 0))
    while ready:
        # Complete groups first; otherwise (groups waiting on each other) the best ready one.
        g = heapq.heappop(complete) if complete else min(ready)
        parts = ready.pop(g)
        batch = parts[0] if len(parts) == 1 else np.sort(np.concatenate(parts))
        remaining[g] -= len(batch)
        ready_count[g] = 0
        placer.place(batch)
        released = consumers[csr_rows(cons_ptr, batch)]
        if len(released) == 0:
            continue
        np.subtract.at(waiting, released, 1)
        now_ready = released[waiting[released] == 0]
        if len(now_ready):
            make_ready(np.unique(now_ready))


def _signature_ranks(sig_of: np.ndarray, n_sigs: int, depths: np.ndarray, src: np.ndarray,
                     dst: np.ndarray) -> np.ndarray:
    """For each node, the most nodes of its own signature on any path ending at it.

    Dynamic programming over depth levels (edges always go to a deeper node), vectorised over
    nodes and signatures: count[v, s] = [sig(v) = s] + max over inputs u of count[u, s].
    `dst` must be ascending (it is: edges are listed per consuming node, in node order).
    """
    n = len(sig_of)
    count = np.zeros((n, n_sigs), np.int32)
    by_level = np.argsort(depths[dst], kind="stable")  # keeps dst ascending within a level
    src, dst = src[by_level], dst[by_level]
    heads = np.flatnonzero(np.r_[True, dst[1:] != dst[:-1]]) if len(dst) else dst
    head_dst = dst[heads]
    node_order = np.argsort(depths, kind="stable")
    node_level = depths[node_order]
    level_starts = np.flatnonzero(np.r_[True, node_level[1:] != node_level[:-1]])
    levels = node_level[level_starts]
    node_ends = np.r_[level_starts[1:], n].tolist()
    head_cuts = np.searchsorted(depths[head_dst], np.r_[levels, levels[-1] + 1]).tolist()
    edge_cuts = np.r_[heads, len(dst)][head_cuts].tolist()
    for i, (n0, n1) in enumerate(zip(level_starts.tolist(), node_ends)):
        h0, h1 = head_cuts[i], head_cuts[i + 1]
        if h1 > h0:
            e0, e1 = edge_cuts[i], edge_cuts[i + 1]
            count[head_dst[h0:h1]] = np.maximum.reduceat(count[src[e0:e1]], heads[h0:h1] - e0,
                                                         axis=0)
        at = node_order[n0:n1]
        count[at, sig_of[at]] += 1
    return count[np.arange(n), sig_of]
