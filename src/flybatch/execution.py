"""Execution: run a schedule, one kernel per batch, results kept as batch tensors.

A node's value is row `graph.node_row[v]` of tensor `graph.values[graph.node_batch[v]]`.
To feed a batch, each argument position is gathered into ONE tensor with the batch in dim 0:
- every node of the batch reads the same node (a parameter, an interned constant): a `[1, ...]`
  view that the kernel broadcasts;
- the inputs are a contiguous, in-order run of one earlier result: a zero-copy `narrow`;
- otherwise one `index_select` per source tensor (and one `cat` when there are several).
Backward needs nothing here: the batched forward is recorded by PyTorch autograd, so the
backward pass runs over the same batches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from .scheduling import Schedule

if TYPE_CHECKING:
    from .graph import Graph


def run(graph: "Graph", plan: Schedule) -> None:
    values, shapes, ops, attrs = graph.values, graph.shapes, graph.ops, graph.attrs
    gather = _Gatherer(graph)
    for nodes in plan.batches:
        first = int(nodes[0])
        op = ops[first]
        if op.leaf:
            values.append(op.kernel(graph, nodes))
            continue
        size = len(nodes)
        local = nodes - plan.start
        arity = int(plan.arg_ptr[local[0] + 1] - plan.arg_ptr[local[0]])
        cols = plan.arg_flat[plan.arg_ptr[local][:, None] + np.arange(arity)]
        if op.stack_from is not None and arity >= op.stack_from:
            arg_shape = shapes[int(cols[0, 0])]
            flat = gather(cols.reshape(-1))  # [1, ...] when every id is the same node
            xs = [flat.expand(size * arity, *arg_shape).reshape(size, arity, *arg_shape)]
        else:
            xs = [gather(cols[:, j]) for j in range(arity)]
        attr = [attrs[int(v)] for v in nodes] if op.per_node_attrs else attrs[first]
        out = op.kernel(xs, attr, shapes[first])
        if out.shape[0] != size:
            out = out.expand(size, *out.shape[1:])
        values.append(out)
        graph.launches.append((graph.sigs[first], size))


def _rows(source: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Rows start..start+length of a batch result, as a view.

    The whole tensor is returned as it is: a `narrow` would add a backward step that fills a
    zero tensor the size of the source, the largest cost of a batched backward.
    """
    if start == 0 and length == source.shape[0]:
        return source
    return source.narrow(0, start, length)


class _Gatherer:
    """Builds the `[B, ...]` input tensor of one argument position, copying as little as it can."""

    def __init__(self, graph: "Graph"):
        self.graph = graph

    def __call__(self, ids: np.ndarray) -> torch.Tensor:
        graph = self.graph
        values = graph.values
        src = graph.node_batch[ids]
        rows = graph.node_row[ids]
        first_src, first_row = int(src[0]), int(rows[0])
        size = len(ids)
        if size == 1 or (ids == ids[0]).all():
            graph.gathers_avoided += 1
            return _rows(values[first_src], first_row, 1)
        if (src == first_src).all():
            source = values[first_src]
            if rows[-1] - first_row == size - 1 and (np.diff(rows) == 1).all():
                graph.gathers_avoided += 1
                return _rows(source, first_row, size)
            graph.gathers += 1
            return source.index_select(0, self._index(rows, source))
        # Several source batches: one index_select each, one cat, then restore the row order.
        graph.gathers += 1
        order = np.argsort(src, kind="stable")
        sorted_src = src[order]
        cuts = np.flatnonzero(sorted_src[1:] != sorted_src[:-1]) + 1
        pieces = []
        for part in np.split(order, cuts):
            source = values[int(src[part[0]])]
            pieces.append(source.index_select(0, self._index(rows[part], source)))
        stacked = torch.cat(pieces)
        if (order == np.arange(size)).all():
            return stacked
        inverse = np.empty(size, np.int64)
        inverse[order] = np.arange(size)
        return stacked.index_select(0, self._index(inverse, stacked))

    @staticmethod
    def _index(rows: np.ndarray, like: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(rows)).to(like.device)
