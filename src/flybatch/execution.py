"""Execution: run a schedule, one kernel per batch, results kept as batch tensors.

A node's value is row `graph.node_row[v]` of tensor `graph.values[graph.node_batch[v]]`.
Before anything runs, every argument position of every batch is planned as a *read* of earlier
results, gathered into ONE tensor with the batch in dim 0:
- a contiguous, in-order run of one result (or every node reading the same node, a `[1, ...]`
  view the kernel broadcasts): a zero-copy view, the whole tensor itself when it covers it;
- arbitrary rows of one result: one `index_select`; rows of several results: one per result
  and one `cat` (and one more `index_select` to restore the order when needed); rows of many
  small results: one `cat` of the whole results and one `index_select`.
Backward is PyTorch autograd over the batched forward, so it runs over the same batches. Its
cost trap: every partial read of a result makes autograd build a zero tensor the size of the
whole result in backward. So a result read in pieces by several later batches is *fanned out*
once, right after it is computed: `torch.split` into its runs when the reads are disjoint runs,
else one `index_select` of every piece's rows, split: its backward fills a single zero tensor
and adds every piece's gradient in.
A result of an EARLIER forward (the parser's encoder states, read by each of ~100 later steps)
cannot be fanned out once, since its readers come one forward at a time: its partial reads go
through a `_GradientSink` instead, whose backward adds each read's gradient into one buffer
per result (one zero tensor per result, not one per read). A forward makes all its reads of
earlier results first, in ONE autograd function (`_SinkReads`), however many results they read.
A small result (under SINK_MIN_ELEMENTS) is read as a result of this forward is: a zero tensor
of its size per read costs less than a sink.
A shared-weight product of a concat of rows of earlier forwards' results (a parser's scores of
its encoder states) gathers projections of those results by the weight's blocks instead of
multiplying, once that pays (projection.py; `_plan_projections`); the concat batch, which
nothing in that forward reads any more, is deferred: run only if something reads it later.

The plan (the reads, each batch's reads and the fan-outs) is made by the compiled core
(csrc/execute.cpp, `_core.plan_reads`) from the schedule and the store's columns, as data; this
module runs it with torch.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from . import _core, kernels, projection, signatures
from .errors import ExecutionError
from .scheduling import Schedule

if TYPE_CHECKING:
    from .graph import Graph

# A read, as `_core.plan_reads` plans it (csrc/execute.h says more):
#   ("view", source, start, length): rows start..start+length-1 of values[source], no copy;
#   ("rows", source, at, length): the rows numbered indices[at:at+length] of values[source];
#   ("multi", part read ids, inverse at or None, rows, whole at or None): the parts
#   concatenated, then put in the nodes' order by the permutation indices[inverse:inverse+rows]
#   when one is needed; with many parts, also the nodes' rows in the concatenation of the
#   parts' whole results, indices[whole:whole+rows].
Read = tuple


def run(graph: "Graph", plan: Schedule) -> None:
    _refresh_parameters(graph)
    # (graph, first_batch, order, ends) by position: keywords cost the call ~1 us to parse
    reads, batch_reads, fan_outs, index_bytes, heads, readers, earlier = _core.plan_reads(
        graph, plan.first_batch, plan.order, plan.ends)
    if graph.deferred:  # results this forward reads that an earlier one left uncomputed
        _compute_deferred(graph, reads)
    indices = _Indices(index_bytes)
    pieces: dict[int, torch.Tensor] = {}
    projected: dict[int, tuple] = {}
    deferred: set[int] = set()
    if plan.first_batch:
        projected, deferred, plain = _plan_projections(graph, plan, heads, batch_reads, reads,
                                                       readers)
        _read_earlier_results(graph, reads, earlier, fan_outs, indices, pieces, plan.first_batch,
                              plain)
    values, launches = graph.values, graph.launches
    for batch, (nodes, head, batch_read) in enumerate(zip(plan.batches, heads, batch_reads),
                                                      plan.first_batch):
        op = head[1]
        if op.leaf:
            values.append(_guarded(graph, nodes, False, op.kernel, graph, nodes))
        elif op.picks_from_input and _run_picked(graph, nodes, head, batch_read[0][0], reads,
                                                  indices, pieces, plan.first_batch):
            launches.append((head[2], len(nodes)))
        elif batch in projected:
            values.append(_guarded(graph, nodes, head[5], _gather_projections, graph, nodes,
                                   *projected[batch]))
            launches.append((head[2], len(nodes)))
        elif batch in deferred:  # computed only if a later forward or value request reads it
            values.append(None)
            graph.deferred[batch] = _Deferred(nodes, head, batch_read, reads, indices,
                                              _sources(graph, batch_read[0], reads))
        else:
            values.append(_run_batch(graph, nodes, head, batch_read, reads, indices, pieces))
            launches.append((head[2], len(nodes)))
        source = len(values) - 1
        if batch_read[5]:  # uneven: its nodes' shapes differ
            graph.padded.add(source)
        if source in fan_outs:
            _fan_out(graph, source, fan_outs[source], indices, pieces)


def _run_batch(graph: "Graph", nodes: np.ndarray, head: tuple, batch_read: tuple,
               reads: list[Read], indices: "_Indices",
               pieces: dict[int, torch.Tensor]) -> torch.Tensor:
    """The result of a batch run by its op's kernel on its arguments, read as planned."""
    _, op, _, attr, shape, no_grad = head
    arg_reads, stacked, arities, widths, lengths, _ = batch_read
    size = len(nodes)
    # Rows to narrow or pad to the width read: from a result stored padded, or for a padded
    # op's nodes of different lengths.
    if graph.padded or lengths is not None:
        widths = indices.numpy[widths:widths + len(arg_reads)].tolist()
        xs = [_resolve(graph, r, reads, indices, pieces, width)
              for r, width in zip(arg_reads, widths)]
    else:
        xs = [_resolve(graph, r, reads, indices, pieces) for r in arg_reads]
    if op.ragged:  # each node's number of list items
        attr = indices.numpy[arities:arities + size]
    else:
        if stacked:  # one read of all arguments: [B * k, ...] -> [B, k, ...]
            x, arg_shape = xs[0], xs[0].shape[1:]
            if x.shape[0] != size * stacked:  # one node read by all, broadcast
                x = x.expand(size * stacked, *arg_shape)
            xs[0] = x.reshape(size, stacked, *arg_shape)
        if op.per_node_attrs:  # and each node's int (index, row), read in one call
            attr = (attr, np.frombuffer(graph.indices(nodes), np.int64))
    if op.padded:  # and each node's length, when they differ
        out = _guarded(graph, nodes, no_grad, op.kernel, xs, attr, shape,
                       None if lengths is None else indices.numpy[lengths:lengths + size])
    else:
        out = _guarded(graph, nodes, no_grad, op.kernel, xs, attr, shape)
    if out.shape[0] != size:
        out = out.expand(size, *out.shape[1:])
    return out


