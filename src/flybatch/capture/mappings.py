"""The fast mappings: torch calls recorded as flybatch ops (unary and binary elementwise,
matmul, cat, stack, linear, embedding, dropout...), and the row-wise calls of length-led operands
that run as one padded launch across lengths."""

from __future__ import annotations

import math
import numbers
import types
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .. import _core, kernels, ops
from ..graph import _INDEX_DTYPES, Expression, Graph, Op
from .calls import _Call, _graph_of
from .argmax import ArgmaxIndex
from .generic import _batch_operands
from .direct import (_Bound, _Plan, _SAME, _apply_template, _as_is, _dim, _direct, _meta_of,
                     _record, _shifted)


# ---- the fast mappings ------------------------------------------------------------------------
def _is_float(g: Graph, x: Any) -> bool:
    if isinstance(x, Expression):  # (not g.dtype_of: it would fix the graph's dtype early)
        return x.id not in g.node_dtypes  # of the graph's floating dtype, which fb ops compute in
    if isinstance(x, torch.Tensor):
        return x.is_floating_point()
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _fb_unary(rule):
    def handler(x, *rest, **kwargs):
        if rest or kwargs.get("inplace") or any(k != "inplace" for k in kwargs) \
                or not _is_float(_graph_of((x,), {}), x):
            return NotImplemented
        return rule(x)
    return handler


def _fb_binary(rule, reflected=False):
    def handler(a, b, *rest, **kwargs):
        if rest or kwargs:
            return NotImplemented
        g = _graph_of((a, b), {})
        if not (_is_float(g, a) and _is_float(g, b)):
            return NotImplemented
        return rule(b, a) if reflected else rule(a, b)
    return handler


def _matmul(a, b, **kwargs):
    if kwargs:
        return NotImplemented
    g = _graph_of((a, b), {})
    shapes = [g.shape_of(node_of_operand(g, v)) if isinstance(v, Expression) else tuple(v.shape)
              for v in (a, b)]
    if any(len(s) > 2 or len(s) == 0 for s in shapes) or not (_is_float(g, a) and _is_float(g, b)):
        return NotImplemented
    return ops.matmul(a, b)


def node_of_operand(g: Graph, x: Any) -> int:
    return g.node_of(x) if isinstance(x, Expression) else g._operand(x)


def _rmatmul(a, b, **kwargs):
    return _matmul(b, a, **kwargs)


def _cat(tensors, dim=0, **kwargs):
    if kwargs or not tensors:
        return NotImplemented
    g = _graph_of((tensors,), {})
    if not all(_is_float(g, t) for t in tensors):
        return NotImplemented
    shapes = [g.shape_of(node_of_operand(g, t)) if isinstance(t, Expression) else tuple(t.shape)
              for t in tensors]
    ndim = len(shapes[0])
    if ndim == 0:
        return NotImplemented  # torch's error
    return ops.concat([t for t in tensors], dim=_dim(dim, ndim, "cat") - 1)


def _stack(tensors, dim=0, **kwargs):
    if kwargs or not tensors:
        return NotImplemented
    call = _Call((tuple(tensors), dim), {})
    ndim = len(call.graph.shape_of(call.nodes[0])) + 1
    shape, dtype = _meta_of(torch.stack, call)
    d = _dim(dim, ndim, "stack")
    return _direct("stack", call, _Bound(_stack_batched, d), (), shape, dtype,
                   shared=(False,) * len(call.nodes), cheap=True)


def _stack_batched(dim, batch):
    return torch.stack(batch, dim)


def _stack_rows(tensors, dim=0, **kwargs):
    """`torch.stack(xs)` of expressions along a new first dim: `fb.stack`, which batches
    stacks of any number of rows as one launch (the rows of an attention's keys); any other
    stack as its own node per shape."""
    if not kwargs and isinstance(tensors, (list, tuple)) and tensors \
            and all(type(t) is Expression for t in tensors):
        g = tensors[0].graph
        ndim = len(g.shape_of(tensors[0].id)) + 1
        if -ndim <= dim < ndim and dim % ndim == 0 and all(_is_float(g, t) for t in tensors):
            return ops.stack(list(tensors))
    return _stack(tensors, dim, **kwargs)


