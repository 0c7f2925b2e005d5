"""Fused Tree-LSTM cells with a hand-written batched backward: `fb.nn.TreeLSTMCell`'s N-ary
cell, its leaf and the child-sum cell, as kernels of a whole launch.

A launch of the N-ary cell (children's `[h; c]` each [B, 2H]) is, forward: the children's h
side by side (one copy, [B, N H]), the gate GEMMs (`iou` = children U_iou^T: one product, with
x W_iou^T added in as its post-op where there is a node input; the forget gates
`f_k` = h_k U_f[k]^T: a product per child), then ONE pass in the core (csrc/tree_lstm.cpp) for
all the elementwise work: biases, sigmoid and tanh, c = i*u + sum_k f_k*c_k, tanh(c), h.
Backward is one core pass for every elementwise gradient (the pre-activations', the children's
dc, the biases' as column sums), then the dX GEMMs (each child's dh = d_iou U_iou_k +
d_f_k U_f[k]) through `kernels.product` (oneDNN where it pays on this CPU). Each weight's
dW = dY^T X is handed to its WeightGrad (weight_grads.py), which computes it ONCE over every
launch of the graph (`kernels.weight_gradient`); outside a graph's execution, per launch.
Saved for backward: the children's h side by side (dW's operand), the activated gates,
tanh(c), and the children's own tensors (their c; no copy). Under autograd, the torch ops of
the same cell were ~25 ops forward and ~20 autograd nodes per launch, each a pass over memory
and a dispatch, and torch.tanh alone took 2 ns an element on the benchmark machine. The
child-sum cell is the same around its own products (the sum of each node's h by
`index_add_`, then x W^T and that sum U_iou^T; every child's h U_f^T), its pass walking each
node's children.

Why not ONE product for all the gates: the forget gates read one child each (U_f[k] h_k), so a
single [B, N H] x [N H, 3H + N H] product would multiply the off-diagonal blocks of a
block-diagonal weight, +25% FLOPs for a binary cell, on a step that is mostly GEMM time; and
a per-child product with [U_iou_k; U_f[k]] stacked needs a copy of the weights per launch (or
per parameter version) and its dW split back.

The core's float32 sigmoid and tanh are its own (branch-free, vectorised; within a few ulp of
torch's); float64 calls std::exp and std::tanh. Its backward is `once_differentiable`: a
double backward through it raises instead of being wrong.

The path: `set_tree_lstm("fused" | "torch")` or the environment variable FLYBATCH_TREE_LSTM.
"fused" (the default) applies to CPU tensors of float32 or float64; elsewhere, and under
"torch", the cells run as torch ops under autograd (fb.nn's `_nary_kernel`,
`_tree_leaf_kernel`, `_child_sum_kernel`). `tree_lstm_counts` counts the launches per path, so
a benchmark can say which ran."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from . import _core, kernels, weight_grads

TREE_LSTM_PATHS = ("fused", "torch")
tree_lstm_counts: dict[str, int] = {"fused": 0, "torch": 0}
_path = kernels.KernelChoice("set_tree_lstm", "path", TREE_LSTM_PATHS, "FLYBATCH_TREE_LSTM",
                             "fused")


def set_tree_lstm(path: str) -> None:
    """Force the Tree-LSTM cells' kernels: "fused" (this module's, where they apply) or
    "torch" (torch ops under autograd)."""
    _path.set(path)


def get_tree_lstm() -> str:
    return _path.get()


def fused(*tensors: torch.Tensor) -> bool:
    """Whether a launch over these operands runs the fused kernels (counted in
    `tree_lstm_counts`): path "fused", CPU tensors of one dtype, float32 or float64."""
    dtype = tensors[0].dtype
    applies = _path.choice == "fused" and dtype in (
        torch.float32, torch.float64) and all(
        t.device.type == "cpu" and t.dtype == dtype for t in tensors)
    tree_lstm_counts["fused" if applies else "torch"] += 1
    return applies


# The launches' parameters are batches of one ([1, ...]), as kernels get them: the Functions
# take them so, and index the parameter inside their forward (a squeeze outside would be one
# more autograd node per parameter and launch: 72 a step of the treelstm benchmark). Inside a
# graph's execution a weight's gradient is deferred to one product over all launches
# (weight_grads.py): the Function then gets the WeightGrad's token in the weight's place.
def _slots(*weights: torch.Tensor | None) -> tuple[list, tuple]:
    """Each weight's argument for a Function and its WeightGrad: (token, WeightGrad) where its
    gradient is deferred, else (the weight, None)."""
    args, grads = [], []
    for w in weights:
        wg = None if w is None else weight_grads.weight_grad_of(w)
        args.append(w if wg is None else wg.token)
        grads.append(wg)
    return args, tuple(grads)


def _weight(arg: torch.Tensor | None, wg) -> torch.Tensor | None:
    """In a forward: the matrix of a weight argument (`_slots`), its batch of one indexed."""
    return None if arg is None else (arg if wg is None else wg.weight)[0]


def _weight_gradient(wg, need: bool, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """In a backward: a weight's gradient dY^T X as a batch of one, or None where it is not
    needed or is deferred (handed to its WeightGrad, which computes it once for all launches)."""
    if not need:
        return None
    if wg is not None:
        wg.add(dy, x, (0,))
        return None
    return kernels.weight_gradient(dy, x).unsqueeze(0)


def leaf(x: torch.Tensor, w_iou: torch.Tensor, b_iou: torch.Tensor) -> torch.Tensor:
    """A launch of the leaf (`Leaf`), its product counted in `kernels.flops`."""
    kernels.flops.add(x.shape[0] * w_iou.shape[1], x.shape[1], x, w_iou)
    (w_arg,), grads = _slots(w_iou)
    return Leaf.apply(x, w_arg, b_iou, grads)


def nary(hcs: Sequence[torch.Tensor], x: torch.Tensor | None, u_iou: torch.Tensor,
         u_f: torch.Tensor, b_iou: torch.Tensor, b_f: torch.Tensor,
         w_iou: torch.Tensor | None) -> torch.Tensor:
    """A launch of the N-ary cell (`Nary`), its products counted in `kernels.flops` as the
    torch ops count them."""
    rows = max(t.shape[0] for t in (*hcs, *([] if x is None else [x])))
    H = u_f.shape[-1]
    children = next((hc for hc in hcs if hc.requires_grad), hcs[0])  # cat(h)'s grad: any
    kernels.flops.add(rows * u_iou.shape[1], u_iou.shape[2], children, u_iou)
    for hc in hcs:
        kernels.flops.add(rows * H, H, hc, u_f)
    if x is not None:
        kernels.flops.add(rows * w_iou.shape[1], w_iou.shape[2], x, w_iou)
        if x.shape[0] != rows:  # one node input that every node reads
            x = x.expand(rows, -1)
    (u_iou, u_f, w_iou), grads = _slots(u_iou, u_f, w_iou)
    return Nary.apply(x, u_iou, u_f, b_iou, b_f, w_iou, grads, *map(_rows_of_columns, hcs))


def child_sum(x: torch.Tensor, hc: torch.Tensor | None, lengths: np.ndarray,
              w_iou: torch.Tensor, u_iou: torch.Tensor, w_f: torch.Tensor, u_f: torch.Tensor,
              b_iou: torch.Tensor, b_f: torch.Tensor) -> torch.Tensor:
    """A launch of the child-sum cell (`ChildSum`; `Leaf` where no node has children): node r
    has the `lengths[r]` next rows of `hc` (every node's children's [h; c], flat; one row
    that every child is), its products counted in `kernels.flops` as the torch ops count them."""
    if hc is None:
        return leaf(x, w_iou, b_iou)
    B, M, H = x.shape[0], int(lengths.sum()), u_f.shape[-1]
    for rows, w, operand in ((B, w_iou, x), (B, u_iou, hc), (B, w_f, x), (M, u_f, hc)):
        kernels.flops.add(rows * w.shape[1], w.shape[2], operand, w)
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    node = torch.repeat_interleave(torch.arange(B), torch.from_numpy(lengths))
    weights, grads = _slots(w_iou, u_iou, w_f, u_f)
    return ChildSum.apply(offsets, node, x, *weights, b_iou, b_f, grads, _rows_of_columns(hc))


def _batch_of_one(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter's gradient as the gradient of its [1, ...] batch."""
    return None if grad is None else grad.unsqueeze(0)