def _run_picked(graph: "Graph", nodes: np.ndarray, head: tuple, k: int, reads: list[Read],
                indices: "_Indices", pieces: dict[int, torch.Tensor], first_batch: int) -> bool:
    """A pick batch whose input is rows of results (of this forward or an earlier one), run as
    one index of each result (appended to graph.values): the element picked, not each node's
    whole input, is copied. False when its read needs the general path (a piece of a fan-out,
    an earlier forward's result behind a gradient sink)."""
    read = reads[k]
    parts, inverse = (read[1], read[2]) if read[0] == "multi" else ((k,), None)
    if any(p in pieces or reads[p][0] == "multi" or
           (reads[p][1] < first_batch and _behind_sink(graph.values[reads[p][1]])) for p in parts):
        return False
    picked = np.frombuffer(graph.indices(nodes), np.int64)
    if inverse is not None:  # the parts' rows in their concatenated order
        order = indices.numpy[inverse:inverse + len(nodes)]
        picked = np.empty_like(picked)
        picked[order] = np.frombuffer(graph.indices(nodes), np.int64)
    out, done = [], 0
    for p in parts:
        kind, source, at, length = reads[p]
        tensor = graph.values[source]
        size = len(nodes) if len(parts) == 1 else length
        if kind == "view":  # a run of rows, or one row every node reads
            rows = torch.arange(at, at + length, device=tensor.device).expand(size)
            graph.gathers_avoided += 1
        else:
            rows = indices.rows(at, length, tensor)
            graph.gathers += 1
        index = torch.from_numpy(picked[done:done + size]).to(tensor.device)
        out.append(_guarded(graph, nodes, False, tensor.__getitem__, (rows, index)))
        done += size
    value = out[0] if len(out) == 1 else torch.cat(out)
    if inverse is not None:
        value = value.index_select(0, indices.rows(inverse, len(nodes), value))
    if head[5]:
        value = value.detach()  # written under torch.no_grad(): no gradient, as eagerly
    graph.values.append(value)
    return True


