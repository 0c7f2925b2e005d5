"""How a recorded call is taken apart: its operands and template, its output shape
(from meta tensors), and the facts about operands every stage asks (a plain tensor's current
value, whether gradient flows into an expression)."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _core, ops
from ..graph import Expression, Graph, Op, current_graph


Template = Any  # the call's arguments with each tensor operand replaced by a `_Slot`


# `torch_call(func, args, kwargs)` records `func(*args, **kwargs)`, a call that involves the
# graph, as nodes. Its head is in C (`_core.torch_call`, capture.cpp; every recorded call goes
# through it): `_stacklevel` (nn.LogSoftmax's warning depth, not part of the computation)
# dropped, `inplace=True` on an expression refused (`_refuse_inplace`), then the function's
# handler in `_HANDLERS`; a call without one, or whose handler returns NotImplemented, goes on
# in `_unhandled`.
torch_call = _core.torch_call


T = torch.Tensor


def _name(func: Callable) -> str:
    name = getattr(func, "__name__", repr(func))
    module = getattr(func, "__module__", None) or ""
    if module.startswith("torch.nn.functional"):
        return f"F.{name}"
    qual = getattr(func, "__qualname__", "")
    if qual.startswith("TensorBase.") or qual.startswith("Tensor."):
        return f"Tensor.{name}"
    return f"torch.{name}"


# ---- operands and templates --------------------------------------------------------------------
class _Slot:
    """Where operand `index` goes in a call template."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"#{self.index}"


class _Call:
    """A call taken apart in one pass: its graph, the operand nodes (with their shapes, dtypes
    and whether they are parameters), the template they fill and `key`, a hashable form of
    the call's constants and structure (with the function and the operand shapes, it decides
    the output shape; with the operands' signature parts, the call's signature)."""

    __slots__ = ("graph", "nodes", "operands", "params", "weight", "args", "kwargs", "key")

    def __init__(self, args: tuple, kwargs: dict, graph: Graph | None = None,
                 weights: tuple = (), parts: tuple | None = None):
        """`weights`: the positions (ints) and keywords (strs) of the arguments that are
        parameters shared by the batch (F.linear's weight); every other operand is batched.
        The pass itself is the compiled core's (csrc/capture.cpp); `parts` is its result when
        the caller has it already."""
        self.graph = graph or _graph_of(args, kwargs)
        if parts is None:
            parts = _core.take_apart(self.graph, args, kwargs, weights)
        (self.args, self.kwargs, self.nodes, self.operands, self.params, self.weight,
         self.key) = parts

    def weights_shared(self) -> tuple[bool, ...] | None:
        """Per operand, shared (a weight argument that is a parameter); None if some weight
        argument is not a parameter (a per-instance weight: the generic path batches it)."""
        if any(w and not p for w, p in zip(self.weight, self.params)):
            return None
        return tuple(self.weight)

    def shapes(self) -> tuple:
        return self.operands  # (shape, dtype) per operand, a tuple from the core

    def shared(self) -> tuple[bool, ...]:
        """Which operands are one node for every instance (parameters): passed to a kernel
        once, and named by node in the signature so that a batch shares them."""
        return self.params


def _graph_of(args: tuple, kwargs: dict) -> Graph:
    if args and type(args[0]) is Expression:  # the common case, first
        return args[0].graph
    for group in (args, kwargs.values()):
        for x in group:
            if isinstance(x, Expression):
                return x.graph
            if type(x) in (list, tuple):
                for y in x:
                    if isinstance(y, Expression):
                        return y.graph
    return current_graph()


def _fill(template: Template, xs) -> Any:
    if isinstance(template, _Slot):
        return xs[template.index]
    if type(template) in (list, tuple):
        return type(template)(_fill(t, xs) for t in template)
    if type(template) is dict:  # the kwargs of a call (nn.LayerNorm passes weight=, bias=)
        return {k: _fill(v, xs) for k, v in template.items()}
    return template


def _key(template: Template) -> Any:
    """A hashable form of a template's constants: Python 3.11 slices are not hashable; a float
    is keyed by its repr (0.0 and -0.0, or NaNs, told apart) and a bool by its type (True is
    not dim 1). Dispatch on the exact type first: this runs for every recorded call."""
    kind = type(template)
    if kind is int or kind is str or template is None:
        return template
    if kind is _Slot:
        return "#"
    if kind is tuple or kind is list:
        return (kind.__name__,) + tuple([_key(t) for t in template])
    if kind is float:
        return ("float", repr(template))
    if kind is bool:
        return ("bool", template)
    if kind is slice:
        return ("slice", _key(template.start), _key(template.stop), _key(template.step))
    if kind is dict:
        return tuple([(k, _key(v)) for k, v in template.items()])
    if isinstance(template, (torch.dtype, torch.device, torch.layout, torch.memory_format,
                             type(Ellipsis), int, str)):
        return template
    try:
        hash(template)
        return (kind.__name__, template)
    except TypeError:
        raise TypeError(f"cannot record a call with the argument {template!r} "
                        f"({kind.__name__}) on a flybatch expression") from None


