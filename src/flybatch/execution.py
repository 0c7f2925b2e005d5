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
else one `_FanOut` whose backward fills a single zero tensor and adds every piece's gradient in.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import numpy as np
import torch

from . import signatures
from .errors import ExecutionError
from .scheduling import Schedule, csr_rows

if TYPE_CHECKING:
    from .graph import Graph

# A read: ("view", source, start, length) | ("rows", source, rows) | ("multi", part_reads, order)
Read = tuple


def run(graph: "Graph", plan: Schedule) -> None:
    _refresh_parameters(graph)
    reads, batch_reads = _plan_with_fixed(graph, plan)
    fanned = _plan_fan_outs(graph, plan, reads)
    pieces: dict[int, torch.Tensor] = {}
    for source in [s for s in fanned if s < plan.first_batch]:
        _fan_out(graph, source, fanned[source], reads, pieces)
    values, shape_of, attr_of = graph.values, graph.shape_of, graph.attr_of
    for nodes, (arg_reads, stacked) in zip(plan.batches, batch_reads):
        first = int(nodes[0])
        op = graph.op_of(first)
        if op.leaf:
            values.append(_guarded(graph, nodes, op.kernel, graph, nodes))
        else:
            size = len(nodes)
            xs = [_resolve(graph, r, reads, pieces) for r in arg_reads]
            if op.ragged:
                attr = stacked  # each node's number of list items
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
        if source in fanned:
            _fan_out(graph, source, fanned[source], reads, pieces)


def _refresh_parameters(graph: "Graph") -> None:
    """Parameters are read when the forward runs, like embedding tables: a parameter computed
    by an earlier forward of this graph is read anew if its tensor was rebound (`W.data = ...`)
    since; in-place updates are seen anyway (the value is a view of the parameter)."""
    for node in graph.parameter_nodes:
        if node >= graph.n_done:
            break  # computed by this forward's own parameter kernel
        tensor = graph.attr_of(node)
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


# ---- planning ----------------------------------------------------------------------------------
def _plan_with_fixed(graph: "Graph", plan: Schedule
                     ) -> tuple[list[Read], list[tuple[list[int], int | np.ndarray]]]:
    """`_plan_reads`, and the reads of ragged ops whose first `fixed` arguments are not part of
    the list (`ops.RaggedOp`: a child-sum cell's input and parameters): those are read one
    column each, as a plain op's, then the lists of all nodes as one flat argument (none when
    every list of the batch is empty); the arities are the lists' lengths."""
    fixed = [getattr(graph.op_of(nodes[0]), "fixed", 0) for nodes in plan.batches]
    if not any(fixed):
        return _plan_reads(graph, plan)
    others = [nodes for nodes, k in zip(plan.batches, fixed) if not k]
    reads, planned = _plan_reads(graph, Schedule(plan.start, plan.first_batch, others,
                                                 plan.arg_ptr, plan.arg_flat))
    planned = iter(planned)
    batch_reads = []
    for nodes, k in zip(plan.batches, fixed):
        if not k:
            batch_reads.append(next(planned))
            continue
        local = nodes - plan.start
        begin = plan.arg_ptr[local]
        lengths = plan.arg_ptr[local + 1] - begin - k
        columns = list(plan.arg_flat[begin[:, None] + np.arange(k)].T)
        if lengths.any():  # item j of node i's list is argument k + j
            starts = np.repeat(begin + k - np.cumsum(lengths) + lengths, lengths)
            columns.append(plan.arg_flat[starts + np.arange(int(lengths.sum()))])
        batch_reads.append((_classify(graph, columns, reads), lengths))
    return reads, batch_reads