def _plan_projections(graph: "Graph", plan: Schedule, heads: list, batch_reads: list,
                      reads: list[Read],
                      readers: tuple[int, ...]) -> tuple[dict[int, tuple], set[int], set[int]]:
    """The affine batches of this forward, of a shared weight and bias over a concat batch of
    rows of earlier forwards' results, that gather projections of those results instead of
    multiplying (projection.py): batch -> (the joined tables, the rows to gather, the sources,
    the weight, the bias); their concat batches; and the reads of those. A concat's only reader
    here no longer reads it, so it is not run: it is *deferred* (`_Deferred`), computed only
    if a later forward or a value request reads its nodes (a parser never does: ~1 launch and
    ~5 reads per step, 2-4 ms of its ~40 ms evaluation minibatch, 2026-11-24), and its reads
    are not made (`plain`: nor through gradient sinks, nor fanned out). `readers`: how many
    reads read each batch's result (the planner counts them: a Counter over the reads here cost
    ~3.5 us a forward)."""
    first_batch, values = plan.first_batch, graph.values
    projected, deferred, plain = {}, set(), set()
    for batch, (nodes, head, (arg_reads, *_)) in enumerate(
            zip(plan.batches, heads, batch_reads), first_batch):
        if head[1].name != "affine":
            continue
        w_read, x_read, b_read = (reads[k] for k in arg_reads)
        if x_read[0] != "view" or x_read[1] < first_batch or w_read[0] != "view" \
                or b_read[0] != "view" or max(w_read[1], b_read[1]) >= first_batch:
            continue
        concat = x_read[1] - first_batch
        concat_reads, _, _, _, lengths, _ = batch_reads[concat]
        concat_nodes = plan.batches[concat]
        weight, bias = values[w_read[1]], values[b_read[1]]
        if heads[concat][1].name != "concat" or lengths is not None \
                or heads[concat][3] != 0 or weight.dim() != 3 \
                or weight.shape[0] != 1 or bias.shape[0] != 1:
            continue
        if readers[concat] != 1:  # the concat's nodes are read by another batch too
            continue
        # (guarded: a projection is this batch's kernel, its time kernel time)
        gather = _guarded(graph, nodes, head[5], projection.plan, graph, concat_nodes,
                          slice(x_read[2], x_read[2] + x_read[3]), w_read[1], first_batch)
        if gather is not None:
            projected[batch] = (*gather, weight, bias)
            deferred.add(x_read[1])
            plain.update(k for read in concat_reads
                         for k in ((read,) + (reads[read][1] if reads[read][0] == "multi"
                                              else ())))
    return projected, deferred, plain


def _gather_projections(graph: "Graph", nodes: np.ndarray, joined, rows: np.ndarray,
                        sources: list[torch.Tensor], weight: torch.Tensor,
                        bias: torch.Tensor) -> torch.Tensor:
    """An affine batch planned by `_plan_projections`: the k projected rows of each node,
    gathered in one read (through the joined tables' gradient sink) and summed, plus the
    bias."""
    table = joined.table
    rows = torch.from_numpy(rows).to(table.device)
    n, out = len(nodes), table.shape[1]
    if table.requires_grad and table.numel() >= SINK_MIN_ELEMENTS:
        if joined.sink is None:
            joined.sink = _GradientSink(table)
        summed = kernels.apply_function(_SinkRowSums, joined.sink, rows, n, joined.sink.token)
    else:
        summed = table.index_select(0, rows).view(n, -1, out).sum(1)
    graph.gathers += 1
    # The model's FLOPs are the product it wrote, not the projections that replace it.
    for x in sources:
        if x.requires_grad:
            break
    else:
        x = sources[0]
    kernels.flops.add(n * out, weight.shape[2], x, weight)
    return summed + bias  # ([1, out] broadcast)


