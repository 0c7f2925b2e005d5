"""The generic fallback: a call no mapping takes becomes a node whose batched kernel
vmaps the function over the batch; one whose output depends on values runs on the values."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.utils import _pytree as pytree

from .. import kernels
from ..graph import Expression, Op
from .calls import (T, _Call, _DataDependent, _Seeded, _current_value, _fill, _meta_outputs,
                    _name, _node, _signature, _wrap, torch_call)
from .mode import _READS_VALUE


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
