"""In-place operations: augmented assignments to expressions, writes of expressions into
plain tensors (recorded out of place, `Graph.shadows`), writes into parameters."""

from __future__ import annotations

import operator
from typing import Any, Callable

import numpy as np
import torch
from torch.utils import _pytree as pytree

from .. import _core, ops
from ..graph import PARAMETER, Expression, Graph, _current, _no_capture
from .calls import T, _Call, _current_value, _graph_of, _name, _requires_grad, torch_call
from .mode import _before_write
from .direct import _Bound, _apply_template, _direct


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