def _rows_of_columns(hc: torch.Tensor) -> torch.Tensor:
    """`hc` with adjacent columns, as the core's passes read each row (a copy only where not)."""
    return hc if hc.stride(1) == 1 else hc.contiguous()


def _c_side(hc: torch.Tensor, rows: int, H: int) -> tuple[int, int]:
    """The address of a child's c (its `[h; c]` from column H) and its row stride, 0 where one
    row serves every node of the launch."""
    return hc.data_ptr() + H * hc.element_size(), (hc.stride(0) if hc.shape[0] == rows else 0)


def _activate(iou: torch.Tensor, b_iou: torch.Tensor, f: torch.Tensor | None,
              b_f: torch.Tensor | None, hcs: Sequence[torch.Tensor]) -> tuple:
    """The core's forward pass over pre-activations `iou` [B, 3H] and `f` [N, B, H] (activated
    in place): the output [B, 2H] and tanh(c) [B, H]."""
    rows, H = iou.shape[0], iou.shape[1] // 3
    out, tanh_c = iou.new_empty(rows, 2 * H), iou.new_empty(rows, H)
    children = [v for hc in hcs for v in _c_side(hc, rows, H)]
    _core.tree_lstm_forward(iou.data_ptr(), b_iou.data_ptr(), 0 if f is None else f.data_ptr(),
                            0 if b_f is None else b_f.data_ptr(), out.data_ptr(),
                            tanh_c.data_ptr(), rows, H, iou.dtype == torch.float64, *children)
    return out, tanh_c


