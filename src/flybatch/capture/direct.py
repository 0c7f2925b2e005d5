"""Direct batched calls: the same torch function on the batch (dims shifted past the
batch dim, shared parameters passed once), and the plans that make a known call one C append."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from .. import _core, ops
from ..errors import ShapeError
from ..graph import _INDEX_DTYPES, INDEX_INPUT, PARAMETER, Expression, Graph, Op
from .calls import (_Call, _DataDependent, _Seeded, _Slot, _fill, _key, _meta_outputs, _name,
                    _node, _signature)
from .generic import _batch_operands


# ---- direct batched calls ---------------------------------------------------------------------
class _Bound:
    """A batched kernel with its constants bound. It is part of a signature, so two are equal
    when their function and constants are (a `functools.partial` would compare by identity and
    give every call a signature of its own)."""

    __slots__ = ("fn", "args", "key", "hash")

    def __init__(self, fn: Callable, *args: Any, key: Any = None):
        """`key`: the constants' key when the caller has it (a `_Call.key`), else made here."""
        self.fn, self.args = fn, args
        self.key = (fn, _key(args) if key is None else key)
        self.hash = hash(self.key)

    def __call__(self, batch, *consts):
        return self.fn(*self.args, batch, *consts)

    def __eq__(self, other: Any) -> bool:
        return self is other or isinstance(other, _Bound) and self.key == other.key

    def __hash__(self) -> int:
        return self.hash

    def __repr__(self) -> str:
        return getattr(self.fn, "__name__", "kernel")


def _direct_kernel(xs, attr, shape):
    batched_fn, shared, consts = attr
    _, batch = _batch_operands(xs, shared)
    return batched_fn(batch, *consts)


DIRECT = Op("torch", _direct_kernel)


# What a handler works out from a call's constants and operand shapes, dtypes and parameter
# flags (its output shape from meta tensors, its batched kernel), kept per handler: a call that
# meets a known (handler, constants, operands) only appends its node.
_PLANS: dict[Any, Any] = {}


class _Plan:
    """A handler's node recipe for one (constants, operands) key: the node's op, shape, dtype
    and kernel attr, and its signature, `head` followed by the nodes of the shared operands
    (parameters). A label as the head stands for (label, the plan itself), compared by
    identity: one plan per key, so a signature stays a short tuple. A tuple head batches the
    plan's nodes with any node of that head."""

    __slots__ = ("describe", "fast")

    def __init__(self, head: str | tuple, op: Op, shape: tuple, dtype: torch.dtype, attr: Any,
                 shared_at: tuple[int, ...] = (), describe: str = ""):
        self.describe = describe
        head = head if type(head) is tuple else (head, self)
        # What `_core.take_apart` reads on a hit (csrc/capture.cpp): the node in one C call.
        self.fast = (head, op, tuple(shape), dtype, attr, shared_at)

    @classmethod
    def direct(cls, call: _Call, label: str, fn: Callable, shape: tuple, dtype: torch.dtype,
               shared: tuple[bool, ...], cheap: bool) -> "_Plan":
        """A DIRECT node, `fn(batch operands)`, shared operands (`shared`) passed once."""
        return cls(label, _DIRECT_CHEAP if cheap else DIRECT, shape, dtype, (fn, shared, ()),
                   tuple(i for i, s in enumerate(shared) if s),
                   "".join("[param]" if s else str(o[0]) for s, o in zip(shared, call.operands)))

    def append(self, g: Graph, nodes: tuple) -> Expression:
        """This plan's node over `nodes`, as `take_apart` appends it on a hit."""
        return _core.append_planned(g, self, nodes)

    def __repr__(self) -> str:
        return self.describe


class _Recipe:
    """A plan whose nodes the handler makes itself (several nodes, or none): `take_apart`
    returns it on a hit, and `_record` gives back `recipe.apply(args)`."""

    __slots__ = ()

    def apply(self, args: tuple) -> Any:
        raise NotImplementedError


class _Same(_Recipe):
    """The call returns its first operand itself (`x.view(x.shape)`, `x.contiguous()`)."""

    __slots__ = ()

    def apply(self, args: tuple) -> Any:
        return args[0]


_SAME = _Same()
_core.configure_capture(_Slot, _key, PARAMETER, Graph._operand, _PLANS, _Plan, INDEX_INPUT,
                        _INDEX_DTYPES)


def _plan_of(handler: Callable, call: _Call, build: Callable) -> Any:
    """The plan of `handler` for `call`'s key, made by `build(call)` on first sight and kept:
    a `_Plan`, a `_Recipe`, NotImplemented (the handler declines the key), or a tuple `(label,
    batched_fn, shape, dtype, shared, cheap)` for a direct plan."""
    key = (handler, call.key, call.operands, call.params)
    plan = _PLANS.get(key)
    if plan is None:
        try:
            plan = build(call)
        except _ValueDependentShape:  # (`torch.where(mask)`): the generic path, on the values
            plan = NotImplemented
        if type(plan) is tuple:
            plan = _Plan.direct(call, *plan)
        _PLANS[key] = plan
    return plan


def _record(handler: Callable, args: tuple, kwargs: dict | None, build: Callable,
            weights: tuple = ()) -> Any:
    """What a handler's call gives by its plan for (constants, operands): the node of a
    `_Plan` (when the plan is known, the whole path is one C call), a recipe's result, or
    NotImplemented. An unknown key gets its plan from `build` (see `_plan_of`)."""
    out = _core.take_apart(None, args, kwargs, weights, handler)  # (the graph of the operands)
    if type(out) is tuple:  # no plan yet: the call's parts
        call = _Call(args, kwargs or {}, None, weights, out)
        out = _plan_of(handler, call, build)
        if type(out) is _Plan:
            return out.append(call.graph, call.nodes)
    return out.apply(args) if isinstance(out, _Recipe) else out


