"""Execution: run a schedule, one kernel per batch, results kept as batch tensors.

A node's value is row `graph.node_row[v]` of tensor `graph.values[graph.node_batch[v]]`.
Before anything runs, every argument position of every batch is planned as a *read* of earlier
results, gathered into ONE tensor with the batch in dim 0:
- a contiguous, in-order run of one result (or every node reading the same node, a `[1, ...]`
  view the kernel broadcasts): a zero-copy view, the whole tensor itself when it covers it;
- arbitrary rows of one result: one `index_select`; rows of several results: one per result
  and one `cat` (and one more `index_select` to restore the order when needed).
Backward is PyTorch autograd over the batched forward, so it runs over the same batches. Its
cost trap: every partial read of a result makes autograd build a zero tensor the size of the
whole result in backward. So a result read in pieces by several later batches is *fanned out*
once, right after it is computed: `torch.split` into its runs when the reads are disjoint runs,
else one `index_select` of every piece's rows, split: its backward fills a single zero tensor
and adds every piece's gradient in.

The plan (the reads, each batch's reads and the fan-outs) is made by the compiled core
(csrc/execute.cpp, `_core.plan_reads`) from the schedule and the store's columns, as data; this
module runs it with torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from . import _core, signatures
from .errors import ExecutionError
from .scheduling import Schedule

if TYPE_CHECKING:
    from .graph import Graph

# A read, as `_core.plan_reads` plans it (csrc/execute.h says more):
#   ("view", source, start, length): rows start..start+length-1 of values[source], no copy;
#   ("rows", source, at, length): the rows numbered indices[at:at+length] of values[source];
#   ("multi", part read ids, inverse at or None, rows): the parts concatenated, then put in
#   the nodes' order by the permutation indices[inverse:inverse+rows] when one is needed.
Read = tuple


def run(graph: "Graph", plan: Schedule) -> None:
    _refresh_parameters(graph)
    reads, batch_reads, fan_outs, index_bytes = _core.plan_reads(
        graph=graph, first_batch=plan.first_batch, order=plan.order, ends=plan.ends)
    indices = _Indices(index_bytes)
    pieces: dict[int, torch.Tensor] = {}
    for source in [s for s in fan_outs if s < plan.first_batch]:
        _fan_out(graph, source, fan_outs[source], indices, pieces)
    values, shape_of, attr_of = graph.values, graph.shape_of, graph.attr_of
    for nodes, (arg_reads, stacked, arities) in zip(plan.batches, batch_reads):
        first = int(nodes[0])
        op = graph.op_of(first)
        if op.leaf:
            values.append(_guarded(graph, nodes, op.kernel, graph, nodes))
        else:
            size = len(nodes)
            xs = [_resolve(graph, r, reads, indices, pieces) for r in arg_reads]
            if op.ragged:  # each node's number of list items
                attr = indices.numpy[arities:arities + size]
            else:
                if stacked:  # one read of all arguments: [B * k, ...] -> [B, k, ...]
                    arg_shape = shape_of(graph.args_of(first)[0])
                    xs[0] = xs[0].expand(size * stacked, *arg_shape).reshape(size, stacked,
                                                                             *arg_shape)
                attr = attr_of(first)
                if op.per_node_attrs:  # and each node's int (index, row), read in one call
                    attr = (attr, np.frombuffer(graph.indices(nodes), np.int64))
            if op.random:  # one sample per node, never one broadcast row for all
                xs = [x.expand(size, *x.shape[1:]) for x in xs]
            if graph.is_no_grad(first):  # written under torch.no_grad() (the whole batch was)
                with torch.no_grad():
                    out = _guarded(graph, nodes, op.kernel, xs, attr, shape_of(first))
            else:
                out = _guarded(graph, nodes, op.kernel, xs, attr, shape_of(first))
            if out.shape[0] != size:
                out = out.expand(size, *out.shape[1:])
            values.append(out)
            graph.launches.append((graph.sig_of(first), size))
        source = len(values) - 1
        if source in fan_outs:
            _fan_out(graph, source, fan_outs[source], indices, pieces)


def _refresh_parameters(graph: "Graph") -> None:
    """Parameters are read when the forward runs, like embedding tables: a parameter computed
    by an earlier forward of this graph is read anew if its tensor was rebound (`W.data = ...`)
    since; in-place updates are seen anyway (the value is a view of the parameter)."""
    for node in graph.parameter_nodes:
        if node >= graph.n_done:
            break  # computed by this forward's own parameter kernel
        tensor = graph.parameter_value(node)  # a view (`U_f[0]`) is taken anew
        batch, _ = graph.position(node)
        cached = graph.values[batch]
        if cached.data_ptr() == tensor.data_ptr() and cached.shape[1:] == tensor.shape:
            continue
        if tuple(tensor.shape) != graph.shape_of(node):
            raise ExecutionError(f"parameter #{node}: its tensor was rebound to shape "
                                 f"{tuple(tensor.shape)} after nodes of shape "
                                 f"{graph.shape_of(node)} were written with it")
        graph.values[batch] = tensor.unsqueeze(0)


def _guarded(graph: "Graph", nodes: np.ndarray, kernel, *args) -> torch.Tensor:
    """Run a batch's kernel; a failure names the op, its signature and nodes (and, in debug
    mode, the lines that wrote them) instead of surfacing as a bare torch error."""
    try:
        return kernel(*args)
    except Exception as error:
        first = int(nodes[0])
        shown = ", ".join(f"#{int(v)}" for v in nodes[:5]) + (", ..." if len(nodes) > 5 else "")
        message = (f"{graph.op_of(first).name} kernel failed on a batch of {len(nodes)} node(s) "
                   f"({shown}; signature {signatures.describe(graph.sig_of(first), graph)}): "
                   f"{type(error).__name__}: {error}")
        if graph.origins is not None:
            lines = [graph.origins[int(v)] for v in nodes[:5] if int(v) in graph.origins]
            message += "".join(f"\n  node written at {line}" for line in lines)
        else:
            message += "\n  (create the graph with fb.Graph(debug=True) to see where it was written)"
        raise ExecutionError(message) from error


# ---- running reads ----------------------------------------------------------------------------
class _Indices:
    """The row numbers, permutations and arities of a plan: one int64 buffer, as numpy and as
    one torch tensor per device that reads it, sliced (no copy) per read."""

    def __init__(self, buffer: bytearray):
        self.numpy = np.frombuffer(buffer, np.int64)
        self._tensors: dict[torch.device, torch.Tensor] = {}

    def rows(self, at: int, length: int, like: torch.Tensor) -> torch.Tensor:
        tensor = self._tensors.get(like.device)
        if tensor is None:
            tensor = self._tensors[like.device] = torch.from_numpy(self.numpy).to(like.device)
        return tensor[at:at + length]


def _fan_out(graph: "Graph", source: int, fan_out: tuple, indices: _Indices,
             pieces: dict[int, torch.Tensor]) -> None:
    """Cut a result read in pieces into those pieces at once, so that backward builds one
    gradient tensor for it instead of one zero-filled copy per piece."""
    tensor = graph.values[source]
    if not tensor.requires_grad:
        return  # no backward to protect: the reads run as plain views and selects
    read_ids, gather, sizes, piece_of = fan_out
    if gather is None:  # disjoint runs: views of the result; backward concatenates
        whole = tensor
        graph.gathers_avoided += len(read_ids)
    else:  # one gather of every read's rows; backward adds them into one zero tensor
        whole = tensor.index_select(0, indices.rows(gather, sum(sizes), tensor))
        graph.gathers += len(read_ids)
    parts = torch.split(whole, sizes)
    for k, piece in zip(read_ids, piece_of):
        pieces[k] = parts[piece]


def _resolve(graph: "Graph", k: int, reads: list[Read], indices: _Indices,
             pieces: dict[int, torch.Tensor]) -> torch.Tensor:
    piece = pieces.pop(k, None)
    if piece is not None:
        return piece
    read = reads[k]
    kind = read[0]
    if kind == "view":
        _, source, start, length = read
        graph.gathers_avoided += 1
        return _rows(graph.values[source], start, length)
    if kind == "rows":
        _, source, at, length = read
        graph.gathers += 1
        tensor = graph.values[source]
        return tensor.index_select(0, indices.rows(at, length, tensor))
    _, parts, inverse, rows = read
    graph.gathers += 1
    stacked = torch.cat([_resolve(graph, p, reads, indices, pieces) for p in parts])
    if inverse is None:
        return stacked
    return stacked.index_select(0, indices.rows(inverse, rows, stacked))


def _rows(source: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Rows start..start+length of a batch result, as a view (the tensor itself if all)."""
    if start == 0 and length == source.shape[0]:
        return source
    return source.narrow(0, start, length)