def _gradients(grad: torch.Tensor, iou: torch.Tensor, f: torch.Tensor | None,
               tanh_c: torch.Tensor, hcs: Sequence[torch.Tensor]) -> tuple:
    """The core's backward pass: d_iou [B, 3H], d_f [N, B, H], the biases' gradients, and per
    child a fresh [B, 2H] gradient whose c side is filled (its h side is the caller's)."""
    rows, H = iou.shape[0], iou.shape[1] // 3
    grad = grad.contiguous()
    d_iou = kernels.empty_rows(rows, 3 * H, iou)  # dX's operand: no padded copy
    d_f = None if f is None else torch.empty_like(f)
    db_iou, db_f = iou.new_empty(3 * H), iou.new_empty(H)
    d_hcs = [iou.new_empty(rows, 2 * H) for _ in hcs]
    item = iou.element_size()
    children = []
    for hc, d_hc in zip(hcs, d_hcs):
        children += [*_c_side(hc, rows, H), d_hc.data_ptr() + H * item, 2 * H]
    _core.tree_lstm_backward(iou.data_ptr(), 0 if f is None else f.data_ptr(),
                             tanh_c.data_ptr(), grad.data_ptr(), d_iou.data_ptr(),
                             0 if d_f is None else d_f.data_ptr(), db_iou.data_ptr(),
                             db_f.data_ptr(), rows, H, iou.dtype == torch.float64, *children)
    return d_iou, d_f, db_iou, db_f, d_hcs


class Leaf(torch.autograd.Function):
    """`apply(x [B, D], W_iou [1, 3H, D], b_iou [1, 3H], grads)`: the leaf's `[h; c]` [B, 2H],
    with c = sigmoid(i) * tanh(u), h = sigmoid(o) * tanh(c); `grads`: W_iou's WeightGrad or
    None (`_slots`). Saved: x, the gates, tanh(c)."""

    @staticmethod
    def forward(ctx, x, w_iou, b_iou, grads=(None,)):
        w_iou, b_iou = _weight(w_iou, grads[0]), b_iou[0]
        iou = kernels.product(x, w_iou)
        out, tanh_c = _activate(iou, b_iou.contiguous(), None, None, ())
        ctx.save_for_backward(x, w_iou, iou, tanh_c)
        ctx.grads = grads
        return out

    @staticmethod
    @once_differentiable  # the core's pass is outside autograd: no double backward through it
    def backward(ctx, grad):
        x, w_iou, iou, tanh_c = ctx.saved_tensors
        d_iou, _, db_iou, _, _ = _gradients(grad, iou, None, tanh_c, ())
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = kernels.product(d_iou, w_iou.t()) if need_x else None
        dw = _weight_gradient(ctx.grads[0], need_w, d_iou, x)
        return dx, dw, _batch_of_one(db_iou if need_b else None), None