# ---- row-wise calls of length-led operands: one launch across lengths ---------------------
# A sentence-level model's calls (an embedding of the sentence's words, a view to (n, 1, E), a
# linear layer, a log_softmax over the classes, an NLL over the tokens) act on each row of an
# operand whose leading dim is the sentence's length on its own. Where that operand is
# length-led (ops.py: stored padded, its signature writes the length as n), or is the index of
# an embedding, the call's signature writes the length as n too, and its node is a padded op:
# sentences of every length run as ONE call on the padded [B, longest, ...] batch, each node
# keeping its own shape, and its result is length-led in turn. Any other call, or one whose
# operands disagree on the length, keeps the exact plan.
def _led(x: Any) -> bool:
    """Whether `x` is an expression whose leading dim is a length."""
    return type(x) is Expression and x.graph.length_led(x.id)


def _rows_kernel(xs, attr, shape, lengths=None):
    """`fn` of the batch operands; with `lengths` (they differ), first each `fills` operand's
    padding set to its value (an NLL target's to ignore_index), and after it, with
    `zero_padding`, the result's padding zeroed where `fn` of zeros is not zeros (a bias, a
    log_softmax): no padding reaches a real value, and no gradient reaches the padding."""
    fn, shared, fills, zero_padding = attr
    _, batch = _batch_operands(xs, shared)
    if lengths is None:
        return fn(batch)
    for k, value in fills:
        batch[k] = batch[k].masked_fill(ops._padding(lengths, batch[k]), value)
    out = fn(batch)
    return out.masked_fill(ops._padding(lengths, out), 0.0) if zero_padding else out


ROWS = Op("torch", _rows_kernel, padded=True)
_ROWS_CHEAP = Op("torch", _rows_kernel, padded=True, cheap=True)


def _rows_plan(call: _Call, label: str, fn: Callable, shape: tuple, dtype: torch.dtype,
               shared: tuple[bool, ...], fills: tuple = (), zero_padding: bool = False,
               cheap: bool = False, whole: tuple[int, ...] = ()) -> Any:
    """The plan of a row-wise call whose per-instance operands all lead with one length n
    (but those at `whole`, which have no rows: an instance's own class weights): its
    signature is (label, fn, each operand's shape with n for its leading dim), with the
    shared operands' nodes. NotImplemented where an operand has no rows or another length."""
    lengths = {s[0] if s else None for k, ((s, _), p) in enumerate(zip(call.operands, shared))
               if not p and k not in whole}
    if len(lengths) != 1 or None in lengths or (shape and shape[0] not in lengths):
        return NotImplemented
    operands = tuple("P" if p else (s, d) if k in whole else (("n",) + tuple(s[1:]), d)
                     for k, ((s, d), p) in enumerate(zip(call.operands, shared)))
    return _Plan((label, fn, operands), _ROWS_CHEAP if cheap else ROWS, shape, dtype,
                 (fn, shared, fills, zero_padding), tuple(i for i, p in enumerate(shared) if p),
                 f"{label} rows")


def _across_lengths(handler: Callable, args: tuple, kwargs: dict | None, build: Callable,
                    weights: tuple = ()) -> Any:
    """`handler`'s call by its row-wise plan (`build`'s: a `_Plan` or NotImplemented), kept
    apart from its exact plans (the operand shapes, which key plans, do not say what is a
    length)."""
    return _record((handler, "rows"), args, kwargs, build, weights)