def _plan_reads(graph: "Graph", plan: Schedule
                ) -> tuple[list[Read], list[tuple[list[int], int | np.ndarray]]]:
    """Every read of every batch, as data: `reads[k]`, and per batch the read ids of its
    arguments with, for a variadic op read as one stacked tensor, its arity (else 0; for a
    ragged op, the array of each node's arity).

    The columns (one per argument position of each batch) are classified together, with one
    numpy pass over all of them, because a forward may hold thousands of small batches.
    """
    columns: list[np.ndarray] = []
    shape_of_batch: list[tuple[int, int | np.ndarray]] = []  # (columns, stacked arity or arities)
    for nodes in plan.batches:
        op = graph.op_of(nodes[0])
        local = nodes - plan.start
        arity = int(plan.arg_ptr[local[0] + 1] - plan.arg_ptr[local[0]])
        if op.leaf or arity == 0:
            shape_of_batch.append((0, 0))
            continue
        if op.ragged:  # every argument of every node, flat, and each node's arity
            columns.append(plan.arg_flat[csr_rows(plan.arg_ptr, local)])
            shape_of_batch.append((1, plan.arg_ptr[local + 1] - plan.arg_ptr[local]))
            continue
        cols = plan.arg_flat[plan.arg_ptr[local][:, None] + np.arange(arity)]
        if op.stack_from is not None and arity >= op.stack_from:
            columns.append(cols.reshape(-1))
            shape_of_batch.append((1, arity))
        else:
            columns.extend(cols.T)
            shape_of_batch.append((arity, 0))
    reads: list[Read] = []
    planned = iter(_classify(graph, columns, reads))
    batch_reads = [([next(planned) for _ in range(k)], stacked) for k, stacked in shape_of_batch]
    return reads, batch_reads


def _classify(graph: "Graph", columns: list[np.ndarray], reads: list[Read]) -> list[int]:
    """Plan every column's read; the common kinds are decided for all columns at once."""
    if not columns:
        return []
    lengths = np.fromiter(map(len, columns), np.int64, len(columns))
    starts = np.zeros(len(columns), np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    ids = np.concatenate(columns)
    src, rows = graph.node_batch[ids], graph.node_row[ids]
    same_id = np.minimum.reduceat(ids, starts) == np.maximum.reduceat(ids, starts)
    same_src = np.minimum.reduceat(src, starts) == np.maximum.reduceat(src, starts)
    step_ok = np.empty(len(rows), bool)  # not np.r_, which costs ~30 us per forward
    np.equal(np.diff(rows), 1, out=step_ok[:-1])
    step_ok[-1] = True
    step_ok[starts[1:] - 1] = True  # a column's last row has no successor inside the column
    in_run = np.logical_and.reduceat(step_ok, starts)
    out = []
    for k, (n, start, one, single, run) in enumerate(zip(
            lengths.tolist(), starts.tolist(), same_id.tolist(), same_src.tolist(),
            in_run.tolist())):
        if n == 1 or one:
            reads.append(("view", int(src[start]), int(rows[start]), 1))
        elif single and run:
            reads.append(("view", int(src[start]), int(rows[start]), n))
        elif single:
            reads.append(("rows", int(src[start]), rows[start:start + n]))
        else:  # several sources: planned part by part
            out.append(_plan_read(graph, columns[k], reads))
            continue
        out.append(len(reads) - 1)
    return out


def _plan_read(graph: "Graph", ids: np.ndarray, reads: list[Read], broadcast: bool = True) -> int:
    """Plan the read of `ids`; with `broadcast`, one row may stand for a batch of one node."""
    src = graph.node_batch[ids]
    rows = graph.node_row[ids]
    first_src, first_row = int(src[0]), int(rows[0])
    size = len(ids)
    if size == 1 or broadcast and (ids == ids[0]).all():
        reads.append(("view", first_src, first_row, 1))
    elif (src == first_src).all():
        if rows[-1] - first_row == size - 1 and (np.diff(rows) == 1).all():
            reads.append(("view", first_src, first_row, size))
        else:
            reads.append(("rows", first_src, rows))
    else:
        order = np.argsort(src, kind="stable")
        sorted_src = src[order]
        cuts = np.flatnonzero(sorted_src[1:] != sorted_src[:-1]) + 1
        parts = [_plan_read(graph, ids[part], reads, broadcast=False)
                 for part in np.split(order, cuts)]
        in_order = bool((order == np.arange(size)).all())
        inverse = None
        if not in_order:
            inverse = np.empty(size, np.int64)
            inverse[order] = np.arange(size)
        reads.append(("multi", parts, inverse))
    return len(reads) - 1


def _plan_fan_outs(graph: "Graph", plan: Schedule, reads: list[Read]) -> dict[int, list[int]]:
    """Sources read in pieces (not whole) by two or more reads -> the ids of those reads."""
    def rows_of(source: int) -> int:
        if source >= plan.first_batch:  # computed by this forward: not a tensor yet
            return len(plan.batches[source - plan.first_batch])
        return graph.values[source].shape[0]

    by_source: dict[int, list[int]] = defaultdict(list)
    for k, read in enumerate(reads):
        kind, source = read[0], read[1]
        if kind == "rows" or kind == "view" and not (read[2] == 0 and read[3] == rows_of(source)):
            by_source[source].append(k)
    return {s: ks for s, ks in by_source.items() if len(ks) >= 2}


# ---- running reads -----------------------------------------------------------------------------
class _FanOut(torch.autograd.Function):
    """Several `index_select`s of one tensor whose backward fills ONE zero tensor."""

    @staticmethod
    def forward(ctx, source, *indices):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*indices)
        ctx.source_shape = source.shape
        return tuple(source.index_select(0, index) for index in indices)

    @staticmethod
    def backward(ctx, *grads):
        present = [g for g in grads if g is not None]
        if not present:
            return (None,) * (1 + len(grads))
        grad = present[0].new_zeros(ctx.source_shape)
        for index, g in zip(ctx.saved_tensors, grads):
            if g is not None:
                grad.index_add_(0, index, g)
        return (grad,) + (None,) * len(grads)