class Nary(torch.autograd.Function):
    """`apply(x or None, U_iou [1, 3H, N H], U_f [1, N, H, H], b_iou [1, 3H], b_f [1, H],
    W_iou [1, 3H, D] or None, grads, *hcs)`: the N-ary cell's `[h; c]` [B, 2H] over the
    children's `[h; c]` (each [B, 2H], or [1, 2H]: one child every node reads), with the node
    inputs x [B, D] if given; `grads`: the WeightGrads of U_iou, U_f, W_iou or None
    (`_slots`)."""

    @staticmethod
    def forward(ctx, x, u_iou, u_f, b_iou, b_f, w_iou, grads, *hcs):
        u_iou, u_f, w_iou = (_weight(w, wg) for w, wg in zip((u_iou, u_f, w_iou), grads))
        b_iou, b_f = b_iou[0], b_f[0]
        n, H = len(hcs), u_f.shape[-1]
        rows = max(t.shape[0] for t in (*hcs, *([] if x is None else [x])))
        children = torch.cat([hc[:, :H].expand(rows, H) for hc in hcs], 1,
                             out=kernels.empty_rows(rows, n * H, hcs[0]))  # [B, N H]
        iou = kernels.product(children, u_iou, add=None if x is None else kernels.product(
            x, w_iou))
        f = torch.stack([kernels.product(children[:, k * H:(k + 1) * H], u_f[k])
                         for k in range(n)])  # [N, B, H]
        out, tanh_c = _activate(iou, b_iou.contiguous(), f, b_f.contiguous(), hcs)
        ctx.save_for_backward(children, x, u_iou, u_f, w_iou, iou, f, tanh_c, *hcs)
        ctx.grads = grads
        return out

    @staticmethod
    @once_differentiable  # the core's pass is outside autograd: no double backward through it
    def backward(ctx, grad):
        children, x, u_iou, u_f, w_iou, iou, f, tanh_c, *hcs = ctx.saved_tensors
        n, H = len(hcs), u_f.shape[-1]
        d_iou, d_f, db_iou, db_f, d_hcs = _gradients(grad, iou, f, tanh_c, hcs)
        need = ctx.needs_input_grad
        # Each child's dh, written into its gradient's h side: d_iou U_iou_k (all children's
        # in one product), plus d_f_k U_f[k].
        dh = kernels.product(d_iou, u_iou.t())
        for k, d_hc in enumerate(d_hcs):
            d_hc[:, :H] = kernels.product(d_f[k], u_f[k].t(), add=dh[:, k * H:(k + 1) * H])
        d_hcs = [d if hc.shape[0] == d.shape[0] else d.sum(0, keepdim=True)
                 for hc, d in zip(hcs, d_hcs)]
        dx = kernels.product(d_iou, w_iou.t()) if x is not None and need[0] else None
        grads = ctx.grads
        du_iou = _weight_gradient(grads[0], need[1], d_iou, children)
        du_f = None
        if need[2]:  # each child's U_f[k]: d_f[k]^T h_k
            parts = [(d_f[k], children[:, k * H:(k + 1) * H]) for k in range(n)]
            if grads[1] is not None:
                for k, (dy, h) in enumerate(parts):
                    grads[1].add(dy, h, (0, k))
            else:
                du_f = torch.stack([kernels.weight_gradient(dy, h) for dy, h in parts])[None]
        dw_iou = _weight_gradient(grads[2], x is not None and need[5], d_iou, x)
        biases = (db_iou if need[3] else None, db_f if need[4] else None)
        return (dx, du_iou, du_f, *map(_batch_of_one, biases), dw_iou, None, *d_hcs)