# ---- output shapes, from meta tensors ---------------------------------------------------------
_META: dict[Any, Any] = {}  # (function, constants, operand shapes/dtypes) -> output structure


class _DataDependent(Exception):
    """The function's output shape (or type) depends on values: run it on the values."""


class _Seeded:
    """The function draws random numbers (`torch.bernoulli`, `torch.normal`, `F.rrelu`, a
    distribution's `sample()`...): it runs on the values, at the call, so that it takes the
    random stream in program order as eagerly. Batched, the draws would follow the batches'
    order and change with the strategy. (`F.dropout`, whose mask needs no values, is an op
    that draws its mask when it is written: `ops.dropout`.)"""


class _SeenSeededOps(TorchDispatchMode):
    """Notes whether any operator run under it draws from a random generator (aten's
    `nondeterministic_seeded` tag): on meta tensors, nothing is drawn."""

    def __init__(self):
        super().__init__()
        self.seeded = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.seeded = True
        return func(*args, **(kwargs or {}))


def _meta_outputs(func: Callable, call: _Call) -> Any:
    """The structure of `func`'s output for these operands: a (shape, dtype) per tensor, or
    `_DataDependent`, or `_Seeded`."""
    key = (func, call.key, call.shapes())
    out = _META.get(key)
    if out is None:
        metas = [torch.empty(s, dtype=d, device="meta") for s, d in call.shapes()]
        seeded = _SeenSeededOps()
        try:
            with torch._C.DisableTorchFunction(), warnings.catch_warnings(), seeded:
                warnings.simplefilter("ignore")
                result = func(*_fill(call.args, metas), **_fill(call.kwargs, metas))
            if seeded.seeded:
                result = _Seeded
        except (NotImplementedError, RuntimeError, TypeError, ValueError, IndexError) as error:
            text = str(error)
            if "data-dependent" in text or "meta" in text.lower() or "item()" in text \
                    or "Cannot copy out of meta" in text:
                result = _DataDependent
            else:
                raise type(error)(f"{_name(func)} on flybatch expressions of per-instance "
                                  f"shapes {[s for s, _ in call.shapes()]}: {error}") from error
        out = _structure(result)
        _META[key] = out
    return out


def _structure(result: Any) -> Any:
    if result is _DataDependent or result is _Seeded:
        return result
    if isinstance(result, torch.Tensor):
        return (tuple(result.shape), result.dtype)
    # (a None among tensors: an output not asked for, as MultiheadAttention's weights with
    # need_weights=False)
    if isinstance(result, (list, tuple)) and any(isinstance(r, torch.Tensor) for r in result) \
            and all(isinstance(r, torch.Tensor) or r is None for r in result):
        return [None if r is None else (tuple(r.shape), r.dtype) for r in result], type(result)
    return _DataDependent  # a Python value (a bool, a list of numbers): computed from values


def _wrap(g: Graph, structure: Any, make: Callable[[int, tuple, torch.dtype], Expression]) -> Any:
    """The expressions of an output structure, `make(k, shape, dtype)` giving output k."""
    if isinstance(structure[0], tuple) and isinstance(structure[1], torch.dtype):
        return make(0, *structure)
    outs, kind = structure
    # list, tuple, torch.return_types.* (values, indices) and other struct sequences
    return kind([None if out is None else make(k, *out) for k, out in enumerate(outs)])


def _node(g: Graph, op: Op, nodes, shape: tuple, key: tuple, attr: Any,
          dtype: torch.dtype) -> Expression:
    out = g.add(op, tuple(nodes), tuple(shape), key, attr)
    if dtype != g.dtype:
        g.set_node_dtype(out.id, dtype)
    return out


def _signature(call: _Call, shared: tuple[bool, ...]) -> tuple:
    """Operand part of a signature: each operand's shape and dtype; a shared one's node."""
    return tuple(("P", n) if s else operand
                 for n, s, operand in zip(call.nodes, shared, call.operands))


def _current_value(g: Graph, tensor: torch.Tensor) -> Any:
    new = g.shadow_of(tensor)
    return tensor if new is None else new


def _requires_grad(self) -> bool:
    """Whether gradient flows into this node: it depends on a parameter (or an input with
    gradient) through nodes written with grad enabled."""
    g = self.graph
    memo = g.__dict__.setdefault("_requires_grad", {})
    stack = [self.id]
    while stack:
        node = stack[-1]
        if node in memo:
            stack.pop()
            continue
        if g.is_no_grad(node):
            memo[node] = False
            stack.pop()
            continue
        op = g.op_of(node)
        if op.leaf or op is ops.LOOKUP:  # a lookup has no inputs: its table decides
            attr = g.attr_of(node)
            if op is ops.LOOKUP:
                attr = attr[0]
            memo[node] = bool(op.name == "parameter" or
                              isinstance(attr, torch.Tensor) and attr.requires_grad)
            stack.pop()
            continue
        pending = [a for a in g.args_of(node) if a not in memo]
        if pending:
            stack.extend(pending)
            continue
        memo[node] = any(memo[a] for a in g.args_of(node))
        stack.pop()
    return memo[self.id]