def _padded_vector(fb_op: Callable, func: Callable, label: str) -> Callable:
    """softmax / log_softmax over the one dim of a vector expression: the padded fb op, one
    launch for vectors of every length (scores over source positions); over another dim than
    the leading one of a length-led matrix (the tag scores of each word of a sentence), one
    launch across lengths too; else the call shifted past the batch dim."""
    fallback = _shifted(func, 1, label)

    def rows(call):
        (shape, _), = call.operands
        dim = _dim(call.args[1], len(shape), label)
        fn = _Bound(_apply_template, func, (call.args[0], dim), {}, key=(call.key, dim))
        return _rows_plan(call, label, fn, shape, call.operands[0][1], (False,),
                          zero_padding=True)

    def handler(x, dim=None, *args, **kwargs):
        if type(x) is Expression and not args and kwargs.get("dtype") is None \
                and set(kwargs) <= {"dtype"} and _is_float(x.graph, x):
            if dim in (0, -1) and len(x.shape) == 1:
                return fb_op(x)
            if type(dim) is int and len(x.shape) >= 2 and -len(x.shape) <= dim < len(x.shape) \
                    and dim % len(x.shape) != 0 and _led(x):
                out = _across_lengths(handler, (x, dim), None, rows)
                if out is not NotImplemented:
                    return out
        return fallback(x, dim, *args, **kwargs)
    return handler


def _transpose(x, dim0, dim1):
    """x.transpose(dim0, dim1): both dims shifted past the batch dim."""
    if not isinstance(x, Expression):
        return NotImplemented
    ndim = len(x.shape)
    d0, d1 = _dim(dim0, ndim, "transpose"), _dim(dim1, ndim, "transpose")
    shape = list(x.shape)
    if ndim:
        shape[d0 - 1], shape[d1 - 1] = shape[d1 - 1], shape[d0 - 1]
    return _direct("transpose", _Call((x,), {}), _Bound(_transpose_batched, d0, d1), (),
                   tuple(shape), x.graph.dtype_of(x.id), shared=(False,), cheap=True)


def _transpose_batched(dim0, dim1, batch):
    return batch[0].transpose(dim0, dim1)


def _reshape_like(func: Callable):
    """view / reshape / flatten / squeeze / unsqueeze...: a reshape node to the meta shape (the
    input itself when the shape stays)."""
    def build(call):
        if len(call.nodes) != 1:
            return NotImplemented  # view_as(other), reshape_as(other): generic
        (old, old_dtype), = call.operands
        shape, dtype = _meta_of(func, call)
        if dtype != old_dtype:
            return NotImplemented  # x.view(torch.int32) reinterprets the bytes: generic
        if tuple(shape) == old:
            return _SAME
        # The dtype is in the signature: a plan serves graphs of any dtype, and a reshape of
        # an integer (or other non-graph-dtype) value must not share a batch with the floats.
        return _Plan(("reshape", old, tuple(shape), dtype), ops.RESHAPE, shape, dtype, None)

    def rows(call):
        """Of a length-led input, a reshape of each row ((n, E) <-> (n, 1, E)): across lengths."""
        if len(call.nodes) != 1:
            return NotImplemented
        (old, old_dtype), = call.operands
        shape, dtype = _meta_of(func, call)
        if dtype != old_dtype or tuple(shape) == old or not shape or shape[0] != old[0]:
            return NotImplemented
        fn = _Bound(_reshape_rows, tuple(shape[1:]))
        return _rows_plan(call, "reshape", fn, shape, dtype, (False,), cheap=True)

    def handler(x, *args, **kwargs):
        if not isinstance(x, Expression):
            return NotImplemented
        if _led(x):
            out = _across_lengths(handler, (x,) + args, kwargs, rows)
            if out is not NotImplemented:
                return out
        return _record(handler, (x,) + args, kwargs, build)
    return handler


def _reshape_rows(row_shape, batch):
    x = batch[0]
    return x.reshape(x.shape[0], x.shape[1], *row_shape)


def _linear(x, weight, bias=None):
    operands = (x, weight) if bias is None else (x, weight, bias)
    if _led(x):
        out = _across_lengths(_linear, operands, None, _linear_rows, (1, 2))
        if out is not NotImplemented:
            return out
    return _record(_linear, operands, None, _linear_plan, (1, 2))


def _linear_plan(call):
    shared = call.weights_shared()
    if shared is None:
        return NotImplemented  # a per-instance weight: generic
    return ("linear", _linear_batched, *_meta_of(F.linear, call), shared, False)


