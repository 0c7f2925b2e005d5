"""`ArgmaxIndex`: what `x.argmax()` with no argument returns, an int that is also torch's
0-d index tensor (and so is integer arithmetic on it: `pred + 1`)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree


class ArgmaxIndex(int):
    """What `x.argmax()` with no argument returns: the index of the largest element, asked for
    at once (a value request, as flybatch always had it). It is a Python int, as flybatch code
    uses it (a list index, a dict key, `fb.lookup(E, i)`), and it is also the 0-d int64 tensor
    torch returns, as a greedy decoder written for one instance feeds it back: to torch functions
    (`emb(i)`, `F.one_hot(i, n)`), to Tensor methods (`i.view(1, -1)`, `i.item()`), and in
    comparisons, which give torch bools (`if i == eos:`). Integer arithmetic on it (`i + 1`,
    `n - i`, `i % n`, `-i`) is again both: the int Python computes and the tensor torch does, so
    `emb(pred + 1)` looks up what it looks up eagerly. An argmax has no gradient, so the constant
    tensor is exactly what eager torch computes."""

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


for _name in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"):
    setattr(ArgmaxIndex, _name, _tensor_comparison(_name))


def _integer_arithmetic(name: str) -> Callable:
    """The operator `name` with ints (or other ArgmaxIndexes, or none: `-i`): an ArgmaxIndex of
    the tensor's result, which is the int's result too. With anything else it is the int's own
    operator (a tensor or an expression then takes the call through its reflected operator; a
    float gives a float, as ints do)."""
    int_operator = getattr(int, name)

    def arithmetic(self, *other):
        if all(type(o) is int or type(o) is bool or type(o) is ArgmaxIndex for o in other):
            tensors = [o.tensor if type(o) is ArgmaxIndex else o for o in other]
            return ArgmaxIndex(getattr(self.tensor, name)(*tensors))
        return int_operator(self, *other)
    arithmetic.__name__ = name
    return arithmetic


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__",
              "__rfloordiv__", "__mod__", "__rmod__", "__neg__", "__pos__", "__abs__"):
    setattr(ArgmaxIndex, _name, _integer_arithmetic(_name))
