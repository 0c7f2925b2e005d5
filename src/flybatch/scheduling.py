"""Scheduling: group the pending nodes of a graph into batches, each run as one kernel.

A `Schedule` is plain data (lists of node ids in row order), so it can be printed, counted and
tested without running anything. Four strategies:

- `none`: one batch per node, in creation order (the unbatched baseline).
- `depth` (TensorFlow Fold): nodes of equal signature at equal depth form one batch.
- `agenda` (DyNet's autobatcher): keep the ready nodes bucketed by signature; repeatedly run ALL
  ready nodes of the signature with the lowest average depth (cheap ops first on ties), which
  lets e.g. every loss wait until the longest sequence is done and then run as one batch.

The agenda is completed by per-signature ranks (the most nodes of a node's signature on any path
ending at it): each (signature, rank) group runs as one batch as soon as all of it is ready.

- `auto` (the default): the fewest launches among several schedules, stopping at the first that
  reaches the lower bound: the ranked agenda whose fallback, when no group is complete, runs the
  ready group with the longest path to the end of the forward (critical path); list schedules
  over signatures (a launch takes every ready node of its signature; a signature all of whose
  remaining nodes are ready runs first, which is exact; then signatures whose launch shortens
  the longest path of their nodes still to run, which keeps launches plus the launches still
  needed where they were; among each, the critical path, the squared heights of the ready nodes
  or the highest ready node plus their count picks), two of them also built backwards from the
  end of the forward; `depth`; the agenda above; and `depth`'s latest-possible twin; last, on
  small forwards, climbs from the winning list schedule and three others: re-runs with one more
  of their choices that split a group holding the signature back until a node of it becomes
  ready, kept when they launch less. The winner is then compacted: its launches' signatures
  kept in order, every node moved to the latest launch of its signature before its consumers,
  then to the earliest after its inputs, launches left empty dropped. Never worse than `depth`
  or `agenda`; a candidate whose launches and a lower bound on those it still needs reach the
  best so far stops early.

Scheduling also fixes where each node's value will live (the store's node_batch/node_row
columns) and orders the rows of each batch by where its most recent input lives, so that the
next batch usually finds its inputs as a contiguous, in-order run of an earlier result and reads
them without a copy.

The algorithms are the compiled core's (csrc/schedule.cpp), linear in nodes + edges; they read the
node store's columns in place; this module allocates the output arrays and turns its answer into
a `Schedule`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from . import _core, signatures

if TYPE_CHECKING:
    from .graph import Graph


@dataclass
class Schedule:
    """The batches of one forward: node ids in row order, as one array and a view per batch."""

    start: int                 # first pending node id
    first_batch: int           # global index of batches[0] in graph.values
    order: np.ndarray          # node ids of all batches, batch after batch
    ends: np.ndarray           # end of each batch in `order`
    batches: list[np.ndarray]  # node ids of each batch, in row order (views of `order`)

    def __len__(self) -> int:
        return len(self.batches)

    def describe(self, graph: "Graph") -> str:
        """One line per batch: global index, size and readable signature."""
        return "\n".join(
            f"{self.first_batch + i:5d}  x{len(b):<5d} "
            f"{signatures.describe(graph.sig_of(int(b[0])), graph)}"
            for i, b in enumerate(self.batches))

    def __repr__(self) -> str:
        nodes = sum(len(b) for b in self.batches)
        return f"Schedule({len(self.batches)} batches, {nodes} nodes)"


def schedule(graph: "Graph", start: int, end: int) -> Schedule:
    """Batch the nodes `start..end-1` of `graph` with the graph's strategy."""
    n = end - start
    first_batch = len(graph.values)
    order, ends = np.empty(n, np.int64), np.empty(n, np.int64)
    # (strategy, graph, start, end, first_batch, order_out, ends_out) by position: parsing seven
    # keywords costs the call about as much as scheduling a small forward's leaves.
    count = _core.schedule(graph.strategy, graph, start, end, first_batch, order, ends)
    ends = ends[:count]
    bounds = ends.tolist()
    return Schedule(start, first_batch, order, ends,
                    [order[a:b] for a, b in zip([0, *bounds], bounds)])