def _linear_rows(call):
    """Of a length-led input (n, ..., D): each row, zeros again past a bias."""
    shared = call.weights_shared()
    if shared is None or len(call.operands[0][0]) < 2:
        return NotImplemented
    return _rows_plan(call, "linear", _linear_batched, *_meta_of(F.linear, call), shared,
                      zero_padding=len(call.nodes) == 3)


def _linear_batched(batch):
    x, w, *b = batch
    flat = x.reshape(-1, x.shape[-1])
    out = kernels.linear(flat, w, b[0] if b else None)
    return out.reshape(*x.shape[:-1], w.shape[0])


_embedding_as_is = _as_is(F.embedding, weights=(1, "weight"), cheap=True)


_EMBEDDING_OPTIONS = ("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")


def _embedding(input, weight, *args, **kwargs):
    options = dict(zip(_EMBEDDING_OPTIONS, args), **kwargs)
    if options.get("scale_grad_by_freq"):
        raise ValueError("F.embedding(scale_grad_by_freq=True) on flybatch: it scales gradients "
                         "by counts in ONE call, and batching decides which lookups share a call")
    if type(input) is ArgmaxIndex:  # `emb(out.argmax())`: the row it holds, as eagerly
        input = input.tensor
    g = _graph_of((input,), {})
    # A constant one-element index (`torch.tensor([word])`) into a parameter: a row lookup,
    # the row kept by the node, with no index input. Under no_grad (a lookup node has no
    # inputs to carry the mode) and with options that act on the table, the general path.
    if options.get("padding_idx") is None and options.get("max_norm") is None and \
            torch.is_grad_enabled() and isinstance(weight, torch.Tensor) and \
            weight.requires_grad and weight.is_leaf and weight.dim() == 2:
        row = _constant_row(g, input)
        if row is not None:
            return _lookup_rows(g, weight, row, tuple(input.shape),
                                bool(options.get("sparse", False)))
    if isinstance(input, (Expression, torch.Tensor)) and not _is_float(g, input):
        if len(input.shape) == 1 and input.shape[0] > 1 and options.get("max_norm") is None \
                and not options.get("sparse"):
            out = _across_lengths(_embedding, (input, weight) + args, kwargs, _embedding_rows,
                                  (1, "weight"))
            if out is not NotImplemented:
                return out
        return _embedding_as_is(input, weight, *args, **kwargs)
    return NotImplemented


def _embedding_rows(call):
    """A sentence's words (a 1-D index of two or more) into a shared table: one gather for
    every length, whose result (n, E) is length-led. (The padding's index 0 gathers row 0,
    zeroed: it adds only zeros to that row's gradient. With max_norm, which renormalises the
    rows it reads, or a sparse gradient, which would list them, the exact path; and one
    element is a row, as `torch.tensor([word])` is a row lookup, never a length.)"""
    shared = call.weights_shared()
    if shared is None:
        return NotImplemented
    fn = _Bound(_apply_template, F.embedding, call.args, call.kwargs, key=call.key)
    return _rows_plan(call, "embedding", fn, *_meta_of(F.embedding, call), shared,
                      zero_padding=True, cheap=True)


def _constant_row(g: Graph, index: Any) -> int | None:
    """The row a one-element integer index on the CPU holds now, unless it is an expression
    or a tensor written with one (then its value is not known yet); else None."""
    if type(index) is not torch.Tensor or id(index) in g.shadows:
        return None
    if index.dtype not in _INDEX_DTYPES or index.numel() != 1 or not index.is_cpu:
        return None
    return index.item()  # (an int, as int(index) gives it in a third of the time)


# `F.embedding` of a one-element index of shape `index_shape` holding `row`: a lookup node of
# shape `index_shape + (columns,)` (a 0-d index: `fb.lookup` itself). The compiled core's
# (capture.cpp), which takes the commonest such call itself, without this handler.
_lookup_rows = _core.lookup_rows


def _dropout(input, p=0.5, training=True, inplace=False):
    if not isinstance(input, Expression) or not _is_float(input.graph, input) or \
            not 0 <= p < 1:  # (p = 1 zeroes without a draw, any other p raises: as a torch call)
        return NotImplemented
    return ops.dropout(input, p, training)


