"""`ArgmaxIndex`: what `x.argmax()` with no argument returns, an int that is also torch's
0-d index tensor."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree


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
