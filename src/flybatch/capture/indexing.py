"""Indexing: `x[...]` beyond the int and slice the C type handles, and the calls that
return pieces (`chunk`, `split`, `unbind`)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from .. import ops
from ..graph import Expression, current_graph
from .calls import T, _Call, _Slot, _key
from .argmax import ArgmaxIndex
from .generic import _generic
from .direct import _Bound, _Plan, _Recipe, _dim, _meta_of, _plan_of, _record


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