_SELU_ALPHA = 1.7580993408473766  # aten's alpha dropout: -selu's scale * alpha


def _noise_dropout(feature: bool, alpha: bool):
    """torch.feature_dropout, alpha_dropout, feature_alpha_dropout (under F.dropout1d/2d/3d,
    F.alpha_dropout, nn.AlphaDropout...): the noise needs the input's shape, not its values,
    so it is drawn when the call is written, by aten's own calls (`_dropout_impl`), taking
    the numbers eager torch takes; the input times it (plus alpha dropout's shift) is
    recorded. On the values it would cost a forward per call."""
    def handler(input, p, train):
        if not isinstance(input, Expression) or not _is_float(input.graph, input) or \
                not 0 <= p < 1:  # (p = 1 zeroes without a draw, any other p raises)
            return NotImplemented
        shape = tuple(input.shape)
        if not train or p == 0 or math.prod(shape) == 0:  # eager returns its input
            return input
        if feature and len(shape) < 2:
            return NotImplemented  # torch's error
        g = input.graph
        noise_shape = shape[:2] + (1,) * (len(shape) - 2) if feature else shape
        with torch._C.DisableTorchFunction():
            noise = torch.empty(noise_shape, dtype=g.dtype_of(input.id),
                                device=g.device or "cpu").bernoulli_(1 - p)
            if alpha:
                a = 1.0 / math.sqrt((_SELU_ALPHA * _SELU_ALPHA * p + 1) * (1 - p))
                shift = noise.add(-1).mul_(_SELU_ALPHA * a).add_(_SELU_ALPHA * a * p)
                noise.mul_(a)
            else:
                noise.div_(1 - p)
        return input * noise + shift if alpha else input * noise
    return handler


def _own_body(func: Callable) -> Callable:
    """A torch.nn.functional function written in Python run as its own body on expressions
    (its `handle_torch_function` hand-off skipped), so each torch call in it is recorded or
    run as any other: F.gumbel_softmax's noise (`empty_like(logits).exponential_()`) is drawn
    at the call as eagerly instead of the whole function running on the values (a forward
    per call, as a function that draws random numbers must)."""
    never = lambda *args: False  # noqa: E731 - the hand-off's test, answered
    body = types.FunctionType(func.__code__, {**func.__globals__, "has_torch_function": never,
                                              "has_torch_function_unary": never,
                                              "has_torch_function_variadic": never},
                              func.__name__, func.__defaults__, func.__closure__)
    body.__kwdefaults__ = func.__kwdefaults__
    return body


def _reduce_all(rule):
    def handler(x, *args, **kwargs):
        if args or kwargs or not isinstance(x, Expression) or not _is_float(x.graph, x):
            return NotImplemented
        return rule(x)
    return handler


def _detach(x):
    if not isinstance(x, Expression):
        return NotImplemented
    with torch.no_grad():  # a node written under no_grad computes without autograd history
        return _record(_detach, (x,), None, _detach_plan)


def _detach_plan(call):
    shape, dtype = call.operands[0]
    return "detach", _detached, shape, dtype, (False,), True


def _detached(batch):
    # Under no_grad an identity would hand on its input, history and all: detach it.
    return batch[0].detach()


def _made_from(func: Callable, shaped: bool):
    """A plain tensor made from an expression (or a parameter) whose values it does not need,
    as eagerly: zeros_like, ones_like, rand_like... (`shaped`: of its shape) and x.new_zeros(),
    x.new_tensor()... (of its dtype and device). The call runs on a stand-in of that shape,
    dtype and device."""
    def handler(x, *args, **kwargs):
        if isinstance(x, Expression):
            g = x.graph
            stand_in = torch.empty(x.shape if shaped else 0, dtype=g.dtype_of(x.id),
                                   device=g.device or "cpu")
        elif isinstance(x, torch.Tensor):
            stand_in = x
        else:
            return NotImplemented
        with torch._C.DisableTorchFunction():
            return func(stand_in, *args, **kwargs)
    return handler