class _Deferred:
    """A concat batch that `run` left uncomputed (`_plan_projections`): what computing it later
    needs, its plan as of its forward, and the results it reads, each with its version then.
    A later computation reads those results as they are then: equal, unless one was written
    in place or rebound since, which `compute_deferred` refuses."""

    __slots__ = ("nodes", "head", "batch_read", "reads", "indices", "sources")

    def __init__(self, nodes: np.ndarray, head: tuple, batch_read: tuple, reads: list[Read],
                 indices: "_Indices", sources: list[tuple[int, torch.Tensor, int]]):
        self.nodes, self.head, self.batch_read = nodes, head, batch_read
        self.reads, self.indices, self.sources = reads, indices, sources


def _sources(graph: "Graph", arg_reads: tuple, reads: list[Read]) -> list[tuple]:
    """(batch, its result, the result's version) of each result that `arg_reads` read."""
    batches = set()
    for k in arg_reads:
        read = reads[k]
        batches.update([reads[p][1] for p in read[1]] if read[0] == "multi" else (read[1],))
    return [(b, graph.values[b], graph.values[b]._version) for b in sorted(batches)]


def _compute_deferred(graph: "Graph", reads: list[Read]) -> None:
    """Compute the deferred results among those that `reads` read (before anything reads
    them)."""
    for read in reads:
        if read[0] != "multi" and read[1] in graph.deferred:
            compute_deferred(graph, read[1])


def compute_deferred(graph: "Graph", batch: int) -> torch.Tensor:
    """The result of deferred batch `batch`, computed now, stored in `graph.values` and counted
    as a launch. Run in the modes of a forward's kernels (`Graph.result` enters them); the
    capture of torch calls is off."""
    deferred = graph.deferred[batch]
    for source, result, version in deferred.sources:
        if graph.values[source] is not result or result._version != version:
            first, op = deferred.head[:2]
            raise ExecutionError(
                f"{op.name} node #{first} is read, but it was not computed by "
                f"its forward (its only reader there took projections instead) and a result "
                f"it reads was written in place or rebound since: its value as of then cannot "
                f"be computed anymore. Ask for its value before the write (or read it in the "
                f"forward that computes its reader)")
    nodes, head = deferred.nodes, deferred.head
    with torch._C.DisableTorchFunction():
        value = _run_batch(graph, nodes, head, deferred.batch_read, deferred.reads,
                           deferred.indices, {})
    del graph.deferred[batch]
    graph.values[batch] = value
    graph.launches.append((head[2], len(nodes)))
    return value


def _refresh_parameters(graph: "Graph") -> None:
    """Parameters are read when the forward runs, like embedding tables: a parameter computed
    by an earlier forward of this graph is read anew if its tensor was rebound (`W.data = ...`)
    since; in-place updates are seen anyway (the value is a view of the parameter). A
    parameter whose tensor (the parameter of a view) kept its storage and shape since its last
    read is not looked at further: half the cost of taking the view and comparing it with the
    value (the parser's evaluation minibatch, ~100 forwards of 11 parameters: 1.25 -> 0.55 ms)."""
    known = graph.parameter_reads
    for node in graph.parameter_nodes:
        if node >= graph.n_done:
            break  # computed by this forward's own parameter kernel
        last = known.get(node)
        if last is not None and last[0].data_ptr() == last[1] and last[0].shape == last[2]:
            continue
        tensor = graph.parameter_value(node)  # a view (`U_f[0]`) is taken anew
        batch, _ = graph.position(node)
        cached = graph.values[batch]
        if cached.data_ptr() != tensor.data_ptr() or cached.shape[1:] != tensor.shape:
            if tuple(tensor.shape) != graph.shape_of(node):
                raise ExecutionError(f"parameter #{node}: its tensor was rebound to shape "
                                     f"{tuple(tensor.shape)} after nodes of shape "
                                     f"{graph.shape_of(node)} were written with it")
            graph.values[batch] = tensor.unsqueeze(0)
        read = graph.parameter_tensor(node)
        known[node] = (read, read.data_ptr(), read.shape)


# (torch's own switch: `with torch.no_grad()` costs ~3 us, ~1.5 ms of a parser's evaluation
# minibatch, where every batch was written under no_grad)
_set_grad_enabled = torch._C._set_grad_enabled


