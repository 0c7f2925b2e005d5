"""Expressions as per-instance tensors: the Tensor methods and properties an expression
has (recorded as nodes, or answered from its shape), and torch.autograd of expressions."""

from __future__ import annotations

import math
import types
from typing import Any, Callable

import numpy as np
import torch

from .. import _core
from ..graph import Expression, Graph
from .calls import T, _requires_grad, torch_call
from .argmax import ArgmaxIndex
from .inplace import _OUT_OF_PLACE, _write_into_expression
from .dispatch import _register


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
        # (recording the call is flybatch's part of a build: the bench's build_user)
        setattr(Expression, name, _core.RecordedMethod(func))


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
