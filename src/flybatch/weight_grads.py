"""Shared weights' gradients as ONE product per weight per backward.

A shared weight is multiplied by many launches of a graph: one per tree level, per parser
state, per forward. Each launch's own backward would compute dW_i = dY_i^T X_i, a product
whose contraction is that launch's rows (3 to 300 in the benchmarks), and autograd would add it
into the weight's gradient: a weight-sized result written and read again per launch, on
operands too thin for the GEMM's speed. Deferred, the gradient is ONE product over all of them:
dW = [dY_1; ...; dY_B]^T [X_1; ...; X_B], at the speed of a large GEMM.

How: inside a graph's execution (`deferring`, around `execution.run`) a kernel that multiplies
by a weight needing its gradient asks `weight_grad_of(w)` for the weight's `WeightGrad` (one per
graph and weight, kept from forward to forward of the graph) and passes its `token`, a 0-dim
output of `_WeightGradient(w)`, to its autograd Function as an input in place of `w`. Its
backward computes dX, hands (dY, X) to the WeightGrad (`add`) and returns no gradient for the
weight. Autograd runs a node only after every node of the backward that consumes its outputs,
so `_WeightGradient`'s backward comes after every launch that reached it: it multiplies what
they handed in and returns dW to `w` through the weight's own autograd history, once. Hooks,
`torch.autograd.grad`, `inputs=`, `retain_graph` and `create_graph` (the product of the
concatenations is then differentiable) behave as eagerly; a launch whose backward does not need
the weight's gradient (`torch.autograd.grad` of other inputs) hands nothing in.

A weight may be a batch of one (`[1, n, k]`, as launches get parameters) or a stack of weights
(the N-ary Tree-LSTM's `U_f` [1, N, H, H]): `add(dY, X, part)` names which matrix of it, e.g.
`(0, k)`, and the gradient is assembled from each part's product.

Cost: the dY and X of every launch stay alive until the weight's node runs, at most the whole
backward (the Tree-LSTM benchmark's U_iou: ~1,200 rows x (768 + 512) numbers, 6 MB), and are
concatenated once (rows x (n + k) numbers copied for 2 rows n k FLOPs). Measured
(BENCHMARKS.md, fifteenth session; step CPU, alternated, 1 thread): the treelstm task's
backward 26.3-28.9 -> 23.8-24.3 ms (its U_iou's 17 per-level products at ~168 GFLOP/s, each
followed by a sum into the gradient, became one of ~1,200 rows); the parser's ~1 ms.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

from . import kernels


class _Deferring(threading.local):
    """The weight gradients of the graph whose forward runs on this thread (`deferring`)."""

    grads: dict | None = None


_deferring = _Deferring()
# Weights of fewer numbers are not deferred: a launch's own dW of a small weight is a small
# write, and the deferring Function's Python (~3 us forward, ~5 backward) would cost more (the
# parser's [3, 100] output layer, 179 launches a minibatch).
DEFER_MIN_ELEMENTS = 1 << 15
# Launches whose weight gradient was deferred, and the products the WeightGrads ran.
deferred_counts: dict[str, int] = {"launches": 0, "products": 0}


@contextlib.contextmanager
def deferring(grads: dict) -> Iterator[None]:
    """Defer the gradients of the weights multiplied inside the block to `grads` (a graph's
    dict of WeightGrads, kept from forward to forward of the graph)."""
    outer, _deferring.grads = _deferring.grads, grads
    try:
        yield
    finally:
        _deferring.grads = outer


class _Handed:
    """What launches handed to a WeightGrad: per matrix of the weight (`part`), their (dY, X);
    all from one backward call, autograd's graph task `task`."""

    __slots__ = ("task", "parts")

    def __init__(self) -> None:
        self.task, self.parts = -1, {}

    def take(self) -> dict[tuple, list]:
        """The pairs handed in by the backward running now, emptied for the next one (none
        where they came from another: a backward that raised before the weight's node ran)."""
        parts = self.parts if self.task == torch._C._current_graph_task_id() else {}
        self.parts = {}
        return parts