def _direct(name: str, call: _Call, batched_fn: Callable, consts: tuple, shape: tuple,
            dtype: torch.dtype, shared: tuple[bool, ...] | None = None,
            cheap=False) -> Expression:
    """A node whose kernel is `batched_fn(batch operands, *consts)`, for calls without a plan;
    consts and operand shapes (shared operands: their nodes) make the signature."""
    shared = call.shared() if shared is None else shared
    key = (name, batched_fn, _key(consts) if consts else (), _signature(call, shared))
    return _node(call.graph, _DIRECT_CHEAP if cheap else DIRECT, call.nodes, shape, key,
                 (batched_fn, shared, consts), dtype)


_DIRECT_CHEAP = Op("torch", _direct_kernel, cheap=True)


def _dim(d: int, ndim: int, op: str) -> int:
    """Per-instance dim `d` (negative counts from the end) as a dim of the batch tensor."""
    if not -max(ndim, 1) <= d < max(ndim, 1):
        raise IndexError(f"{op}: dimension {d} out of range for a per-instance tensor of "
                         f"{ndim} dims")
    return (d % max(ndim, 1)) + 1


class _ValueDependentShape(ShapeError):
    """A handler's function whose output shape depends on the values for these operands: the
    call is declined (`_plan_of`), and runs on the values as a generic one does."""


def _meta_of(func: Callable, call: _Call):
    structure = _meta_outputs(func, call)
    if structure is _DataDependent:
        raise _ValueDependentShape(f"{_name(func)}: output shape depends on values")
    if structure is _Seeded:  # (the functions mapped onto batched kernels draw nothing)
        raise TypeError(f"{_name(func)} draws random numbers: it cannot run as one batched call")
    return structure


def _shifted(func: Callable, dim_arg: int, name: str | None = None, cheap: bool = False,
             reduce_all: Callable | None = None):
    """A handler for a function with a `dim` argument (positional `dim_arg`, or keyword): the
    batch call is the function with that dim shifted past the batch dim."""
    label = name or func.__name__

    def handler(x, *args, **kwargs):
        if len(args) >= dim_arg:
            dim, where = args[dim_arg - 1], dim_arg  # position in the full argument tuple
        else:
            dim, where = kwargs.get("dim"), "dim"
        if dim is None:
            if reduce_all is not None and not args and not kwargs:
                return reduce_all(x)
            return NotImplemented
        if not isinstance(dim, int) or isinstance(dim, bool):
            return NotImplemented  # named dims, lists of dims: generic

        def build(call):
            if call.args[0].__class__ is not _Slot:
                return NotImplemented
            structure = _meta_of(func, call)
            if not isinstance(structure[1], torch.dtype):
                return NotImplemented  # (values, indices): generic
            shifted = _dim(dim, len(call.operands[0][0]), label)
            args, kwargs = call.args, call.kwargs
            if where == "dim":
                kwargs = dict(kwargs, dim=shifted)
            else:
                args = args[:where] + (shifted,) + args[where + 1:]
            fn = _Bound(_apply_template, func, args, kwargs, key=call.key)
            return label, fn, *structure, (False,) * len(call.nodes), cheap

        return _record(handler, (x,) + args, kwargs, build)

    return handler


def _as_is(func: Callable, weights: tuple = (), cheap: bool = False):
    """A function that batches as it is called: leading batch dims pass through it (F.linear,
    F.embedding, F.layer_norm); `weights` name the parameter arguments, passed once."""
    label = func.__name__

    def handler(*args, **kwargs):
        def build(call):
            shared = call.weights_shared()
            if shared is None:
                return NotImplemented
            structure = _meta_of(func, call)
            if not isinstance(structure[1], torch.dtype):
                return NotImplemented
            fn = _Bound(_apply_template, func, call.args, call.kwargs, key=call.key)
            return label, fn, *structure, shared, cheap

        return _record(handler, args, kwargs, build, weights)

    return handler


def _apply_template(func, args, kwargs, batch):
    return func(*_fill(args, batch), **_fill(kwargs, batch))


def _group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    """F.group_norm normalizes groups of the channels, dim 1 of an (N, C, ...) input. On the
    batch, (B, N, C, ...), the kernel folds B into N (as it is, B would be N and N the
    channels)."""
    def build(call):
        shared = call.weights_shared()
        if shared is None:
            return NotImplemented
        shape, dtype = _meta_of(F.group_norm, call)
        fn = _Bound(_apply_template, _folded_group_norm, call.args, call.kwargs, key=call.key)
        return "group_norm", fn, shape, dtype, shared, False

    return _record(_group_norm, (input, num_groups, weight, bias, eps), None, build, (2, 3))


def _folded_group_norm(input, *args):
    return F.group_norm(input.flatten(0, 1), *args).view(input.shape)


def _elementwise(func: Callable, cheap: bool = True):
    """An elementwise function with broadcasting: batch operands aligned, called as is."""
    label = func.__name__

    def handler(*args, **kwargs):
        def build(call):
            structure = _meta_of(func, call)
            if not isinstance(structure[1], torch.dtype):
                return NotImplemented
            shape, dtype = structure
            fn = _Bound(_aligned, func, call.args, call.kwargs, len(shape),
                        key=(call.key, len(shape)))
            return label, fn, shape, dtype, (False,) * len(call.nodes), cheap

        return _record(handler, args, kwargs, build)

    return handler


def _aligned(func, args, kwargs, ndim, batch):
    batch = [ops._align(x, ndim) for x in batch]
    return func(*_fill(args, batch), **_fill(kwargs, batch))
