"""Torch-native capture: a user's own per-instance PyTorch code, recorded as graph nodes.

Inside `with fb.Graph():` (and in the instances of `fb.map_batched`) a `TorchFunctionMode` sees
every torch call. A call that involves an expression, or, with grad enabled, a tensor that
requires grad (a parameter), becomes a node of the graph; any other call runs eagerly (index
tensors, `torch.zeros(1, H)` for an initial state) and its result is a constant to later calls.
Expressions also carry `__torch_function__`, so torch calls on them are recorded outside `with`
blocks too, and they have the Tensor methods and properties per-instance code uses
(`x.view(1, -1)`, `x.size(0)`, `x.topk(1)`, `x[0, -1]`...), with torch's semantics on the
per-instance shape.

How a call is batched, fastest first:
1. a mapping onto a flybatch op (`tanh`, `+`, `@`, `torch.cat`, `F.dropout`...), one C call;
2. a *direct* batched call: the same torch function on the batch, with the per-instance dims
   shifted past the batch dim (`softmax(x, dim=1)` runs as `softmax(xs, dim=2)`), shared
   parameters passed once (`F.linear`, `F.embedding`, `F.layer_norm`, the RNN cells), or an
   elementwise function on batch tensors aligned for broadcasting;
3. any other function: a *generic* node, its output shape found by running it once on meta
   tensors (cached per signature), its batched kernel `torch.vmap` over the batch (a loop over
   the batch's nodes where vmap has no rule).
A function whose output shape depends on values (`nonzero`, a boolean mask), that returns a
Python value (`tolist`, `equal`) or that draws random numbers (`bernoulli`, `normal`, found by
the meta run: aten's `nondeterministic_seeded` operators) runs on the values, which asks for a
forward (a round of `map_batched`); its result keeps its autograd history, so gradients stay
right, and draws take the random stream in program order, as eagerly.

The signature of a recorded call is (function, the constants of the call, each operand's shape
and dtype, and the node of each shared parameter), so calls batch exactly when one kernel can
compute them all. An augmented assignment to an expression (`h += x`) points its handle at the
new value (`_write_into_expression`); other in-place operations on expressions raise; in-place
writes of expressions into a plain tensor (`outputs[i] = h`) are recorded out of place and the
tensor stands for its new value in the calls that follow (`Graph.shadows`).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import operator
import threading
import warnings
import types
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.distributions import Distribution
from torch.optim import optimizer as _optimizer
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from . import _core, kernels, ops, packed_rnn
from .errors import ShapeError
from .graph import (_INDEX_DTYPES, INDEX_INPUT, PARAMETER, Expression, Graph, Op, _current,
                    _no_capture, current_graph, live_graphs)

Template = Any  # the call's arguments with each tensor operand replaced by a `_Slot`


# ---- switching capture on and off --------------------------------------------------------------
class _Capture(TorchFunctionMode):
    """Records the torch calls that involve the graph; runs every other call as it is.

    Its `__torch_function__` (every torch call in a graph block goes through it) is in C,
    `_core` capture.cpp, installed below: whether a call involves the graph (an expression among
    its operands, a shadowed tensor, written with an expression, or a parameter, under
    `torch.no_grad()` too so that an evaluation batches, but not inside an optimizer's step,
    whose updates are the parameters' own), by the rules of `_DESCRIBE`, `_REBINDS`... below.
    A recorded call goes to `torch_call`, any other runs as `func(*args, **kwargs)`."""


_thread = threading.local()  # torch's mode stack is per thread: so is the depth of `push`


def push() -> None:
    """Capture on (nested pushes share one mode; `Graph.__enter__`, `map_batched`)."""
    depth = getattr(_thread, "depth", 0)
    _thread.optimizer_step = False
    if depth == 0:
        mode = getattr(_thread, "mode", None)
        if mode is None:  # one per thread, kept: a fresh mode per graph leaked ~35 B each
            mode = _thread.mode = _Capture()
        torch.overrides._push_mode(mode)
        # torch.distributions' argument checks, on by default, read values (`valid.all()`: a
        # forward per distribution made) and refuse an expression as a `log_prob` sample (it is
        # no torch.Tensor): off by default inside a graph, as `set_default_validate_args(False)`
        # turns them off (a distribution made with `validate_args=True` still checks).
        _thread.validate_args = Distribution._validate_args
        Distribution.set_default_validate_args(False)
    _thread.depth = depth + 1


def pop() -> None:
    _thread.depth -= 1
    if _thread.depth == 0:
        torch.overrides._pop_mode()
        Distribution.set_default_validate_args(_thread.validate_args)


# Tensor attributes and methods that describe a plain tensor: always run as they are (and
# attribute writes, `__set__`: `W.data = ...`, `p.grad = None` rebind, they compute nothing).
_DESCRIBE = frozenset("""size dim ndimension numel nelement element_size stride storage_offset
    is_contiguous is_floating_point is_complex is_signed data_ptr untyped_storage __len__ __repr__
    __format__ __hash__ __bool__ __int__ __float__ __index__ item tolist numpy __reduce_ex__
    __deepcopy__ requires_grad_ retain_grad register_hook backward __setstate__ __getstate__
    get_device __dlpack__ __array__ is_set_to __contains__ __iter__ __set__ detach to cpu cuda
    type float double half bfloat16 pin_memory share_memory_ __reduce__""".split())
# (detach / to / cpu... of a parameter itself: `state_dict()`, `model.to(...)`, checkpointing
# inside a graph block work on the tensors, as they must; on an expression they are recorded.)
# Those of them that read a tensor's values are recorded on a plain tensor the graph has
# written into (`h[0] = x`, Graph.shadows): its storage does not hold what it now stands for.
# (So do the properties that the write changed: `data`, and whether it now requires grad.)
_SHADOWED_PROPERTIES = frozenset({"data", "requires_grad", "is_leaf"})
_READS_VALUE = frozenset("""__repr__ __format__ __bool__ __int__ __float__ __index__ item tolist
    numpy __reduce_ex__ __deepcopy__ __getstate__ __dlpack__ __array__ __contains__ __iter__
    detach to cpu cuda type float double half bfloat16 pin_memory __reduce__""".split()
                         ) | _SHADOWED_PROPERTIES
assert _READS_VALUE - _SHADOWED_PROPERTIES <= _DESCRIBE
_RECORDED_PROPERTIES = frozenset({"T", "mT", "H", "mH"})  # properties that compute a tensor
# Calls that rebind what the graph's rules remember of a tensor without asking it again
# (whether it is a parameter, an embedding table's size; `Store.forget`). They run as they are.
_REBINDS = frozenset({"requires_grad_", "detach_", "set_", "resize_", "resize_as_"})
_REBOUND_ATTRIBUTES = frozenset({"requires_grad", "data"})  # `p.requires_grad = False`, `.data =`


def _forget(tensor) -> None:
    if isinstance(tensor, torch.Tensor):
        _before_write(tensor)  # what pending nodes read of it is what it holds before
        for graph in list(live_graphs):  # rare: a handful of graphs at most are alive
            if not graph.closed:
                graph.forget(tensor)


def _before_write(target) -> Callable[[], None] | None:
    """Before `target` (a tensor, or a list of them: `torch._foreach_add_`) is written in place
    or rebound (`W.data.copy_(...)`, `W.add_(...)` under no_grad, an optimizer's step, `W.data
    = ...`): parameters and embedding tables are read when a forward runs, so the pending nodes
    of a graph that reads its storage run first, and see what they would have seen eagerly.
    A forward that fails leaves its nodes pending (it raises again at their value request,
    unless this write is the fix: `W.data = W.data.float()`). Returns what to call after an
    in-place write, when a graph holds rows taken as views of the tensor (`Graph.row_views`);
    a rebinding calls nothing after: eager views keep the storage they were taken of."""
    # (through the WeakSet's own set of references: iterating the WeakSet costs ~4 us)
    graphs = [ref() for ref in live_graphs.data]
    graphs = [g for g in graphs if g is not None and not g.closed]
    pending = [g for g in graphs if g.n_done < g.n_nodes]
    viewing = [g for g in graphs if g.row_views]
    if not pending and not viewing:
        return None
    tensors = target if isinstance(target, (list, tuple)) else (target,)
    with torch._C.DisableTorchFunction():
        storages = {t.untyped_storage().data_ptr() for t in tensors
                    if isinstance(t, torch.Tensor) and not t.is_meta}
    storages.discard(0)  # no storage of its own (empty)
    for graph in pending:
        if storages and graph.reads_later(storages):
            with contextlib.suppress(Exception):
                graph.forward()
    viewing = [g for g in viewing if not storages.isdisjoint(g.row_views)]
    if not viewing:
        return None

    def after_write() -> None:
        for graph in viewing:
            if not graph.closed:
                graph.refresh_row_views(storages)
    return after_write


# An optimizer's step inside a graph block updates the parameters themselves: capture stays out
# of it (global step hooks of torch.optim; a step that raised is forgotten at the next push).
def _step_begins(optimizer, args, kwargs) -> None:
    _thread.optimizer_step = True


def _step_ends(optimizer, args, kwargs) -> None:
    _thread.optimizer_step = False


_optimizer.register_optimizer_step_pre_hook(_step_begins)
_optimizer.register_optimizer_step_post_hook(_step_ends)


# A module's backward hooks (`register_full_backward_hook`, `..._pre_hook`, the old
# `register_backward_hook`) would be given one instance's gradients, which a graph computes
# batched: torch would drop them with a warning (or fail inside its hook set-up), so a call of
# such a module inside a graph block is refused, naming it.
def _outside_graphs(get_hooks: Callable) -> Callable:
    """`nn.Module._get_backward_hooks` (or `_pre_hooks`), which a module call asks only when it
    has such hooks, refused inside a graph block."""
    def get(module: torch.nn.Module):
        graph = _current.get()
        if getattr(_thread, "depth", 0) and graph is not None and not graph.closed:
            raise TypeError(f"{type(module).__name__} has backward hooks, which cannot be given "
                            "one instance's gradients inside a graph block (they are computed "
                            "batched); remove them there, or read .grad after backward")
        return get_hooks(module)
    return get


torch.nn.Module._get_backward_hooks = _outside_graphs(torch.nn.Module._get_backward_hooks)
torch.nn.Module._get_backward_pre_hooks = _outside_graphs(torch.nn.Module._get_backward_pre_hooks)


# A module's buffer assigned an expression (`self.running = 0.9 * self.running + 0.1 * y`,
# torch accepts any object with __torch_function__ as a buffer): the buffer becomes a new plain
# tensor that stands for the expression (Graph.shadows), as eagerly it becomes the new tensor,
# and holds its value once the graph closes, instead of an expression that outlives its graph.
_register_buffer = torch.nn.Module.register_buffer


def _register_buffer_of(module: torch.nn.Module, name: str, tensor: Any,
                        persistent: bool = True) -> None:
    if isinstance(tensor, Expression):
        g = tensor.graph
        g.node_of(tensor)  # (a closed graph's expression raises here)
        with torch._C.DisableTorchFunction():
            placeholder = torch.empty(tensor.shape, dtype=tensor.dtype,
                                      device=g.device or torch.device("cpu"))
        g.shadow(placeholder, tensor)
        tensor = placeholder
    return _register_buffer(module, name, tensor, persistent)


torch.nn.Module.register_buffer = _register_buffer_of


# A custom `torch.autograd.Function` (a gradient reversal layer, a straight-through estimator)
# applied to expressions: torch calls its `forward` directly, which would record the ops inside
# it as ordinary nodes (under the no_grad that apply runs forward in) and drop its own backward.
# So `Function.apply` with an expression among its arguments becomes a generic node whose
# kernel applies the Function to the batch's real tensors (one apply per node where vmap has no
# rule for it): autograd then runs the Function's own backward, as eagerly.
_function_apply = torch.autograd.Function.apply.__func__


class _Applied:
    """`cls.apply` of a custom autograd.Function, as the function of a generic node (equal for
    one class, so that its applications batch)."""

    def __init__(self, cls: type):
        self.cls = cls
        self.__name__ = self.__qualname__ = f"{cls.__name__}.apply"

    def __call__(self, *args, **kwargs):
        return _function_apply(self.cls, *args, **kwargs)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Applied) and other.cls is self.cls

    def __hash__(self) -> int:
        return hash(self.cls)


def _apply(cls, *args, **kwargs):
    given = args + tuple(kwargs.values())
    if not any(isinstance(a, Expression) or isinstance(a, (list, tuple)) and
               any(isinstance(b, Expression) for b in a) for a in given):
        return _function_apply(cls, *args, **kwargs)
    if cls is torch.utils.checkpoint.CheckpointFunction:  # (use_reentrant=True)
        run, _, *inputs = args  # the function itself: recomputing is only a memory trade
        return run(*inputs)
    return _generic(_Applied(cls), args, kwargs)


torch.autograd.Function.apply = classmethod(_apply)


# `torch_call(func, args, kwargs)` records `func(*args, **kwargs)`, a call that involves the
# graph, as nodes. Its head is in C (`_core.torch_call`, capture.cpp; every recorded call goes
# through it): `_stacklevel` (nn.LogSoftmax's warning depth, not part of the computation)
# dropped, `inplace=True` on an expression refused (`_refuse_inplace`), then the function's
# handler in `_HANDLERS`; a call without one, or whose handler returns NotImplemented, goes on
# in `_unhandled`.
torch_call = _core.torch_call


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
        g.node_dtypes[out.id] = dtype
    return out


def _signature(call: _Call, shared: tuple[bool, ...]) -> tuple:
    """Operand part of a signature: each operand's shape and dtype; a shared one's node."""
    return tuple(("P", n) if s else operand
                 for n, s, operand in zip(call.nodes, shared, call.operands))


# ---- generic nodes: vmap over the batch -------------------------------------------------------
def _batch_operands(xs, shared):
    """The batch tensors of a kernel: shared operands as one instance's tensor, the others
    expanded to the batch size (a `[1, ...]` read stands for every node of the batch)."""
    size = max((x.shape[0] for x, s in zip(xs, shared) if not s), default=1)
    return size, [_parameter(x) if s else x if x.shape[0] == size else
                  x.expand(size, *x.shape[1:]) for x, s in zip(xs, shared)]


def _parameter(x: torch.Tensor) -> torch.Tensor:
    """A shared operand: the parameter itself where the batch holds a view of it (`[1, ...]`),
    since a sparse gradient (F.embedding(sparse=True)) cannot flow back through a view."""
    base = x._base
    return base if base is not None and base.shape == x.shape[1:] else x[0]


# Products a generic node may run (F.linear with a per-instance weight, e.g. a slice of a
# parameter): `kernels.flops` counts them as the direct kernels count theirs.
_PRODUCTS = (F.linear, torch.matmul, torch.mm, torch.bmm)


def _generic_kernel(xs, attr, shape):
    func, args, kwargs, shared, out_index = attr
    size, batch = _batch_operands(xs, shared)

    def one(*ts):
        out = func(*_fill(args, ts), **_fill(kwargs, ts))
        return out if out_index is None else out[out_index]

    in_dims = tuple(None if s else 0 for s in shared)
    out = None
    if all(s for s in shared):
        out = one(*batch).unsqueeze(0)
    else:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # vmap's "falling back to a slow loop" warnings
                out = torch.vmap(one, in_dims=in_dims, randomness="different")(*batch)
        except Exception:  # no batching rule
            pass
    # A batching rule may also be wrong: torch 2.13's index_select with a 0-d index gives the
    # whole row per instance. An output of another shape than the call's own (from meta
    # tensors) is not trusted.
    if out is None or tuple(out.shape[1:]) != tuple(shape):  # one call per node
        out = torch.stack([one(*[t if s else t[i] for t, s in zip(batch, shared)])
                           for i in range(size)])
    if func in _PRODUCTS and len(args) >= 2:  # each output a dot over the first's last axis
        a, b = _fill(args[:2], batch)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            kernels.flops.add(out.numel(), a.shape[-1], a, b)
    return out


GENERIC = Op("torch", _generic_kernel)


def _generic(func: Callable, args: tuple, kwargs: dict) -> Any:
    call = _Call(args, kwargs)
    structure = _meta_outputs(func, call)
    if structure is _DataDependent or structure is _Seeded:
        return _on_values(func, call, random=structure is _Seeded)
    if func in _INDEXING or (func in _SAME_DTYPES and len({d for _, d in call.shapes()}) > 1):
        _check_on_zeros(func, call, args, kwargs)
    shared = call.shared()
    base = (_name(func), func, call.key, _signature(call, shared))
    single = not isinstance(structure[1], type)

    def make(k, shape, dtype):
        index = None if single else k
        return _node(call.graph, GENERIC, call.nodes, shape, base + (index,),
                     (func, call.args, call.kwargs, shared, index), dtype)

    return _wrap(call.graph, structure, make)


# What meta tensors (which give a generic node its output shape) do not check, and the kernel
# would only report at the next forward: checked at the call, as eagerly, by `_check_on_zeros`.
# Functions whose indices, given as a plain tensor, must be in range for the shape; products
# whose operands must be of one dtype.
_INDEXING = frozenset(f for name in ("gather", "index_select", "take", "take_along_dim", "scatter",
                                     "scatter_add", "scatter_reduce", "index_add", "index_copy",
                                     "index_fill", "index_put", "__getitem__")
                      for f in (getattr(torch, name, None), getattr(torch.Tensor, name, None))
                      if f is not None)
_SAME_DTYPES = frozenset(f for name in ("matmul", "mm", "bmm", "mv", "dot", "inner", "addmm",
                                        "baddbmm", "einsum", "tensordot", "chain_matmul")
                         for f in (getattr(torch, name, None), getattr(torch.Tensor, name, None))
                         if f is not None)


def _check_on_zeros(func: Callable, call: _Call, args: tuple, kwargs: dict) -> None:
    """Runs `func` once with zeros standing for the expressions (their values cannot matter to
    these checks) and the plain tensors as they are: torch's own checks, at the call."""
    if func in _INDEXING and not any(isinstance(x, torch.Tensor) and not x.is_floating_point()
                                     for x in pytree.tree_leaves((args, kwargs))):
        return  # an index computed per instance: only the kernel can see it
    g = call.graph

    def stand_in(x):
        if not isinstance(x, Expression):
            return x
        return torch.zeros(x.shape, dtype=g.dtype_of(x.id), device=g.device)

    with torch._C.DisableTorchFunction(), torch.no_grad():
        zeros = pytree.tree_map(stand_in, (args, kwargs))
        try:
            func(*zeros[0], **zeros[1])
        except (IndexError, RuntimeError) as error:
            raise type(error)(f"{_name(func)} on flybatch expressions of per-instance shapes "
                              f"{[s for s, _ in call.shapes()]}: {error}") from error


_warned: set = set()


def _on_values(func: Callable, call: _Call, random: bool = False) -> Any:
    """Run `func` on the operands' values (a forward, or a round of map_batched): for output
    shapes that depend on values, Python results and random draws. The result keeps its
    autograd history."""
    # (a value read such as `.tolist()` of a tensor the graph wrote into asks for values)
    if func not in _warned and getattr(func, "__name__", "") not in _READS_VALUE:
        _warned.add(func)
        why = "draws random numbers, in program order as eagerly" if random else \
            "depends on their values"
        warnings.warn(f"{_name(func)} on flybatch expressions {why}: it runs on the values (a "
                      "forward per call, not batched)", stacklevel=4)
    g = call.graph
    values = [g.value_of(n) for n in call.nodes]
    with torch._C.DisableTorchFunction():
        return func(*_fill(call.args, values), **_fill(call.kwargs, values))


def _batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,
                momentum=0.1, eps=1e-5):
    """F.batch_norm in training mode with running statistics (an nn.BatchNorm in `.train()`):
    the instance's own batch statistics normalize it (a node), and the running statistics take
    their update, instance after instance as eagerly, as expressions written into the buffers
    (`Graph.shadows`: read by later calls, copied into the buffers when the graph closes). A
    kernel would update copies of the buffers, made when the call was recorded."""
    if not training or running_mean is None or running_var is None:
        return NotImplemented
    out = torch_call(F.batch_norm, (input, None, None, weight, bias, True, momentum, eps), {})
    g = out.graph
    dims = [d for d in range(len(out.shape)) if d != 1]
    with torch.no_grad():  # running statistics carry no gradient
        mean = torch_call(T.mean, (input, dims), {})
        var = torch_call(T.var, (input, dims), {})  # unbiased, as torch's running variance
        for buffer, batch_value in ((running_mean, mean), (running_var, var)):
            new = _current_value(g, buffer) * (1 - momentum) + batch_value * momentum
            g.shadow(buffer, new)
    return out


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


# ---- in-place operations -----------------------------------------------------------------------
_INPLACE_DUNDERS = {"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and",
                    "or", "xor", "lshift", "rshift"}


def _inplace(func: Callable, name: str, args: tuple, kwargs: dict) -> Any:
    """An in-place operation: on an expression, an augmented assignment rebinds it and any
    other write is an error (it has no storage); recorded out of place for a plain tensor
    written with expressions, which then stands for its new value."""
    target = args[0]
    parameter = _parameter_written(target)
    if parameter is not None:
        return _write_into_parameter(func, parameter, args[1:], kwargs)
    if isinstance(target, Expression) and name.startswith("__i"):
        return _write_into_expression(func, name, target, args[1])
    if isinstance(target, Expression) and name == "requires_grad_":
        wanted = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
        if not wanted and not target.requires_grad:
            return target
        raise TypeError(f"{_name(func)}({wanted}) on a flybatch expression of shape "
                        f"{tuple(target.shape)}: an expression cannot be made a leaf of its own "
                        "(gradients are computed batched, into parameters and input tensors); "
                        "make the tensor that requires grad before passing it in")
    if isinstance(target, Expression):
        raise TypeError(f"{_name(func)} writes in place into a flybatch expression, which has no "
                        "storage; use the out-of-place form (e.g. `x = x.clamp(0, 1)` for "
                        "`x.clamp_(0, 1)`; augmented assignments such as `x += y` work)")
    with torch._C.DisableTorchFunction():
        view = target._base is not None
    if view:  # the write would have to reach the tensor it views, and every other view of it
        raise TypeError(f"{_name(func)} writes an expression in place into a view of a tensor "
                        f"(shape {tuple(target.shape)}); write into the tensor itself through "
                        f"indexing (`out[t] = h`, `out[t] = out[t] + h`)")
    g = _graph_of(args, kwargs)
    current = _current_value(g, target)
    if name == "__setitem__":
        new = _setitem(g, target, args[1], args[2])
    elif name in _OVERWRITES:  # the new value is the source, as the tensor's shape and dtype
        new = torch_call(T.add, (torch_call(torch.zeros_like, (current,), {}),
                                 _OVERWRITES[name](*args[1:], **kwargs)), {})
        new = _as_written_into(func, target, new, cast=True)
    else:
        plain = name[:-1] if name.endswith("_") else "__" + name[3:]
        out_of_place = getattr(torch.Tensor, plain, None)
        if out_of_place is None:
            raise TypeError(f"{_name(func)} on a flybatch expression: no out-of-place form")
        new = torch_call(out_of_place, (current,) + tuple(args[1:]), kwargs)
        new = _as_written_into(func, target, new)
    g.shadow(target, new)
    return target


def _parameter_written(target: Any) -> torch.Tensor | None:
    """The tensor an in-place write into `target` reaches when a forward reads it, not a copy
    made at the call: a parameter (a leaf that requires grad), an embedding table the graph
    reads, or a constant part of a parameter taken as an expression (`W[0]`, `W[:, 1]`)."""
    if isinstance(target, Expression):
        g, node = target.graph, target.id
        op = None if g.closed else g.op_of(node)
        if op is PARAMETER:
            with _no_capture():
                return g.parameter_value(node)
        if op is ops.LOOKUP:  # a row indexed out of a table (`W[0]`), not an F.embedding
            table = g.attr_of(node)[0]
            with _no_capture():
                rows = g.row_views.get(table.untyped_storage().data_ptr(), ())
                return next((table[row] for viewer, _, row in rows if viewer == node), None)
        return None
    if not isinstance(target, torch.Tensor):
        return None
    with _no_capture():
        if target.is_leaf and target.requires_grad:
            return target
        storage = target.untyped_storage().data_ptr()
    graph = _current.get()
    return target if graph is not None and not graph.closed and storage and \
        graph.reads_later({storage}) else None


def _write_into_parameter(func: Callable, parameter: torch.Tensor, args: tuple,
                          kwargs: dict) -> Any:
    """An in-place write with expressions among its operands into what a forward reads
    (`_parameter_written`): a max-norm constraint `W.div_(W.norm(dim=1, keepdim=True))`, a
    target network's moving average `p_t.mul_(m).add_((1 - m) * p)`, `W[0].fill_(0)` under
    torch.no_grad(). It is made on the tensor itself with the operands' values (a forward),
    as eagerly: the nodes recorded before it see the old values (`_before_write`), those
    after it the new ones. (Recorded out of place, the later reads of the tensor would read
    its old storage.)"""
    def value(x):
        return x.graph.value_of(x.graph.node_of(x)) if isinstance(x, Expression) else x

    args, kwargs = pytree.tree_map(value, (args, kwargs))
    after_write = _before_write(parameter)
    with _no_capture():
        result = func(parameter, *args, **kwargs)
    if after_write is not None:
        after_write()
    return result


def _write_into_expression(func: Callable, name: str, target: Expression, other: Any) -> Any:
    """`h += x` (and `-=`, `*=`, ...) on an expression: its handle is pointed at the new value,
    so every reference to it (`a = h`, a list holding h) sees the write, as eagerly. What
    eagerly shares h's storage through views (`h[0]`, `h.view(...)`, `h.detach()`, or the
    tensor h views) keeps the old value here: a read of it after the write raises, checked
    before the next forward (`Graph._refuse_stale_reads`, `sharing_storage` below)."""
    g, old, begin = target.graph, target.id, target.graph.n_nodes
    # (through the operator itself: a scalar `loss += l` stays one esum of every term)
    new = _OUT_OF_PLACE[name](target, other)
    if not isinstance(new, Expression) or new.graph is not g:
        raise TypeError(f"{_name(func)}: the value written into an expression of shape "
                        f"{tuple(target.shape)} is not of its graph")
    dtypes = g.node_dtypes  # (those of nodes not of the graph's dtype: the same is common)
    if new.shape != target.shape or dtypes.get(new.id) is not dtypes.get(old):
        new = _as_written_into(func, target, new)
    if not torch.is_grad_enabled() and _requires_grad(target):
        # Eagerly a write under no_grad changes the values, not the autograd history: the
        # gradient still reaches what the expression was computed from, as through identity.
        change = new - target
        with torch.enable_grad():
            new = target + change
    _core.rebind(target, new)
    g.writes.append((old, begin, new.id, func))
    return target


# `__iadd__` -> operator.add, ...: the out-of-place operators of the augmented assignments
_OUT_OF_PLACE = {f"__i{op.rstrip('_')}__": getattr(operator, op) for op in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and_", "or_", "xor")}

# Functions whose result is, eagerly, a view of their first operand (writing one writes the
# other), by name: torch's own, and the batched kernels that the capture records them as.
_VIEW_FUNCTIONS = frozenset("""view view_as reshape reshape_as squeeze unsqueeze flatten
    unflatten ravel t transpose swapaxes swapdims permute movedim moveaxis expand expand_as select
    narrow chunk split split_with_sizes tensor_split unbind diagonal as_strided detach
    __getitem__ unfold real imag alias contiguous _getitem_batched _transpose_batched _detached
    _reshape_rows _narrow""".split())
_VIEW_OPS = frozenset({"reshape", "pick", "slice", "transpose"})  # flybatch ops of those


def _is_view(g: Graph, node: int) -> bool:
    op = g.op_of(node)
    if op.name in _VIEW_OPS:
        return True
    if op.name != "torch":
        return False
    fn = g.attr_of(node)[0]
    if isinstance(fn, _Bound):
        fn = fn.args[0] if fn.fn is _apply_template else fn.fn
    return getattr(fn, "__name__", "") in _VIEW_FUNCTIONS


def sharing_storage(g: Graph, writes: list) -> dict[int, tuple[int, str]]:
    """For the in-place writes `(old node, first node of the write, its last node, function)`:
    the nodes that eagerly share each written node's storage (up through the views it was
    taken by to the tensor viewed, then down through the views taken of that before the write,
    the old node included) -> (the write's last node, its function). A few array passes for
    all the writes; only nodes of an op that can be a view are looked at one by one."""
    codes = np.frombuffer(g.view("ops"), dtype=np.int32)
    arg_ptr = np.frombuffer(g.view("arg_ptr"), dtype=np.int64)
    arg_flat = np.frombuffer(g.view("arg_flat"), dtype=np.int64)
    maybe_view = np.array([op.name in _VIEW_OPS or op.name == "torch" for op in _core.op_table()])
    family_of: dict[int, int] = {}  # a node sharing storage -> the index of its write
    olds = [old for old, *_ in writes]
    family_of.update(zip(olds, range(len(olds))))
    for k in np.nonzero(maybe_view[codes[olds]])[0].tolist():  # up from a written view
        node = olds[k]
        while _is_view(g, node) and g.args_of(node):
            node = g.args_of(node)[0]
        family_of[node] = k
    todo = np.fromiter(family_of, dtype=np.int64)
    while len(todo):  # the views of the nodes found so far, taken before their write
        lo = arg_ptr[todo.min() + 1]
        found = np.nonzero(np.isin(arg_flat[lo:], todo))[0] + lo
        readers = np.searchsorted(arg_ptr, found, side="right") - 1
        candidates = maybe_view[codes[readers]]
        more = []
        for reader, position in zip(readers[candidates].tolist(), found[candidates].tolist()):
            base = int(arg_flat[position])
            k = family_of[base]
            if reader not in family_of and reader < writes[k][1] \
                    and g.args_of(reader)[:1] == (base,) and _is_view(g, reader):
                family_of[reader] = k
                more.append(reader)
        todo = np.array(more, dtype=np.int64)
    return {node: (writes[k][2], writes[k][3]) for node, k in family_of.items()}


# In-place writes that replace the values, by what they write.
_OVERWRITES = {"copy_": lambda src, non_blocking=False: src, "fill_": lambda value: value,
               "zero_": lambda: 0.0}


def _as_written_into(func: Callable, target: torch.Tensor, new: Any, cast: bool = False) -> Any:
    """The out-of-place result as the in-place write leaves it in `target`: of its shape (a
    result that broadcasts beyond it raises, as eagerly) and dtype (cast where torch casts;
    `copy_` casts any)."""
    shape, dtype = tuple(new.shape), new.dtype
    if shape != tuple(target.shape):
        raise RuntimeError(f"{_name(func)}: a result of shape {shape} cannot be written in "
                           f"place into a tensor of shape {tuple(target.shape)}")
    if dtype != target.dtype:
        if not cast and not torch.can_cast(dtype, target.dtype):
            raise RuntimeError(f"{_name(func)}: result type {dtype} can't be cast to the "
                               f"tensor's type {target.dtype}")
        new = torch_call(T.to, (new, target.dtype), {})
    return new


def _current_value(g: Graph, tensor: torch.Tensor) -> Any:
    new = g.shadow_of(tensor)
    return tensor if new is None else new


def _setitem_batched(key, batch):
    base, value = batch
    out = base.clone()
    out[(slice(None),) + key] = ops._align(value, out[(slice(None),) + key].dim() - 1)
    return out


def _setitem(g: Graph, target: torch.Tensor, key: Any, value: Any) -> Expression:
    if not isinstance(key, tuple):
        key = (key,)
    if any(isinstance(k, (torch.Tensor, Expression, list)) for k in key):
        raise TypeError("writing an expression into a tensor at tensor indices is not supported; "
                        "use torch.cat / torch.stack to build the tensor")
    call = _Call((_current_value(g, target), value), {}, g)
    shape = g.shape_of(call.nodes[0])
    dtype = g.dtype_of(call.nodes[0])
    return _direct("setitem", call, _Bound(_setitem_batched, key), (), shape, dtype,
                   shared=(False, False))


# ---- indexing: x[...] beyond the int and slice the C type handles -------------------------------
def _getitem_batched(key, batch):
    return batch[0][(slice(None),) + key]


def getitem(x: Expression, key: Any) -> Any:
    keys = _held_ints(key if isinstance(key, tuple) else (key,))
    for k in keys:
        if isinstance(k, (bool, np.bool_, float)):
            raise IndexError(f"{x!r}[{key!r}]: only integers, slices, None, ... and integer "
                             "tensors are valid indices")
    if any(isinstance(k, (torch.Tensor, Expression, list, np.ndarray)) for k in keys):
        selected = _by_computed_indices(x, keys)
        if selected is not None:
            return selected
        return _generic(torch.Tensor.__getitem__, (x, key), {})

    return _record(getitem, (x, keys), None, _getitem_plan)


def _held_ints(keys: tuple) -> tuple:
    """A 0-d integer tensor indexes as the int it holds (its meta stand-in has no value)."""
    return tuple(int(k) if isinstance(k, torch.Tensor) and k.dim() == 0 and
                 not k.is_floating_point() and k.dtype != torch.bool else k for k in keys)


def _is_computed_index(k: Any) -> bool:
    return isinstance(k, Expression) and k.dim() == 0 and k.dtype in (torch.int64, torch.int32)


def _by_computed_indices(x: Any, keys: tuple) -> Any:
    """`x[j]`, `x[:, j]`, `x[i, j]`... with `j` a 0-d integer expression (an index computed per
    instance: `topk`'s, `argmax(dim)`'s): eagerly it indexes as the int it holds, a select, whose
    shape no meta run can find (the stand-in holds no value). Recorded as one index_select per
    such index (a negative one counts from the end, as eagerly; one out of range fails its
    forward, naming the op), batched over instances. None for any other key."""
    if not any(_is_computed_index(k) for k in keys) or \
            not all(type(k) in (int, slice) or _is_computed_index(k) for k in keys):
        return None
    out, dim = x, 0
    for k in keys:
        if type(k) is slice:
            if k != slice(None):
                out = out[(slice(None),) * dim + (k,)]
            dim += 1
        elif type(k) is int:
            out = out.select(dim, k)
        else:
            k = torch.where(torch.lt(k, 0), k + out.shape[dim], k)
            out = out.index_select(dim, k.reshape(1)).squeeze(dim)
    return out


def _getitem_plan(call: _Call):
    keys = call.args[1]  # the template keeps the index's constants as they are
    shape, dtype = _meta_of(torch.Tensor.__getitem__, call)
    return "getitem", _Bound(_getitem_batched, keys, key=call.key), shape, dtype, (False,), True


ops._getitem = getitem


class _Pieces(_Recipe):
    """The pieces of a chunk / split / unbind: each the plan of a `getitem` (a slice, or an
    index, of the batch), so the pieces at one position batch over the instances."""

    __slots__ = ("kind", "plans")

    def __init__(self, kind: type, plans: list[_Plan]):
        self.kind, self.plans = kind, plans

    def apply(self, args: tuple) -> Any:
        x = args[0]
        g, nodes = x.graph, (x.id,)
        return self.kind([plan.append(g, nodes) for plan in self.plans])


def _pieces(func: Callable, default_dim_at: int):
    """chunk / split / unbind of an expression: its pieces by a `_Pieces` recipe (cheap direct
    getitems), instead of computing the whole split once per piece."""
    def build(call):
        if len(call.nodes) != 1 or call.args[0].__class__ is not _Slot:
            return NotImplemented  # split sizes in a tensor: generic
        args, kwargs = call.args[1:], call.kwargs
        dim = kwargs.get("dim", args[default_dim_at] if len(args) > default_dim_at else 0)
        if not isinstance(dim, int) or isinstance(dim, bool):
            return NotImplemented
        structure = _meta_of(func, call)
        if isinstance(structure[1], torch.dtype):
            return NotImplemented
        shapes, kind = structure
        (shape, _), = call.operands
        d = _dim(dim, len(shape), func.__name__) - 1
        lead = (slice(None),) * d
        if func in (torch.unbind, T.unbind):
            keys = [lead + (i,) for i in range(len(shapes))]
        else:
            ends = np.cumsum([0] + [piece[d] for piece, _ in shapes]).tolist()
            keys = [lead + (slice(start, end),) for start, end in zip(ends, ends[1:])]
        x = Expression(call.graph, call.nodes[0])
        plans = [_plan_of(getitem, _Call((x, key), {}, call.graph), _getitem_plan)
                 for key in keys]
        if any(type(plan) is not _Plan for plan in plans):
            return NotImplemented
        return _Pieces(kind, plans)

    def handler(x, *args, **kwargs):
        if not isinstance(x, Expression):
            return NotImplemented
        return _record(handler, (x,) + args, kwargs, build)
    return handler


def _tensor_getitem(x, key):
    """`E[w]` on a parameter with an int: a row lookup (all lookups of one table batch into one
    embedding call, whatever the rows); an expression goes to `getitem`."""
    if isinstance(x, Expression):
        return x[key]
    if type(key) is ArgmaxIndex:  # `E[out.argmax()]`: the int it holds, as a 0-d index is
        key = int(key)
    if type(key) is int:  # the commonest part (`U_f[0]`, `E[w]`): no tensor in the key
        keys = (key,)
    else:
        keys = _held_ints(key if isinstance(key, tuple) else (key,))
        selected = _by_computed_indices(x, keys)
        if selected is not None:
            return selected
        key = keys if isinstance(key, tuple) else keys[0]
    if not (x.requires_grad and x.is_leaf and x.dtype.is_floating_point and x.dim() >= 1):
        return NotImplemented
    if type(key) is int and x.dim() == 2:
        row = ops.lookup(x, key)
        row.graph.note_row_view(row.id, x, key)
        return row
    if type(key) is int:
        key_id = ("tuple", key)  # _key(keys), keyed directly
    elif all(k is None or k is Ellipsis or type(k) in (int, slice) for k in keys):
        key_id = _key(keys)
    else:
        return NotImplemented
    # A constant part of a parameter (`U_f[0]`): one shared parameter node per graph.
    g = current_graph()
    return Expression(g, g.parameter_view_node(x, key, key_id))


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


def _lookup_rows(g: Graph, table: torch.Tensor, row: int, index_shape: tuple,
                 sparse: bool) -> Expression:
    """`F.embedding` of a one-element index of shape `index_shape` holding `row`: a lookup
    node of shape `index_shape + (columns,)` (a 0-d index: `fb.lookup` itself)."""
    if not index_shape:
        return ops.lookup(table, row, sparse, g)
    rows, columns = table.shape
    if not 0 <= row < rows:
        raise IndexError(f"F.embedding: index {row} out of range for a table of {rows} rows")
    entry = g.tags.get(id(table))  # the table's tag, checked once per graph (Graph._lookup_tag)
    tag = entry[1] if entry is not None else g._lookup_tag(table)
    shape = index_shape + (columns,)
    return g.add(ops.LOOKUP, (), shape, ("lookup", tag, sparse, shape), (table, sparse, ()), row)


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


# ---- losses: reduction per instance ----------------------------------------------------------
def _loss(func: Callable, n_inputs: int):
    """A loss with `reduction=`: the batch call with reduction='none', reduced per instance
    (so `mean` divides by each instance's own count, or summed class weights for nll)."""
    label = func.__name__
    weighted = func in (F.nll_loss, F.cross_entropy)

    def build(call, across_lengths=False):
        bound = _bind(func, call.args, call.kwargs)  # the template: operands are _Slots
        reduction = bound.pop("reduction", "mean")
        if any(bound.pop(legacy, None) is not None for legacy in ("size_average", "reduce")):
            return NotImplemented
        inputs = [bound.pop(name) for name in list(bound)[:n_inputs]]
        weight = bound.pop("weight", None) if weighted else None
        if weighted and bound.get("label_smoothing", 0.0) != 0.0:
            return NotImplemented
        if any(type(v) is not _Slot for v in inputs) or \
                any(isinstance(v, _Slot) for v in bound.values()):
            return NotImplemented  # per-instance weights, pos_weight: generic
        if weight is not None and type(weight) is not _Slot:
            return NotImplemented
        own_weight = weight is not None and not call.params[weight.index]
        if own_weight and not across_lengths:
            return NotImplemented  # each instance's own class weights (a plain tensor): generic
        if weighted and len(call.operands[inputs[0].index][0]) not in (1, 2):
            return NotImplemented  # (N, C, d1...) inputs: generic
        if weighted and call.operands[inputs[1].index][1].is_floating_point:
            return NotImplemented  # class probabilities as targets (distillation): generic
        shape, dtype = _meta_of(func, call)
        slots = tuple(v.index for v in inputs)
        weight_slot = None if weight is None else weight.index
        shared = tuple(i == weight_slot and not own_weight for i in range(len(call.nodes)))
        fn = _Bound(_loss_from_slots, func, weighted, slots, weight_slot, reduction,
                    tuple(sorted(bound.items())), key=call.key)
        if not across_lengths:
            return label, fn, shape, dtype, shared, False
        # Scores (n, C) of a length-led input and class targets (n,): the targets' padding
        # is ignore_index, so that padded rows add no loss, no count and no gradient.
        (x, _), (target, target_dtype) = (call.operands[i] for i in slots)
        if not weighted or len(x) != 2 or target != x[:1] or target_dtype.is_floating_point \
                or own_weight and call.operands[weight_slot][0] != x[1:]:
            return NotImplemented
        fills = ((slots[1], bound.get("ignore_index", -100)),)
        return _rows_plan(call, label, fn, shape, dtype, shared, fills,
                          whole=(weight_slot,) if own_weight else ())

    def rows(call):
        return build(call, across_lengths=True)

    def handler(*args, **kwargs):
        if weighted:
            _check_classes(label, args, kwargs)
            if _led(args[0] if args else kwargs.get("input")):
                out = _across_lengths(handler, args, kwargs, rows)
                if out is not NotImplemented:
                    return out
        return _record(handler, args, kwargs, build)

    return handler


def _check_classes(label: str, args: tuple, kwargs: dict) -> None:
    """A class index out of range raises here, at the call, as it does eagerly (in the batched
    kernel it would surface at the next value request). Targets that are expressions are
    checked by the kernel."""
    x = args[0] if args else kwargs.get("input")
    target = args[1] if len(args) > 1 else kwargs.get("target")
    if not isinstance(target, torch.Tensor) or isinstance(target, Expression) or \
            target.dtype.is_floating_point or x is None or len(x.shape) not in (1, 2):
        return
    classes = x.shape[-1]
    ignore = kwargs.get("ignore_index", args[4] if len(args) > 4 else -100)
    with torch._C.DisableTorchFunction():
        if target.numel() == 1:
            low = high = int(target.item())  # (int(target) takes 3x as long)
        elif target.numel() == 0:
            return
        else:
            kept = target[target != ignore]
            if kept.numel() == 0:
                return
            low, high = int(kept.min()), int(kept.max())
    for bad in (low, high):
        if bad != ignore and not 0 <= bad < classes:
            raise IndexError(f"F.{label}: target {bad} is out of bounds for input of shape "
                             f"{tuple(x.shape)} ({classes} classes)")


def _loss_from_slots(func, weighted, slots, weight_slot, reduction, options, batch):
    tensors = [batch[i] for i in slots]
    if weight_slot is not None:
        tensors.append(batch[weight_slot])
    return _loss_batched(func, weighted, tensors, reduction, weight_slot is not None, options)


def _bind(func, args, kwargs) -> dict:
    import inspect

    signature = _SIGNATURES.get(func)
    if signature is None:
        signature = _SIGNATURES[func] = inspect.signature(func)
    bound = signature.bind(*args, **kwargs)
    return dict(bound.arguments)


_SIGNATURES: dict = {}


def _loss_batched(func, weighted, batch, reduction, has_weight, options):
    options = dict(options)
    weight = batch[-1] if has_weight else None
    tensors = batch[:-1] if has_weight else batch
    size = tensors[0].shape[0]
    if weighted:
        x, target = tensors
        classes = x.shape[-1]
        rows = target.reshape(size, -1)
        classes_of_rows = rows.clamp(0, classes - 1)  # (an ignored target may be any int)
        own = weight is not None and weight.dim() == 2  # each instance's class weights [B, C]
        losses = func(x.reshape(-1, classes), rows.reshape(-1), weight=None if own else weight,
                      reduction="none", **options).reshape(size, -1)
        if own:  # w[t] * -x[t]: the product torch forms with a weight
            losses = losses * weight.gather(1, classes_of_rows)
        if reduction == "none":
            return losses.reshape(target.shape)
        if reduction == "sum":
            return losses.sum(1)
        # mean: divided by the summed weights of each instance's targets (ignore_index: 0)
        if weight is None:
            weights = torch.ones_like(rows, dtype=x.dtype)
        else:
            weights = weight.gather(1, classes_of_rows) if own else weight[classes_of_rows]
        counted = weights.masked_fill(rows == options.get("ignore_index", -100), 0.0)
        return losses.sum(1) / counted.sum(1)
    losses = func(*tensors, reduction="none", **options)
    if reduction == "none":
        return losses
    flat = losses.reshape(size, -1)
    return flat.sum(1) if reduction == "sum" else flat.mean(1)


# ---- recurrent cells and layers -------------------------------------------------------------
def _cell(func: Callable, outputs: int):
    """torch.lstm_cell / gru_cell / rnn_tanh_cell / rnn_relu_cell (what nn.*Cell call): one node
    computing the batch's cells, weights shared; an LSTM's (h, c) are two views of it."""
    def handler(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
        states = tuple(hx) if outputs == 2 else (hx,)
        operands = (input,) + states + (w_ih, w_hh) + tuple(b for b in (b_ih, b_hh)
                                                            if b is not None)
        call = _Call(operands, {})
        shared = call.shared()
        if not all(shared[1 + len(states):]):
            return NotImplemented
        # Input and states are per instance even when they are leaves that require grad (a
        # learned initial state): batched by shape, not by node.
        shared = (False,) * (1 + len(states)) + shared[1 + len(states):]
        g = call.graph
        x_shape = g.shape_of(call.nodes[0])
        if len(x_shape) != 2:
            return NotImplemented
        hidden = w_hh.shape[1]
        packed = (x_shape[0], outputs * hidden)
        fn = _Bound(_cell_batched, func, len(states), b_ih is not None)
        node = _direct(func.__name__, call, fn, (), packed, g.dtype, shared)
        if outputs == 1:
            return node
        h = _direct("narrow", _Call((node,), {}, g), _Bound(_narrow, 0, hidden), (),
                    (x_shape[0], hidden), g.dtype, (False,), cheap=True)
        c = _direct("narrow", _Call((node,), {}, g), _Bound(_narrow, hidden, hidden),
                    (), (x_shape[0], hidden), g.dtype, (False,), cheap=True)
        return h, c

    return handler


def _narrow(start, length, batch):
    return batch[0].narrow(-1, start, length)


def _cell_batched(func, n_states, has_bias, batch):
    x, *rest = batch
    states, weights = rest[:n_states], rest[n_states:]
    size, rows = x.shape[0], x.shape[1]
    flat = [t.reshape(size * rows, t.shape[-1]) for t in [x] + states]
    if not has_bias:
        weights = weights + [None, None]
    if n_states == 2:
        h, c = func(flat[0], (flat[1], flat[2]), *weights)
        out = torch.cat([h, c], -1)
    else:
        out = func(flat[0], flat[1], *weights)
    return out.reshape(size, rows, -1)


def _lstm_step_batched(has_bias, hidden, batch):
    """One LSTM step of a batch: x [B, rows, in], packed state [B, rows, 2H] ([h; c], the
    layout the step returns, so a sequence never slices c out), weights shared."""
    x, hc, w_ih, w_hh, *biases = batch
    size, rows = x.shape[0], x.shape[1]
    hc = hc.reshape(size * rows, 2 * hidden)
    h, c = torch.lstm_cell(x.reshape(size * rows, -1), (hc[:, :hidden], hc[:, hidden:]), w_ih,
                           w_hh, *(biases if has_bias else (None, None)))
    return torch.cat([h, c], -1).reshape(size, rows, 2 * hidden)


def _gru_step_batched(has_bias, batch):
    x, h, w_ih, w_hh, *biases = batch
    size, rows = x.shape[0], x.shape[1]
    out = torch.gru_cell(x.reshape(size * rows, -1), h.reshape(size * rows, -1), w_ih, w_hh,
                         *(biases if has_bias else (None, None)))
    return out.reshape(size, rows, -1)


def _rnn(gates: int):
    """torch.lstm / torch.gru (what nn.LSTM and nn.GRU call) over one instance's sequence:
    one node per layer whose kernel runs every instance's sequence as one packed sequence
    (`packed_rnn`). Where that is not exact (rows > 1 per instance, dropout between layers in
    training), unrolled into one cell node per step, layer and direction: step t of every
    instance runs as one batched cell whatever the lengths. Step inputs are picks of the
    sequence (`x[t]`, the index per node, so they batch across steps too); an LSTM carries its
    state packed as [h; c] and slices h out only where a layer's output is read."""
    lstm = gates == 4

    def step():  # the plans' key for one step node (see `_record`)
        raise AssertionError("a plan key, not called")

    def build_step(call):
        shared = call.weights_shared()
        if shared is None:
            return NotImplemented
        (rows, _), dtype = call.operands[0]
        hidden = call.operands[3][0][1]  # w_hh: (gates * H, H)
        has_bias = len(call.nodes) == 6
        fn = _Bound(_lstm_step_batched, has_bias, hidden) if lstm else \
            _Bound(_gru_step_batched, has_bias)
        return ("lstm_step" if lstm else "gru_step", fn, (rows, (2 if lstm else 1) * hidden),
                dtype, shared, False)

    def handler(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                batch_first):
        if isinstance(has_biases, (list, tuple)):  # the packed overload: (data, batch_sizes, ...)
            return _packed_rnn(handler, input, hx, params, has_biases, num_layers, dropout,
                               train, bidirectional, batch_first)
        if not isinstance(input, (Expression, torch.Tensor)) or len(input.shape) != 3 \
                or not all(isinstance(p, torch.Tensor) and p.requires_grad for p in params):
            return NotImplemented
        per_direction = len(params) // (num_layers * (2 if bidirectional else 1))
        if per_direction != (4 if has_biases else 2):
            raise ValueError(f"torch.{'lstm' if lstm else 'gru'}: {per_direction} weights per "
                             f"layer and direction (an nn.LSTM with proj_size?); flybatch "
                             f"records {4 if has_biases else 2}, without projections")
        if not isinstance(input, Expression):  # a plain sequence into the module's parameters
            g = current_graph()
            input = Expression(g, g._operand(input))
        g = input.graph
        if batch_first:
            input = input.transpose(0, 1)  # (length, rows, features)
        if not (dropout and train and num_layers > 1):  # (dropout between layers: unrolled)
            fused = packed_rnn.layers(lstm, input, _initial_states(g, hx, lstm), params,
                                      has_biases, num_layers, bidirectional, train)
            if fused is not None:
                output, *finals = fused
                return (output.transpose(0, 1) if batch_first else output, *finals)
        length = input.shape[0]
        directions = 2 if bidirectional else 1
        per_layer = 4 if has_biases else 2
        h0, c0 = hx if lstm else (hx, None)
        xs = [input[t] for t in range(length)]  # (rows, features) each
        finals_h, finals_c = [], []
        for layer in range(num_layers):
            outs_by_direction = []
            for direction in range(directions):
                k = layer * directions + direction
                weights = tuple(params[k * per_layer:(k + 1) * per_layer])
                hidden = weights[1].shape[1]
                state = torch.cat([h0[k], c0[k]], -1) if lstm else h0[k]
                order = range(length) if direction == 0 else range(length - 1, -1, -1)
                states = [None] * length
                for t in order:
                    state = _record(step, (xs[t], state) + weights, None, build_step,
                                    (2, 3, 4, 5))
                    states[t] = state
                outs_by_direction.append(states)
                finals_h.append(state[..., :hidden] if lstm else state)
                finals_c.append(state[..., hidden:] if lstm else None)
            last = layer == num_layers - 1
            if last:
                break
            xs = [_hidden_of(outs, lstm) for outs in outs_by_direction]
            xs = xs[0] if directions == 1 else [torch.cat(pair, -1) for pair in zip(*xs)]
            if dropout and train:  # one mask for the layer's whole output, as eagerly
                g = xs[0].graph
                noise = ops.dropout_noise((len(xs),) + tuple(xs[0].shape), dropout,
                                          g.dtype_of(xs[0].id), g.device)
                xs = [ops.dropout(x, dropout, True, noise[t]) for t, x in enumerate(xs)]
        # The top layer's output: one stack per direction, h sliced once for all steps.
        outputs = [torch.stack(states, 0) for states in outs_by_direction]
        if lstm:
            outputs = [out[..., :hidden] for out in outputs]
        output = outputs[0] if directions == 1 else torch.cat(outputs, -1)
        if batch_first:
            output = output.transpose(0, 1)
        h_n = torch.stack(finals_h, 0)
        if lstm:
            return output, h_n, torch.stack(finals_c, 0)  # as torch.lstm: flat
        return output, h_n

    return handler


# Packed sequences (`nn.utils.rnn.pack_sequence([x])`, `pack_padded_sequence`) of ONE instance's
# sequence: one sequence, so its packed data is the sequence itself and every batch size is 1;
# the layers run as on the (T, 1, I) sequence, which batches across instances anyway.
def _one_sequence(name: str, batch_sizes: Any) -> None:
    if isinstance(batch_sizes, Expression) or not bool((batch_sizes == 1).all()):
        raise ValueError(f"{name}: flybatch batches packed sequences of one sequence per "
                         f"instance (batch sizes all 1), not {batch_sizes!r}")


def _pack_padded(input, lengths, batch_first):
    if not isinstance(input, Expression) or isinstance(lengths, Expression) \
            or lengths.numel() != 1:
        raise ValueError(f"torch._pack_padded_sequence: flybatch packs one sequence per instance, "
                         f"not an input of shape {tuple(input.shape)} with lengths {lengths!r}")
    length = int(lengths[0])
    data = input[0, :length] if batch_first else input[:length, 0]
    return data, torch.ones(length, dtype=torch.int64)


def _pad_packed(data, batch_sizes, batch_first, padding_value, total_length):
    _one_sequence("torch._pad_packed_sequence", batch_sizes)
    length = len(batch_sizes)
    padded = F.pad(data, (0, 0, 0, total_length - length), value=padding_value)
    return padded.unsqueeze(0 if batch_first else 1), torch.tensor([length])


def _packed_rnn(unpacked, data, batch_sizes, hx, params, has_biases, num_layers, dropout, train,
                bidirectional):
    _one_sequence("torch.lstm / torch.gru", batch_sizes)
    output, *finals = unpacked(data.unsqueeze(1), hx, params, has_biases, num_layers, dropout,
                               train, bidirectional, False)
    return (output.squeeze(1), *finals)


def _initial_states(g: Graph, hx: Any, lstm: bool) -> tuple[Expression, ...] | None:
    """The initial states of a captured `torch.lstm` / `torch.gru` as expressions, or None when
    they are plain tensors of zeros (nn.LSTM's default): the layer then starts from zeros
    without reading a copy of them per instance."""
    states = tuple(hx) if lstm else (hx,)
    if all(type(s) is torch.Tensor and id(s) not in g.shadows and not s.requires_grad
           for s in states):
        with torch._C.DisableTorchFunction():
            if not any(bool(s.any()) for s in states):
                return None
    return tuple(s if isinstance(s, Expression) else Expression(g, g._operand(s))
                 for s in states)


def _hidden_of(states, lstm):
    if not lstm:
        return states
    hidden = states[0].shape[-1] // 2
    return [s[..., :hidden] for s in states]


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


def _register(funcs, handler) -> None:
    for func in funcs:
        if func is not None:
            _HANDLERS[func] = handler


T = torch.Tensor

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


# ---- expressions as per-instance tensors ---------------------------------------------------
def _method(func: Callable) -> Callable:
    def method(self, *args, **kwargs):
        return torch_call(func, (self,) + args, kwargs)
    method.__name__ = func.__name__
    method.__doc__ = f"`Tensor.{func.__name__}` on the per-instance value, recorded as a node."
    return method


def _size(self, dim: int | None = None):
    shape = torch.Size(self.shape)
    if dim is None:
        return shape
    if not -len(shape) <= dim < max(len(shape), 1):
        raise IndexError(f"size: dimension {dim} out of range for a tensor of {len(shape)} dims")
    return shape[dim]


def _len(self) -> int:
    if not self.shape:
        raise TypeError("len() of a 0-d expression")
    return self.shape[0]


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


def _eq(self, other):
    # torch's elementwise comparison whatever the other operand, another expression too, as
    # per-instance torch code means it (`(pred == gold).sum()`). The hash stays identity
    # (`__hash__ = object.__hash__`, as torch.Tensor's), so expressions stay dict keys and set
    # members; like tensors, they are not found by `in` / `index` of a list by value.
    return torch_call(T.__eq__, (self, other), {})


def _ne(self, other):
    return torch_call(T.__ne__, (self, other), {})


_PROPERTIES = {
    "dtype": property(lambda self: self.graph.dtype_of(self.id)),
    "device": property(lambda self: self.graph.device or torch.device("cpu")),
    "ndim": property(lambda self: len(self.shape)),
    "requires_grad": property(_requires_grad),
    "is_leaf": property(lambda self: not _requires_grad(self)),
    "grad": property(lambda self: None),
    "data": property(lambda self: self.value().detach()),
    "T": property(lambda self: torch_call(T.permute, (self, tuple(range(len(self.shape)))[::-1]),
                                          {})),
    "mT": property(lambda self: torch_call(T.transpose, (self, -2, -1), {})),
    # (the conjugate transposes of a real expression: the graph's dtypes are real)
    "mH": property(lambda self: torch_call(T.transpose, (self, -2, -1), {})),
    "H": property(lambda self: torch_call(T.adjoint, (self,), {}) if len(self.shape) == 2
                  else _refuse_h(self)),
    "grad_fn": property(lambda self: _BATCHED_GRAD_FN if _requires_grad(self) else None),
    "is_cuda": property(lambda self: (self.graph.device or torch.device("cpu")).type == "cuda"),
    "layout": property(lambda self: torch.strided),
}


def _refuse_h(self):
    raise RuntimeError(f"tensor.H is only supported on matrices (2-D tensors); the expression "
                       f"has shape {tuple(self.shape)}")


class _BatchedGradFn:
    """An expression's `grad_fn` where gradient flows into it (code tests `x.grad_fn is None`):
    its backward runs batched with other instances', never as a node of its own."""

    def name(self) -> str:
        return "FlybatchBatchedBackward"

    def __repr__(self) -> str:
        return f"<{self.name()}>"


_BATCHED_GRAD_FN = _BatchedGradFn()


def _refuse_setitem(self, key, value) -> None:
    raise TypeError(f"item assignment into a flybatch expression (x[{key!r}] = ... on shape "
                    f"{tuple(self.shape)}) is not supported: an expression has no storage. "
                    "Build the value out of place (torch.cat, torch.where, masked_fill, "
                    "scatter), or write into a plain tensor (`out = torch.zeros(n, H)`, then "
                    "`out[i] = h`)")


def _described_like_a_tensor(name: str) -> property:
    """`is_cpu`, `is_nested`, `is_sparse`, ...: what an expression's value, a dense tensor on
    the graph's device, would say (library code such as nn.MultiheadAttention branches on them
    before it computes anything)."""
    def read(self):
        template = torch.empty(0, dtype=self.graph.dtype_of(self.id),
                               device=self.graph.device or torch.device("cpu"))
        return getattr(template, name)
    return property(read)


_PROPERTIES.update({name: _described_like_a_tensor(name) for name in dir(T)
                    if name.startswith("is_") and name not in _PROPERTIES
                    and isinstance(getattr(T, name), types.GetSetDescriptorType)})
_OWN = {
    "size": _size, "dim": lambda self: len(self.shape), "ndimension": lambda self: len(self.shape),
    "numel": lambda self: math.prod(self.shape), "nelement": lambda self: math.prod(self.shape),
    "__len__": _len, "__eq__": _eq, "__ne__": _ne, "__hash__": object.__hash__,
    "tolist": lambda self: self.value().detach().tolist(),
    "__index__": lambda self: int(self.value().detach()),
    "is_floating_point": lambda self: self.graph.dtype_of(self.id).is_floating_point,
    "__pow__": _method(T.__pow__), "__rpow__": _method(T.__rpow__),
    "__mod__": _method(T.__mod__), "__floordiv__": _method(T.__floordiv__),
    "__abs__": _method(T.__abs__), "__invert__": _method(T.__invert__),
    "__and__": _method(T.__and__), "__or__": _method(T.__or__), "__xor__": _method(T.__xor__),
    "__pos__": _method(T.__pos__), "__reversed__": _method(T.__reversed__),
    "__setitem__": _refuse_setitem,
    "__array__": lambda self, dtype=None, copy=None:  # `np.array(x)`: the values, as .numpy()
        self.value().detach().cpu().numpy().astype(dtype or None, copy=False),
}
# `h += x`...: the write, seen through every reference to h (`_write_into_expression`)
_OWN.update({name: (lambda func, name: lambda self, other: _write_into_expression(
    func, name, self, other))(getattr(T, name), name) for name in _OUT_OF_PLACE})
# Kept as flybatch defines them: value(), item(), numpy(), backward(), argmax() with no argument
# (a Python int, as always), the operators the C type implements, comparisons that ask for the
# value.
_KEEP = {"value", "item", "numpy", "backward", "graph", "id", "shape", "op", "__lt__", "__le__",
         "__gt__", "__ge__", "__bool__", "__float__", "__int__", "__repr__", "__iter__",
         "__array_ufunc__", "__torch_function__", "__getitem__", "__add__", "__radd__",
         "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
         "__matmul__", "__rmatmul__", "__neg__", "argmax"}


class ArgmaxIndex(int):
    """What `x.argmax()` with no argument returns: the index of the largest element, asked for
    at once (a value request, as flybatch always had it). It is a Python int, as flybatch code
    uses it (a list index, a dict key, `fb.lookup(E, i)`), and it is also the 0-d int64 tensor
    torch returns, as a greedy decoder written for one instance feeds it back: to torch functions
    (`emb(i)`, `F.one_hot(i, n)`), to Tensor methods (`i.view(1, -1)`, `i.item()`), and in
    comparisons, which give torch bools (`if i == eos:`). An argmax has no gradient, so the
    constant tensor is exactly what eager torch computes."""

    def __new__(cls, index: torch.Tensor) -> "ArgmaxIndex":
        self = super().__new__(cls, int(index))
        self.tensor = index
        return self

    def __getattr__(self, name: str) -> Any:
        """The Tensor methods and properties int lacks (`view`, `shape`...); not the protocols
        (`copy.deepcopy` copies the index, a dict key stays one), nor `tensor` itself while an
        unpickled copy has none yet."""
        if name.startswith("__") or name == "tensor":
            raise AttributeError(name)
        return getattr(self.tensor, name)

    def item(self) -> int:
        return int(self)

    def tolist(self) -> int:
        return int(self)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """A torch call outside capture (an eager one, or one capture runs as it is)."""
        args, kwargs = _argmax_tensors((args, kwargs or {}))
        return func(*args, **kwargs)

    __hash__ = int.__hash__  # (a dict key as the int; defining __eq__ would drop it)


def _holds_argmax(xs: Any) -> bool:
    """Whether a call's arguments hold an ArgmaxIndex (a cheap test, a loop and no generator,
    run for every generic call; mapping the arguments is not cheap)."""
    for x in xs:
        if type(x) is ArgmaxIndex or type(x) in (list, tuple) and _holds_argmax(x):
            return True
    return False


def _argmax_tensors(tree: Any) -> Any:
    """`tree` with each ArgmaxIndex in it replaced by its tensor (where a call takes tensors)."""
    return pytree.tree_map_only(ArgmaxIndex, lambda i: i.tensor, tree)


def _tensor_comparison(name: str) -> Callable:
    def compare(self, other):
        return getattr(self.tensor, name)(other)
    compare.__name__ = name
    return compare


for _name_ in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"):
    setattr(ArgmaxIndex, _name_, _tensor_comparison(_name_))


def _argmax(self, dim=None, keepdim=False):
    """With no argument, the index of the largest element as an `ArgmaxIndex` (a value
    request, as flybatch always had it); with `dim`, torch's argmax as a node."""
    if dim is None and not keepdim:
        return ArgmaxIndex(self.value().detach().argmax())
    return torch_call(T.argmax, (self, dim, keepdim), {})


def _comparison(func: Callable, peek: Callable) -> Callable:
    """`<` `<=` `>` `>=`: a scalar compared with a scalar asks for the value (torch's 0-d bool
    tensor of it, so `if score > best:` branches on it, as flybatch always did); anything
    larger is torch's elementwise mask, recorded (bool() of it would be ambiguous anyway)."""
    def compare(self, other):
        other_shape = other.shape if isinstance(other, (Expression, torch.Tensor, np.ndarray)) \
            else ()
        if not self.shape and not tuple(other_shape):
            return peek(self, other)
        return torch_call(func, (self, other), {})
    compare.__name__ = func.__name__
    return compare


def _install() -> None:
    for name, prop in _PROPERTIES.items():
        setattr(Expression, name, prop)
    for name, fn in _OWN.items():
        setattr(Expression, name, fn)
    Expression.argmax = _argmax
    for name in ("__lt__", "__le__", "__gt__", "__ge__"):
        setattr(Expression, name, _comparison(getattr(T, name), vars(Expression)[name]
                                              if name in vars(Expression) else
                                              getattr(Expression.__mro__[0], name)))
    for name in dir(T):
        if name.startswith("_") or name in _KEEP or name in _PROPERTIES or name in _OWN:
            continue
        func = getattr(T, name)
        if not callable(func) or isinstance(func, type):
            continue
        if name in vars(Expression) or any(name in vars(k) for k in Expression.__mro__[1:-1]):
            continue
        # own_time: recording the call is flybatch's part of a build (the bench's build_user)
        setattr(Expression, name, _core.own_time(_method(func)))


_install()


def _graph_and_expressions(func: Callable, outputs: Any) -> tuple[Graph, list] | None:
    """The graph and the expressions of `outputs` (torch.autograd's one tensor or sequence),
    or None where they are plain tensors (an eager call, which runs as it is)."""
    outputs = _as_list(outputs)
    exprs = [x for x in outputs if isinstance(x, Expression)]
    if not exprs:
        return None
    if len(exprs) != len(outputs) or any(e.graph is not exprs[0].graph for e in exprs):
        raise TypeError(f"torch.autograd.{func.__name__} of flybatch expressions and other "
                        "tensors (or expressions of two graphs) in one call is not supported: "
                        "differentiate them in calls of their own")
    return exprs[0].graph, exprs


def _autograd_grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False,
                   only_inputs=True, allow_unused=None, is_grads_batched=False,
                   materialize_grads=False):
    """torch.autograd.grad of expressions (a loss) with respect to tensors (parameters, input
    tensors): computed over the batched forward, as plain tensors (Graph.grad)."""
    found = _graph_and_expressions(torch.autograd.grad, outputs)
    options = dict(allow_unused=allow_unused, is_grads_batched=is_grads_batched,
                   materialize_grads=materialize_grads)
    if found is None:
        with torch._C.DisableTorchFunction():
            return torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph,
                                       create_graph, only_inputs, **options)
    g, exprs = found
    return g.grad(exprs, _as_list(inputs),
                  None if grad_outputs is None else _as_list(grad_outputs),
                  retain_graph=retain_graph, create_graph=create_graph, **options)


def _autograd_backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False,
                       grad_variables=None, inputs=None):
    """torch.autograd.backward of expressions: Graph.backward (into the leaves' .grad)."""
    found = _graph_and_expressions(torch.autograd.backward, tensors)
    if found is None:
        with torch._C.DisableTorchFunction():
            return torch.autograd.backward(tensors, grad_tensors, retain_graph, create_graph,
                                           grad_variables, inputs)
    g, exprs = found
    gradients = grad_tensors if grad_tensors is not None else grad_variables
    g.backward(exprs, None if gradients is None else _as_list(gradients),
               retain_graph=retain_graph, create_graph=create_graph,
               inputs=None if inputs is None else _as_list(inputs))
    return None


def _as_list(x: Any) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


_register((torch.autograd.grad,), _autograd_grad)
_register((torch.autograd.backward,), _autograd_backward)


def _refuse_gradient_hook(func: Callable) -> Callable:
    def refuse(x, *args, **kwargs):
        raise TypeError(f"Tensor.{func.__name__} of a flybatch expression is not supported: its "
                        "gradient is computed batched with other instances', never as a tensor "
                        "of its own; read the parameters' (or input tensors') .grad after "
                        "backward")
    return refuse


for _func in (T.register_hook, T.retain_grad):
    _register((_func,), _refuse_gradient_hook(_func))
