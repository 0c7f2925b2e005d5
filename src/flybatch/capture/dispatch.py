"""Which handler records a call: the table from torch functions to handlers, the C front
end's configuration, and the fallbacks of a call no handler takes (in-place, `out=`, generic)."""

from __future__ import annotations

import functools
import inspect
import operator
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from .. import _core, ops
from ..graph import Expression, _current
from .calls import T, _current_value, _graph_of, _name, torch_call
from .mode import (_Capture, _DESCRIBE, _READS_VALUE, _REBINDS, _REBOUND_ATTRIBUTES,
                   _RECORDED_PROPERTIES, _SHADOWED_PROPERTIES, _before_write, _forget, _thread)
from .argmax import _argmax_tensors, _holds_argmax
from .generic import _batch_norm, _generic
from .direct import _Recipe, _as_is, _elementwise, _group_norm, _shifted
from .inplace import _INPLACE_DUNDERS, _inplace
from .indexing import _pieces, _tensor_getitem
from .mappings import (_cat, _detach, _dropout, _embedding, _fb_binary, _fb_unary, _linear,
                       _made_from, _matmul, _noise_dropout, _own_body, _padded_vector,
                       _reduce_all, _reshape_like, _rmatmul, _stack_rows, _transpose)
from .losses import _loss
from .recurrent import _cell, _pack_padded, _pad_packed, _rnn


def _refuse_inplace(func: Callable) -> None:
    # Run as a generic node it would overwrite the batch holding its input's value.
    raise TypeError(f"{_name(func)}(inplace=True) writes in place into a flybatch "
                    "expression, which has no storage; use inplace=False")


def _refuse_autocast(func: Callable) -> None:
    """A call recorded inside a `torch.autocast` region (the core asks only while one is on):
    its batched kernel would compute in its operands' dtype, not in the region's lower
    precision as the eager call does, so it raises where the region is the graph's device's."""
    g = _current.get()
    devices = ("cpu", "cuda") if g is None or g.device is None else (g.device.type,)
    on = [d for d in devices if torch.is_autocast_enabled(d)]
    if on:
        raise TypeError(f"{_name(func)}: torch.autocast({on[0]!r}) is not supported inside a "
                        "flybatch graph (its batched kernel would not compute in "
                        f"{torch.get_autocast_dtype(on[0])}); cast the parameters and inputs "
                        "to the lower precision instead, or leave the autocast region")


def _unhandled(func: Callable, args: tuple, kwargs: dict) -> Any:
    """A recorded call no handler took: an in-place write, or a generic node."""
    name = getattr(func, "__name__", "")
    if name.endswith("_") and not name.startswith("__") or name == "__setitem__" or \
            name.startswith("__i") and name[3:-2] in _INPLACE_DUNDERS:
        return _inplace(func, name, args, kwargs)
    if kwargs.get("out") is not None:
        return _written_out(func, args, kwargs)
    if _holds_argmax(args) or kwargs and _holds_argmax(kwargs.values()):  # `gather(x, 0, i)`
        args, kwargs = _argmax_tensors((args, kwargs))
    return _generic(func, args, kwargs)


def _written_out(func: Callable, args: tuple, kwargs: dict) -> Any:
    """`func(..., out=t)` (spectral norm's power iteration into its buffers): recorded without
    `out`, then written into t as `t.copy_(result)` is (the plain tensor stands for its new
    value); returns t, as eagerly."""
    kwargs = dict(kwargs)
    out = kwargs.pop("out")
    result = torch_call(func, args, kwargs)
    outs, results = (out, result) if isinstance(out, (tuple, list)) else ((out,), (result,))
    for target, value in zip(outs, results):
        if isinstance(target, Expression):
            raise TypeError(f"{_name(func)}(out=...) into a flybatch expression: an expression "
                            "has no storage to write into; use the returned value")
        torch_call(T.copy_, (target, value), {})
    return out