class ChildSum(torch.autograd.Function):
    """`apply(offsets, node, x [B, D], W_iou, U_iou, W_f, U_f, b_iou, b_f (each [1, ...]), grads,
    hc)` (`grads`: the four weights' WeightGrads or None, `_slots`): the child-sum cell's
    `[h; c]` [B, 2H], node r's children the rows offsets[r]..offsets[r + 1] - 1 of `hc` [M, 2H]
    (or [1, 2H]: one row every child is), `node` the node of each child:
        i, o, u from W_iou x + U_iou sum_m h_m + b_iou;  f_m = sigmoid(W_f x + U_f h_m + b_f).
    Saved: x, the sum of each node's h, the gates, tanh(c) and `hc` itself."""

    @staticmethod
    def forward(ctx, offsets, node, x, w_iou, u_iou, w_f, u_f, b_iou, b_f, grads, hc):
        w_iou, u_iou, w_f, u_f = (_weight(w, wg) for w, wg in zip((w_iou, u_iou, w_f, u_f), grads))
        b_iou, b_f = b_iou[0], b_f[0]
        B, M, H = x.shape[0], node.shape[0], u_f.shape[-1]
        h = hc[:, :H].expand(M, H)
        h_sum = h.new_zeros(B, H).index_add_(0, node, h)
        iou = kernels.product(h_sum, u_iou, add=kernels.product(x, w_iou))
        fx = kernels.product(x, w_f, b_f)  # the forget gates' node part, bias included
        f = kernels.product(h, u_f)
        out, tanh_c = iou.new_empty(B, 2 * H), iou.new_empty(B, H)
        _core.tree_lstm_child_sum_forward(
            iou.data_ptr(), b_iou.contiguous().data_ptr(), f.data_ptr(), fx.data_ptr(),
            out.data_ptr(), tanh_c.data_ptr(), *_c_side(hc, M, H), offsets.data_ptr(), B, H,
            iou.dtype == torch.float64)
        ctx.save_for_backward(offsets, node, x, h_sum, w_iou, u_iou, w_f, u_f, iou, f, tanh_c,
                              hc)
        ctx.grads = grads
        return out

    @staticmethod
    @once_differentiable  # the core's pass is outside autograd: no double backward through it
    def backward(ctx, grad):
        offsets, node, x, h_sum, w_iou, u_iou, w_f, u_f, iou, f, tanh_c, hc = ctx.saved_tensors
        B, M, H = x.shape[0], node.shape[0], u_f.shape[-1]
        grad = grad.contiguous()
        d_iou, d_f, d_fx = torch.empty_like(iou), torch.empty_like(f), iou.new_empty(B, H)
        db_iou, db_f = iou.new_empty(3 * H), iou.new_empty(H)
        d_hc = iou.new_empty(M, 2 * H)
        _core.tree_lstm_child_sum_backward(
            iou.data_ptr(), f.data_ptr(), tanh_c.data_ptr(), grad.data_ptr(), d_iou.data_ptr(),
            d_f.data_ptr(), d_fx.data_ptr(), db_iou.data_ptr(), db_f.data_ptr(),
            *_c_side(hc, M, H), d_hc.data_ptr() + H * iou.element_size(), 2 * H,
            offsets.data_ptr(), B, H, iou.dtype == torch.float64)
        need = ctx.needs_input_grad[2:]
        # Each child's dh: its node's d_iou U_iou (the sum's gradient) plus its d_f U_f.
        d_hc[:, :H] = kernels.product(
            d_f, u_f.t(), add=kernels.product(d_iou, u_iou.t()).index_select(0, node))
        if hc.shape[0] != M:
            d_hc = d_hc.sum(0, keepdim=True)
        dx = kernels.product(d_fx, w_f.t(), add=kernels.product(d_iou, w_iou.t())) \
            if need[0] else None
        weights = zip(ctx.grads, need[1:5], (d_iou, d_iou, d_fx, d_f),
                      (x, h_sum, x, hc[:, :H].expand(M, H)))
        biases = (db_iou if need[5] else None, db_f if need[6] else None)
        return (None, None, dx, *(_weight_gradient(*w) for w in weights),
                *map(_batch_of_one, biases), None, d_hc)