def _guarded(graph: "Graph", nodes: np.ndarray, no_grad: bool, kernel, *args) -> torch.Tensor:
    """Run a batch's kernel, under no_grad when the batch was written under torch.no_grad()
    (the whole batch was: a forward runs with grad on, and each node's own mode decides); a
    failure names the op, its signature and nodes (and, in debug mode, the lines that wrote
    them) instead of surfacing as a bare torch error. Its time is added to
    `graph.kernel_seconds` when that counter is on."""
    if no_grad:
        _set_grad_enabled(False)
    try:
        if graph.kernel_seconds is None:
            return kernel(*args)
        start = time.perf_counter()
        out = kernel(*args)
        graph.kernel_seconds += time.perf_counter() - start
        return out
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
    finally:
        if no_grad:
            _set_grad_enabled(True)


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
    """Cut a result of this forward read in pieces into those pieces at once, so that backward
    builds one gradient tensor for it instead of one zero-filled copy per piece."""
    tensor = graph.values[source]
    if not tensor.requires_grad:
        return  # no backward to protect: the reads run as plain views and selects
    read_ids, gather, sizes, piece_of = fan_out
    if gather is None:  # disjoint runs: views of the result; backward concatenates
        parts = torch.split(tensor, sizes)
        graph.gathers_avoided += len(read_ids)
    else:  # one gather of every read's rows; backward adds them into one zero tensor
        parts = torch.split(tensor.index_select(0, indices.rows(gather, sum(sizes), tensor)),
                            sizes)
        graph.gathers += len(read_ids)
    for k, piece in zip(read_ids, piece_of):
        pieces[k] = parts[piece]


def _read_earlier_results(graph: "Graph", reads: list[Read], earlier: tuple[int, ...],
                          fan_outs: dict, indices: _Indices, pieces: dict[int, torch.Tensor],
                          first_batch: int, plain: set[int]) -> None:
    """Make every partial read of an earlier forward's result that autograd tracks (a fan-out's
    gather or runs, or a read of its own) through the results' gradient sinks, all in ONE
    `_SinkReads`: an autograd function costs about as much as a small gather, and a step of a
    parser or of `map_batched` reads rows of several earlier results. The reads in `plain`,
    those of deferred concats, are not made. `earlier`: the reads that take part of an earlier
    forward's result, as the planner lists them (the others are read as they are)."""
    values = graph.values
    specs: list[tuple] = []  # (sink, rows or None, start, length) of each sink read
    served: list[tuple] = []  # (read ids, and for a gather the (sizes, piece of each read))
    fanned: set[int] = set()
    for source, fan_out in fan_outs.items():
        if source >= first_batch or not values[source].requires_grad:
            continue
        read_ids, gather, sizes, piece_of = fan_out
        if plain.issuperset(read_ids):
            continue  # read by deferred concats only
        if not _behind_sink(values[source]):
            _fan_out(graph, source, fan_out, indices, pieces)  # as a result of this forward
            continue
        fanned.update(read_ids)
        sink = _sink(graph, source)
        if gather is None:  # disjoint runs: a read of each run read
            starts = np.cumsum((0,) + sizes).tolist()
            for piece in sorted(set(piece_of)):
                specs.append((sink, None, starts[piece], sizes[piece]))
                served.append(([k for k, p in zip(read_ids, piece_of) if p == piece], None))
            graph.gathers_avoided += len(read_ids)
        else:
            specs.append((sink, indices.rows(gather, sum(sizes), sink.tensor), 0, 0))
            served.append((read_ids, (sizes, piece_of)))
            graph.gathers += len(read_ids)
    for k in earlier:
        if k in fanned or k in plain:
            continue
        read = reads[k]
        kind, source = read[0], read[1]
        tensor = values[source]
        if not _behind_sink(tensor) or (kind == "view" and read[3] == tensor.shape[0]):
            continue  # read as it is (by _resolve), or the whole result: read in place
        if kind == "view":
            specs.append((_sink(graph, source), None, read[2], read[3]))
            graph.gathers_avoided += 1
        else:
            specs.append((_sink(graph, source), indices.rows(read[2], read[3], tensor), 0, 0))
            graph.gathers += 1
        served.append(((k,), None))
    if not specs:
        return
    sinks = list({id(spec[0]): spec[0] for spec in specs}.values())
    outputs = kernels.apply_function(_SinkReads, specs, sinks, *[sink.token for sink in sinks])
    for output, (read_ids, split) in zip(outputs, served):
        if split is None:
            for k in read_ids:
                pieces[k] = output
        else:
            parts = torch.split(output, split[0])
            for k, piece in zip(read_ids, split[1]):
                pieces[k] = parts[piece]