def _fan_out(graph: "Graph", source: int, read_ids: list[int], reads: list[Read],
             pieces: dict[int, torch.Tensor]) -> None:
    tensor = graph.values[source]
    if not tensor.requires_grad:
        return  # no backward to protect: the reads run as plain views and selects
    spans = [reads[k][2:4] if reads[k][0] == "view" else None for k in read_ids]
    if None not in spans:
        # Disjoint runs: split into views; backward concatenates (one allocation).
        ordered = sorted(set(spans))
        ends = [a + n for a, n in ordered]
        if all(end <= nxt for end, (nxt, _) in zip(ends, ordered[1:])):
            sizes, at, span_piece = [], 0, {}
            for start, n in ordered:
                if start > at:
                    sizes.append(start - at)
                span_piece[(start, n)] = len(sizes)
                sizes.append(n)
                at = start + n
            if at < tensor.shape[0]:
                sizes.append(tensor.shape[0] - at)
            split = torch.split(tensor, sizes)
            for k, span in zip(read_ids, spans):
                pieces[k] = split[span_piece[span]]
            graph.gathers_avoided += len(read_ids)
            return
    indices = []
    for k in read_ids:
        read = reads[k]
        rows = (np.arange(read[2], read[2] + read[3]) if read[0] == "view" else read[2])
        indices.append(_index(rows, tensor))
    for k, piece in zip(read_ids, _FanOut.apply(tensor, *indices)):
        pieces[k] = piece
    graph.gathers += len(read_ids)


def _resolve(graph: "Graph", k: int, reads: list[Read], pieces: dict[int, torch.Tensor]
             ) -> torch.Tensor:
    piece = pieces.pop(k, None)
    if piece is not None:
        return piece
    read = reads[k]
    kind = read[0]
    if kind == "view":
        graph.gathers_avoided += 1
        return _rows(graph.values[read[1]], read[2], read[3])
    if kind == "rows":
        graph.gathers += 1
        source = graph.values[read[1]]
        return source.index_select(0, _index(read[2], source))
    graph.gathers += 1
    stacked = torch.cat([_resolve(graph, p, reads, pieces) for p in read[1]])
    inverse = read[2]
    return stacked if inverse is None else stacked.index_select(0, _index(inverse, stacked))


def _rows(source: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Rows start..start+length of a batch result, as a view (the tensor itself if all)."""
    if start == 0 and length == source.shape[0]:
        return source
    return source.narrow(0, start, length)


def _index(rows: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(rows)).to(like.device)