def _torch_function(cls, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    name = getattr(func, "__name__", "")
    if name == "__get__" or name in _DESCRIBE and not any(isinstance(a, Expression) for a in args):
        with torch._C.DisableTorchFunction():
            return func(*args, **kwargs)
    return torch_call(func, args, kwargs)


Expression.__torch_function__ = classmethod(_torch_function)


_HANDLERS: dict[Callable, Callable] = {}
# The unary functions `_fb_unary` maps onto an fb op: `torch_call` applies the op itself to one
# floating expression without other arguments, the commonest call, and calls the handler else.
_FB_UNARY: dict[Callable, Callable] = {}
# The functions whose handler only looks the call's plan up, as `_record(handler, args, kwargs,
# build, weights)`: function -> (handler, weights), or (handler, weights, "classes") for a class
# loss (its keywords and target index planned too, the target checked as `_check_classes`
# does). `torch_call` takes a known plan itself, without the handler's Python frames, for a
# call the handler would pass on unchanged.
_PLANNED: dict[Callable, tuple] = {}
# The front end (`_Capture.__torch_function__`) and the head of `torch_call`, in C.
_core.configure_front(_Capture, _DESCRIBE, _READS_VALUE, _REBINDS, _RECORDED_PROPERTIES,
                      _REBOUND_ATTRIBUTES, _forget, _before_write, _current, _thread, _HANDLERS,
                      _refuse_inplace, _refuse_autocast, _unhandled, _FB_UNARY, _PLANNED,
                      _Recipe)

# torch's functions written in Python (most of torch.nn.functional, torch.functional, the Tensor
# methods of torch/_tensor.py) reach a mode through torch.overrides.handle_torch_function, Python
# too: it cost more than recording the call. Each of those modules imported that name, so it is
# rebound there, here and only here, to `_core.handle_torch_function` (csrc/dispatch.cpp), which
# does the same in C when the innermost mode is capture's own and calls torch's otherwise. A
# module where the name is no longer torch's (something else rebound it) is left as it is.
_core.configure_dispatch(_Capture, torch.overrides.handle_torch_function)
for _module in (F, torch.functional, torch._tensor):
    if _module.handle_torch_function is torch.overrides.handle_torch_function:
        _module.handle_torch_function = _core.handle_torch_function


# The positional parameters of each recorded torch function, by name: `record` (capture.cpp)
# puts a call's keywords for its leading parameters in place (`F.linear(input=x, weight=W)` is
# recorded as `F.linear(x, W)`), as torch itself binds them. Found once per function.
_POSITIONAL_NAMES: dict[Callable, tuple[str, ...]] = {}


@functools.lru_cache(maxsize=None)
def _stand_ins() -> dict:
    # torch's stand-in lambdas of ~1.4k functions' signatures, keyed by torch's own functions
    # (the table is made with whatever the names are bound to now: a shortcut while capturing)
    shortcuts = (_core.Shortcut, _core.MethodShortcut)
    return {f.__wrapped__ if type(f) in shortcuts else f: stand_in
            for f, stand_in in torch.overrides.get_testing_overrides().items()}


def _positional_names(func: Callable) -> tuple[str, ...]:
    """func's parameters that can be passed by position, in order (its Python signature, or
    the one torch.overrides gives a C function); () where neither is known."""
    signature = None
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # a C function: torch's stand-in lambda of its signature
        stand_in = _stand_ins().get(func)
        if stand_in is not None:
            signature = inspect.signature(stand_in)
    names = () if signature is None else tuple(
        p.name for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    _POSITIONAL_NAMES[func] = names
    return names


_core.configure_positional(_POSITIONAL_NAMES, _positional_names)


def _register(funcs, handler) -> None:
    for func in funcs:
        if func is not None:
            _HANDLERS[func] = handler


# The Expression operators + - * / @ and unary - (csrc/rules.cpp) of an operand that is not of
# the graph's floating dtype: torch's type promotion decides the result's dtype (`mask.long() +
# 1` is an integer, `h.float() * 3` a float32), so they are recorded as the Tensor operators,
# by operator: (the operator, its reflection for a plain left operand).
_TENSOR_OPERATORS = ((T.__add__, T.__radd__), (T.__sub__, T.__rsub__), (T.__mul__, T.__rmul__),
                     (T.__truediv__, T.__rtruediv__), (T.__matmul__, T.__rmatmul__),
                     (T.__neg__, None))


def _tensor_operator(which: int, a: Any, b: Any) -> Any:
    operator, reflected = _TENSOR_OPERATORS[which]
    if reflected is None:  # unary -
        return torch_call(operator, (a,), {})
    if isinstance(a, Expression):
        return torch_call(operator, (a, b), {})
    return torch_call(reflected, (b, a), {})


ops._tensor_operator = _tensor_operator


def _shadowed_property(name: str) -> Callable:
    """`tensor.data` / `.requires_grad` / `.is_leaf` of a plain tensor the graph wrote into:
    those of the expression that now stands for it (its storage still holds the old values)."""
    def read(tensor):
        new = _current_value(_graph_of((tensor,), {}), tensor)
        return new.detach() if name == "data" else getattr(new, name)
    return read


for _property in _SHADOWED_PROPERTIES:
    _register([getattr(T, _property).__get__], _shadowed_property(_property))
_unary_ops = {
    "tanh": (torch.tanh, T.tanh, F.tanh), "sigmoid": (torch.sigmoid, T.sigmoid, F.sigmoid),
    "relu": (torch.relu, T.relu, F.relu), "exp": (torch.exp, T.exp), "log": (torch.log, T.log),
    "abs": (torch.abs, T.abs, T.__abs__), "sqrt": (torch.sqrt, T.sqrt),
    "square": (torch.square, T.square), "neg": (torch.neg, T.neg, T.__neg__, torch.negative),
}
_unary_handlers = {}  # handler -> its fb op, for _FB_UNARY
for _op, _funcs in _unary_ops.items():
    _handler = _fb_unary(getattr(ops, _op))
    _unary_handlers[_handler] = getattr(ops, _op)
    _register(_funcs, _handler)
_binary_ops = {
    "add": ((torch.add, T.add, T.__add__), (T.__radd__,)),
    "sub": ((torch.sub, T.sub, T.__sub__, torch.subtract), (T.__rsub__,)),
    "mul": ((torch.mul, T.mul, T.__mul__, torch.multiply), (T.__rmul__,)),
    "div": ((torch.div, T.div, T.__truediv__, torch.true_divide), (T.__rtruediv__,)),
}
for _op, (_funcs, _reflected) in _binary_ops.items():
    _register(_funcs, _fb_binary(getattr(ops, _op)))
    _register(_reflected, _fb_binary(getattr(ops, _op), reflected=True))
_register((torch.matmul, T.matmul, T.__matmul__, torch.mm, T.mm, torch.sparse.mm), _matmul)
_register((T.__rmatmul__,), _rmatmul)
_register((torch.cat, torch.concat, torch.concatenate), _cat)
_register((torch.stack,), _stack_rows)
for _func in (T.view, T.reshape, torch.reshape, T.flatten, torch.flatten, T.squeeze,
              torch.squeeze, T.unsqueeze, torch.unsqueeze, T.view_as, T.reshape_as, T.unflatten,
              torch.unflatten, T.contiguous, T.ravel, torch.ravel):
    _register((_func,), _reshape_like(_func))
    _PLANNED[_func] = (_HANDLERS[_func], ())
_register((torch.sum, T.sum), _shifted(torch.sum, 1, "sum", reduce_all=_reduce_all(ops.sum_elems)))
_register((torch.mean, T.mean), _shifted(torch.mean, 1, "mean",
                                         reduce_all=_reduce_all(ops.mean_elems)))
for _name_, _funcs in {
        "softmax": (torch.softmax, T.softmax, F.softmax),
        "log_softmax": (torch.log_softmax, T.log_softmax, F.log_softmax),
        "logsumexp": (torch.logsumexp, T.logsumexp), "cumsum": (torch.cumsum, T.cumsum),
        "prod": (torch.prod, T.prod), "argmax": (torch.argmax,),
        "argmin": (torch.argmin, T.argmin), "amax": (torch.amax, T.amax),
        "amin": (torch.amin, T.amin), "norm": (), "std": (), "var": (),
        "select": (torch.select, T.select), "narrow": (torch.narrow, T.narrow),
        "unbind": (),
        "movedim": (), "roll": (), "flip": (), "cross": (),
        "normalize": (F.normalize,), "glu": (F.glu,),
}.items():
    for _func in _funcs:
        _register((_func,), _shifted(_func, 1, _name_, cheap=_name_ in ("select", "narrow")))
for _func in (torch.softmax, T.softmax, F.softmax):
    _register((_func,), _padded_vector(ops.softmax, _func, "softmax"))
for _func in (torch.log_softmax, T.log_softmax, F.log_softmax):
    _register((_func,), _padded_vector(ops.log_softmax, _func, "log_softmax"))
_register((torch.transpose, T.transpose), _transpose)
_argmax_along = _shifted(T.argmax, 1, "argmax")  # (one handler: its plans are kept per handler)
_register((T.argmax,), lambda x, dim=None, keepdim=False: NotImplemented if dim is None
          else _argmax_along(x, dim, keepdim))
for _func in (torch.pow, T.pow, T.__pow__, T.__rpow__, torch.clamp, T.clamp, torch.clip, T.clip,
              torch.maximum, torch.minimum, torch.where, F.gelu, F.elu, F.leaky_relu, F.silu,
              F.softplus, F.hardtanh, F.relu6, F.selu, F.celu, F.mish, F.softsign, F.tanhshrink,
              F.logsigmoid, torch.erf, torch.sin, torch.cos, torch.reciprocal, T.reciprocal,
              torch.rsqrt, T.rsqrt, torch.sign, T.sign, torch.floor, torch.ceil, torch.round,
              torch.eq, T.eq, torch.ne, T.ne, torch.lt, T.lt, torch.le, T.le, torch.gt, T.gt,
              torch.ge, T.ge, T.__eq__, T.__ne__, T.__lt__, T.__le__, T.__gt__, T.__ge__,
              torch.logical_not, torch.logical_and, torch.logical_or, T.float, T.double, T.long,
              T.int, T.bool, T.to, T.type_as, torch.lerp, torch.addcmul, torch.addcdiv,
              T.__mod__, torch.remainder, torch.fmod, T.__floordiv__, torch.floor_divide,
              torch.nan_to_num, T.masked_fill,
              torch.masked_fill, T.exp, T.log1p, torch.log1p, torch.expm1, T.expm1,
              torch.atan2, torch.hypot, F.threshold, T.sin, T.cos, T.sqrt, T.clamp_min,
              T.clamp_max, torch.clamp_min, torch.clamp_max, T.__and__, T.__or__, T.__invert__):
    if _func is not None:
        _register((_func,), _elementwise(_func))
_register((F.linear, torch._C._nn.linear), _linear)
_PLANNED.update({F.linear: (_linear, (1, 2)), torch._C._nn.linear: (_linear, (1, 2))})
_register((T.__getitem__,), _tensor_getitem)
for _func, _dim_at in ((T.chunk, 1), (torch.chunk, 1), (T.split, 1), (torch.split, 1),
                       (T.unbind, 0), (torch.unbind, 0), (T.split_with_sizes, 1)):
    _register((_func,), _pieces(_func, _dim_at))
    _PLANNED[_func] = (_HANDLERS[_func], ())


def _tensor_of_values(func: Callable):
    """`torch.tensor(data)` (or `as_tensor`, `asarray`) of expressions, such as a list of
    scalar scores: a plain tensor of their values, new and without gradient history, as
    eagerly: a value request. `as_tensor` / `asarray` of an expression alone is the expression,
    as they return a tensor itself."""
    def handler(data, *args, **kwargs):
        leaves = [x for x in pytree.tree_leaves(data) if isinstance(x, Expression)]
        if not leaves:
            return NotImplemented
        if func is not torch.tensor and isinstance(data, Expression) and not args \
                and kwargs.get("dtype") in (None, data.dtype) and not kwargs.get("copy"):
            return data
        values = {id(x): x.value().detach() for x in leaves}
        data = pytree.tree_map(lambda x: values[id(x)] if isinstance(x, Expression) else x, data)
        with torch._C.DisableTorchFunction():
            return func(data, *args, **kwargs)
    return handler


for _func in (torch.tensor, torch.as_tensor, torch.asarray):
    _register((_func,), _tensor_of_values(_func))
_register((F.embedding,), _embedding)
_register((F.layer_norm,), _as_is(F.layer_norm, weights=(2, 3, "weight", "bias")))
_register((F.group_norm,), _group_norm)
_register((F.dropout, torch.dropout), _dropout)
_register((torch.feature_dropout,), _noise_dropout(feature=True, alpha=False))
_register((torch.alpha_dropout,), _noise_dropout(feature=False, alpha=True))
_register((torch.feature_alpha_dropout,), _noise_dropout(feature=True, alpha=True))
for _func in (F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
              F.gumbel_softmax):
    _register((_func,), _own_body(_func))
_register((T.detach, torch.detach), _detach)
for _func in (torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like,
              torch.rand_like, torch.randn_like, torch.randint_like):
    _register((_func,), _made_from(_func, shaped=True))
for _func in (T.new, T.new_zeros, T.new_ones, T.new_empty, T.new_full, T.new_tensor):
    _register((_func,), _made_from(_func, shaped=False))
for _func, _n in ((F.nll_loss, 2), (F.cross_entropy, 2), (F.mse_loss, 2), (F.l1_loss, 2),
                  (F.binary_cross_entropy, 2), (F.binary_cross_entropy_with_logits, 2),
                  (F.smooth_l1_loss, 2), (F.huber_loss, 2)):
    _register((_func,), _loss(_func, _n))
_PLANNED.update({f: (_HANDLERS[f], (), "classes") for f in (F.nll_loss, F.cross_entropy)})
_register((torch.lstm_cell,), _cell(torch.lstm_cell, 2))
_register((torch.gru_cell,), _cell(torch.gru_cell, 1))
_register((torch.rnn_tanh_cell,), _cell(torch.rnn_tanh_cell, 1))
_register((torch.rnn_relu_cell,), _cell(torch.rnn_relu_cell, 1))
_register((F.batch_norm,), _batch_norm)
_register((torch._pack_padded_sequence,), _pack_padded)
_register((torch._pad_packed_sequence,), _pad_packed)
_register((torch.lstm,), _rnn(4))
_register((torch.gru,), _rnn(3))
# (those whose handler is still `_fb_unary`'s: Tensor.exp and Tensor.sqrt run elementwise)
_FB_UNARY.update({f: _unary_handlers[h] for f, h in _HANDLERS.items() if h in _unary_handlers})