def _resolve(graph: "Graph", k: int, reads: list[Read], indices: _Indices,
             pieces: dict[int, torch.Tensor], width: int = -1) -> torch.Tensor:
    """The tensor of read `k`; with a `width` >= 0, its rows narrowed or padded to it."""
    piece = pieces.pop(k, None) if pieces else None
    if piece is None:
        read = reads[k]
        kind = read[0]
        if kind == "view":  # (the common case first: a parameter, a run of one result)
            graph.gathers_avoided += 1
            piece = _rows(graph.values[read[1]], read[2], read[3])
        elif kind == "rows":
            _, source, at, length = read
            graph.gathers += 1
            tensor = graph.values[source]
            piece = tensor.index_select(0, indices.rows(at, length, tensor))
        else:
            return _resolve_multi(graph, read, reads, indices, pieces, width)
    return piece if width < 0 else _fit(piece, width)


def _resolve_multi(graph: "Graph", read: Read, reads: list[Read], indices: _Indices,
                   pieces: dict[int, torch.Tensor], width: int) -> torch.Tensor:
    """The tensor of a multi read: its parts concatenated, in the nodes' order."""
    _, parts, inverse, rows, whole = read
    graph.gathers += 1
    if whole is not None and width < 0:
        gathered = _rows_of_small_results(graph, parts, reads, indices, pieces, whole, rows)
        if gathered is not None:
            return gathered
    tensors = []
    for p in parts:  # (a run of rows read as it is, inline: a feature read from each of
        part = reads[p]  # many earlier results is one such part per result)
        if part[0] == "view" and width < 0 and p not in pieces:
            tensors.append(_rows(graph.values[part[1]], part[2], part[3]))
            graph.gathers_avoided += 1
        else:
            tensors.append(_resolve(graph, p, reads, indices, pieces, width))
    stacked = torch.cat(tensors)
    if inverse is None:
        return stacked
    return stacked.index_select(0, indices.rows(inverse, rows, stacked))


# Rows of MANY small results (a feature read from each of many earlier steps: one part per
# result, at least `_core`'s kWholeResultsMinParts): one cat of the whole results and one
# index_select of the rows, which the read planner lists, cost less than a view of each part
# (~2 us a view, in which time a cat copies thousands of elements).
WHOLE_RESULTS_MAX_ELEMENTS_PER_PART = 4096


def _rows_of_small_results(graph: "Graph", parts: tuple, reads: list[Read], indices: _Indices,
                           pieces: dict[int, torch.Tensor], whole: int,
                           rows: int) -> torch.Tensor | None:
    """The rows of a multi read, in the nodes' order, as one cat of its parts' results and one
    index_select of the rows indices[whole:whole+rows]; None when a part is a piece of a
    fan-out or the results are too large to copy whole."""
    if pieces and not pieces.keys().isdisjoint(parts):
        return None
    values = graph.values
    results = [values[reads[p][1]] for p in parts]  # (map, not generators: ~60 parts a read)
    if sum(map(torch.Tensor.numel, results)) > WHOLE_RESULTS_MAX_ELEMENTS_PER_PART * len(parts):
        return None
    whole_results = torch.cat(results)
    return whole_results.index_select(0, indices.rows(whole, rows, whole_results))


# ---- reads of an earlier forward's results ----------------------------------------------------
# A result of an earlier forward with fewer elements than this is read as it is, its gradient
# zero-filled per read as autograd does: for 16 KB that costs less than the ~20 us a gradient
# sink adds to a forward and to the backward. (The parser's score vectors of one step, read by
# the next step's hinge losses only, are such results; a BiLSTM's outputs are not.)
SINK_MIN_ELEMENTS = 4096


def _behind_sink(result: torch.Tensor) -> bool:
    """Whether the partial reads of `result`, a result of an earlier forward, go through its
    gradient sink."""
    return result.requires_grad and result.numel() >= SINK_MIN_ELEMENTS


def _sink(graph: "Graph", source: int) -> "_GradientSink":
    sink = graph.sinks.get(source)
    tensor = graph.values[source]
    if sink is None or sink.tensor is not tensor:  # (a parameter's value is re-read anew)
        sink = graph.sinks[source] = _GradientSink(tensor)
    return sink