class WeightGrad:
    """The gradient of one weight `weight` over every launch of a graph that multiplies by it,
    as one product per matrix of it (`part`): dW = [dY_1; ...]^T [X_1; ...]."""

    __slots__ = ("weight", "token", "_handed")

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self._handed = _Handed()
        self.token = kernels.apply_function(_WeightGradient, weight, self._handed)

    def __repr__(self) -> str:
        return (f"WeightGrad({tuple(self.weight.shape)}, "
                f"handed={sum(map(len, self._handed.parts.values()))})")

    def add(self, dy: torch.Tensor, x: torch.Tensor, part: tuple = ()) -> None:
        """Hand in a launch's output gradient dY [m, n] and input X [m, k] for the matrix
        `weight[part]` [n, k], from the launch's backward; this backward's WeightGrad node adds
        dY^T X to that matrix's gradient."""
        if not torch._C._will_engine_execute_node(self.token.grad_fn):
            return
        handed, task = self._handed, torch._C._current_graph_task_id()
        if handed.task != task:  # left by an earlier backward that raised: not this one's
            handed.task, handed.parts = task, {}
        handed.parts.setdefault(part, []).append((dy, x))


def weight_grad_of(w: torch.Tensor) -> WeightGrad | None:
    """The `WeightGrad` of weight `w` in the graph whose forward runs, made at its first use
    there; None outside a graph's execution, with grad mode off, where `w` needs no gradient
    or is small (`DEFER_MIN_ELEMENTS`). A kernel defers to it so: in its forward, `wg.token`
    passed to its autograd Function in place of `w`; in its backward, `wg.add(dY, X, part)` in
    place of dW, returning None for the token. `w` is a view of its tensor (a parameter's
    `W.unsqueeze(0)`, a stacked weight's slice), keyed by that tensor and the view: launches
    that take the view anew share one WeightGrad, whose token's history is the first one's (the
    same function of the same tensor)."""
    grads = _deferring.grads
    if grads is None or w.numel() < DEFER_MIN_ELEMENTS or not w.requires_grad \
            or not torch.is_grad_enabled():
        return None
    base = w if w._base is None else w._base
    # The WeightGrad keeps `w`, so its base and storage alive: neither id nor address is reused
    # while the key is in use. The version is not in it: a launch saves the weight for its
    # backward, which raises if the weight is written in place before it, as eagerly.
    key = (id(base), w.data_ptr(), w.shape, w.stride())
    found = grads.get(key)
    if found is None:
        found = grads[key] = WeightGrad(w)
    deferred_counts["launches"] += 1
    return found


class _WeightGradient(torch.autograd.Function):
    """Forward: the 0-dim token of a weight's WeightGrad. Backward (after every launch that
    consumed the token): each handed-in matrix's dW = dY^T X over everything handed in, as one
    product of the concatenations, assembled into the weight's shape."""

    @staticmethod
    def forward(ctx, w, handed):
        ctx.handed, ctx.shape = handed, w.shape
        ctx.set_materialize_grads(False)
        return w.new_empty(())

    @staticmethod
    def backward(ctx, _):
        parts = list(ctx.handed.take().items())  # a second backward hands in afresh
        if not parts:
            return None, None
        fast = not torch.is_grad_enabled()  # else differentiable products (create_graph)
        products = []
        for part, pairs in parts:
            dys, xs = zip(*pairs)
            dy = dys[0] if len(dys) == 1 else torch.cat(dys)
            x = xs[0] if len(xs) == 1 else torch.cat(xs)
            products.append((part, kernels.weight_gradient(dy, x) if fast else dy.t().mm(x)))
            deferred_counts["products"] += 1
        shape = ctx.shape
        dw = products[0][1]
        if len(products) == 1 and dw.numel() == shape.numel():
            return dw.reshape(shape), None
        out = dw.new_zeros(shape)  # a matrix no launch handed in gets no gradient: zeros
        for part, dw in products:
            out[part] = dw
        return out, None