class _GradientSink:
    """Where the gradients of every partial read of one result meet, in backward.

    Autograd's own `index_select` / `narrow` backward makes a zero tensor the size of the
    whole result per read, and adds them: O(reads x result) for a result read by many later
    forwards. Here each read (an output of `_SinkReads`) adds its gradient rows into ONE buffer,
    and the
    sink's `token` (a 0-dim output of `_Collect`, an input of every read) hands the buffer to
    the result's own backward once all reads have run: the engine runs `_Collect`'s backward
    only after every function that consumed the token. Equal gradients, by construction.
    """

    __slots__ = ("tensor", "grad", "token")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.grad: torch.Tensor | None = None
        self.token = _Collect.apply(tensor, self)

    def add(self, rows: torch.Tensor | None, start: int, grad: torch.Tensor) -> None:
        if self.grad is None:
            self.grad = torch.zeros_like(self.tensor)
        if rows is None:
            self.grad.narrow(0, start, grad.shape[0]).add_(grad)
        else:
            self.grad.index_add_(0, rows, grad)

    def take(self) -> torch.Tensor | None:
        grad, self.grad = self.grad, None  # a second backward (retain_graph) starts afresh
        return grad


class _Collect(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, sink):
        ctx.sink = sink
        return tensor.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return ctx.sink.take(), None


class _SinkReads(torch.autograd.Function):
    """Reads of results of earlier forwards, one output per (sink, rows or None, start,
    length): the rows `rows` of the sink's result, or its run start..start+length. Its inputs
    are the tokens of `sinks`; backward adds each output's gradient into its sink."""

    @staticmethod
    def forward(ctx, specs, sinks, *tokens):
        ctx.specs, ctx.sinks = specs, sinks
        ctx.set_materialize_grads(False)  # an output nobody used gets no zero-filled gradient
        return tuple(sink.tensor[start:start + length] if rows is None else
                     sink.tensor.index_select(0, rows) for sink, rows, start, length in specs)

    @staticmethod
    def backward(ctx, *grads):
        for (sink, rows, start, _), grad in zip(ctx.specs, grads):
            if grad is not None:
                sink.add(rows, start, grad)
        return (None, None, *[sink.token.new_zeros(()) for sink in ctx.sinks])


class _SinkRowSums(torch.autograd.Function):
    """The rows `rows` ([n * k]) of a sink's result, summed k by k: [n, ...] (a projected
    product's k blocks of each node, `_gather_projections`), as ONE autograd function, where
    a sink read, its view and the sum were three (~5 us more per forward and per backward,
    80 forwards of a parser's minibatch). The same kernels, so the same values; backward
    expands each node's gradient to its k rows and adds them into the sink, as the sum's and
    the view's backwards and the read's did."""

    @staticmethod
    def forward(ctx, sink, rows, n, token):
        ctx.sink, ctx.rows = sink, rows
        picked = sink.tensor.index_select(0, rows)
        return picked.view(n, -1, *picked.shape[1:]).sum(1)

    @staticmethod
    def backward(ctx, grad):
        n, k = grad.shape[0], ctx.rows.shape[0] // grad.shape[0]
        ctx.sink.add(ctx.rows, 0, grad.unsqueeze(1).expand(n, k, *grad.shape[1:])
                     .reshape(n * k, *grad.shape[1:]))
        return None, None, None, ctx.sink.token.new_zeros(())


def _fit(rows: torch.Tensor, width: int) -> torch.Tensor:
    """Rows of a result with their leading dim `width`: narrowed when the result is stored
    padded wider, padded with zeros when a padded op reads it with longer ones. Autograd
    takes the gradient of the real part only."""
    if rows.shape[1] == width:
        return rows
    if rows.shape[1] > width:
        return rows.narrow(1, 0, width)
    missing = rows.new_zeros(rows.shape[0], width - rows.shape[1], *rows.shape[2:])
    return torch.cat([rows, missing], 1)


def _rows(source: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Rows start..start+length of a batch result, as a view (the tensor itself if all).
    (A slice, not `narrow`: torch's fast path for slices saves ~1 us a call, and a forward
    reading rows of many results makes one per result.)"""
    if start == 0 and length == source.shape[0]:
        return source
    return source[start:start + length]
