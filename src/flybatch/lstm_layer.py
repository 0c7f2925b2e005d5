"""The batched kernel of an LSTM layer (`fb.nn.LSTM`'s `lstm_layer` node), on one of two paths.

The node's kernel gets every instance's sequence at once, `x` [B, T, D] padded with zeros past
each one's length, and returns the h of every step [B, T, H], zeros past each end.

* "onednn": torch's LSTM (oneDNN's RNN primitive on CPU, cuDNN on CUDA). It runs every row to
  the call's longest length, so sequences of very different lengths run in groups of similar
  length (`_length_groups`), one call each, and padding stays under a third of a group's steps.
* "stepwise": `StepwiseLSTM`, a hand-written layer. The rows sorted by length, the batch active
  at step t is a prefix of the one at t - 1 (a PackedSequence's time-major layout), so nothing
  runs past a sequence's end and there is one call for any mix of lengths. The input
  projection of all steps is ONE GEMM; per step, one product of the active prefix's h with
  W_hh added to its gates and one pass in the core (csrc/lstm.cpp) for the gates' activations,
  c, tanh(c) and h; backward per step one pass in the core and one GEMM for dh, then dW_hh,
  dW_ih and dX each ONE GEMM over all steps (the products through `kernels.product` and
  `kernels.weight_gradient`). The core's float32 sigmoid and tanh are its own (vectorised,
  within a few ulp of torch's, whose tanh costs ~2 ns an element on the benchmark machine).

Where the time goes (one AMD EPYC core, 1 thread, the benchmarks' minibatches, forward +
backward of one direction, ms, 2026-11-23): the GEMMs of the stepwise layer alone, without any
elementwise work, take 30 for the parser's shape (B 64, D 125, H 200, lengths 2-56), 66 for
bilstm's (D = H = 256, lengths 8-66), 11 for the char LSTM's (B ~190, D 64, H 128, lengths
1-16) and 97 for bilstm-synthetic's first layer (D 200, H 256, all 40 steps): the per-step
products of a few dozen rows run at ~50 GFLOP/s, not at the ~85 of large ones, and they are
most of the work. oneDNN took 40, 89, 21 and 102; stepwise 33, 83, 15 and 123 (medians of
processes alternated three times each; the last pair interleaved in one process). So oneDNN
loses where lengths differ (its groups pad, and each group is a call of its own with a shorter
batch) and wins where they are all equal: one call, no padding, at the GEMM bound, where the
stepwise layer's per-step torch ops cost more than oneDNN's fused cell.

The path: `set_lstm("auto" | "onednn" | "stepwise")` or the environment variable FLYBATCH_LSTM.
"auto" (the default) takes stepwise on CPU where the lengths of the batch differ, oneDNN
(cuDNN) where they are equal or on another device, and oneDNN in float32 also where lengths
differ in evaluation (no gradient recorded) on a CPU whose oneDNN products run `ONEDNN_FASTER`
times faster than torch's default (`kernels.onednn_speedup()`, measured once per process).
The numbers above are from hosts where the two ran at about the same speed. On the host of
2026-11-24 oneDNN's products ran 2.3x faster than MKL's: with the stepwise layer's products
on MKL, oneDNN's RNN primitive trained the bilstm tasks 20-30% faster; with them through
`kernels.product` (oneDNN too), the stepwise layer trained 6-8% faster again (paired step CPU
ratios stepwise/oneDNN, one process alternating per minibatch, core 1, 05:05 UTC: bilstm
0.921 and 0.933, bilstm-char 0.942; all-equal bilstm-synthetic 1.101), while in evaluation,
with no backward to share the per-step cost of the stepwise forward, oneDNN still won (bilstm
eval 1.168). Stepwise needs a CPU tensor of float32 or float64 (its backward's elementwise
pass is the core's); elsewhere even a forced "stepwise" runs oneDNN/cuDNN. `lstm_counts` counts
the launches per path, so a benchmark can say which ran.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from . import _core, kernels

LSTM_PATHS = ("auto", "onednn", "stepwise")
lstm_counts: dict[str, int] = {"onednn": 0, "stepwise": 0}
_path = kernels.KernelChoice("set_lstm", "path", LSTM_PATHS, "FLYBATCH_LSTM", "auto")


def set_lstm(path: str) -> None:
    """Force the LSTM layer's kernel: "onednn" (torch's LSTM: oneDNN, cuDNN), "stepwise"
    (`StepwiseLSTM`, where it applies) or "auto" (stepwise where lengths differ on CPU, except
    in evaluation where oneDNN's products are much faster)."""
    _path.set(path)


def get_lstm() -> str:
    return _path.get()


def kernel(xs, attr, shape, lengths):
    """Every sequence of the batch through the LSTM at once: `xs[0]` is the stacked inputs
    [B, T, D], padded with zeros past each sequence's length (`lengths`; None: all T)."""
    x, w_ih, w_hh, bias = xs[0], xs[1][0], xs[2][0], xs[3][0]
    _count_products(x, w_ih, w_hh, lengths)
    if _stepwise(x, lengths):
        lstm_counts["stepwise"] += 1
        steps = np.full(x.shape[0], x.shape[1]) if lengths is None else lengths
        return StepwiseLSTM.apply(_Packing(steps, x.shape[1], x.device), x, w_ih, w_hh, bias)
    lstm_counts["onednn"] += 1
    if lengths is None:  # all of one length
        return _torch_lstm(x, w_ih, w_hh, bias)
    groups = _LengthGroups(lengths, x.shape[1], x.device)
    inputs = _SplitGroups.apply(groups, x)
    return _JoinGroups.apply(groups, *[_torch_lstm(g, w_ih, w_hh, bias) for g in inputs])


# oneDNN's products this many times faster than the default's: in evaluation its RNN primitive
# wins over the stepwise layer even where it pads.
ONEDNN_FASTER = 1.6


def _stepwise(x: torch.Tensor, lengths: np.ndarray | None) -> bool:
    applies = x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)
    if _path.choice == "auto":
        evaluation = not torch.is_grad_enabled()
        return applies and lengths is not None and not (
            evaluation and x.dtype == torch.float32
            and kernels.onednn_speedup() >= ONEDNN_FASTER)
    return applies and _path.choice == "stepwise"


def _count_products(x, w_ih, w_hh, lengths) -> None:
    """The cell's products at each valid step (not the padding), as the cell step by step
    counts them: the input's, and the state's, whose gradient autograd records after the first
    step (the zero state has none) when the weights' is."""
    B, gates, H = x.shape[0], w_ih.shape[0], w_hh.shape[1]
    steps = int(lengths.sum()) if lengths is not None else B * x.shape[1]
    kernels.flops.add(steps * gates, w_ih.shape[1], x, w_ih)
    kernels.flops.add(B * gates, H, w_hh)
    kernels.flops.add((steps - B) * gates, H, w_hh, w_ih)


# ---- stepwise ------------------------------------------------------------------------------------
class _Packing:
    """The rows of a padded batch [B, T, ...] sorted by length, longest first, in time-major
    packed order: step t's rows are the first `batch_sizes[t]` of the sorted ones, at rows
    `offsets[t]`... of the packed [sum(lengths), ...]. `index`: each packed row's row of the
    batch's [B * T, ...]; `previous`: the packed row of each step-t row's step t - 1 (t >= 1)."""

    __slots__ = ("B", "T", "batch_sizes", "offsets", "index", "previous")

    def __init__(self, lengths: np.ndarray, T: int, device: torch.device):
        order = np.argsort(-lengths, kind="stable")
        longest = int(lengths[order[0]])
        self.B, self.T = len(lengths), T
        self.batch_sizes = np.count_nonzero(lengths[None, :] > np.arange(longest)[:, None], 1)
        self.offsets = np.concatenate([[0], np.cumsum(self.batch_sizes)])
        steps = np.repeat(np.arange(longest), self.batch_sizes)
        rank = np.arange(len(steps)) - self.offsets[steps]  # a row's place in its step
        self.index = torch.from_numpy(order[rank] * T + steps).to(device)
        later = steps > 0
        self.previous = torch.from_numpy(self.offsets[steps[later] - 1] + rank[later]).to(device)
        self.batch_sizes, self.offsets = self.batch_sizes.tolist(), self.offsets.tolist()


class StepwiseLSTM(torch.autograd.Function):
    """`apply(packing, x [B, T, D], w_ih [4H, D], w_hh [4H, H], bias [4H])`: the h of every
    step [B, T, H] from a zero state, zeros past each row's end; gates in torch's order
    (i, f, g, o). Saved for backward: the packed input, the activated gates, c and tanh(c) of
    every step, and h (dW_hh's operand)."""

    @staticmethod
    def forward(ctx, packing: _Packing, x, w_ih, w_hh, bias):
        B, T, D = x.shape
        H = w_hh.shape[1]
        packed_x = x.reshape(B * T, D).index_select(0, packing.index)
        gates = kernels.product(packed_x, w_ih, bias)  # [N, 4H], activated in place below
        N = gates.shape[0]
        gates = gates.contiguous()  # (the core's pass reads rows of 4H)
        h, c, tanh_c = x.new_empty(N, H), x.new_empty(N, H), x.new_empty(N, H)
        offsets = packing.offsets
        item, double = gates.element_size(), gates.dtype == torch.float64
        a_gates, a_c, a_tanh_c, a_h = (t.data_ptr() for t in (gates, c, tanh_c, h))
        for t, rows in enumerate(packing.batch_sizes):
            row = offsets[t]
            if t:
                before = slice(offsets[t - 1], offsets[t - 1] + rows)
                a = gates[row:row + rows]
                a[:] = kernels.product(h[before], w_hh, add=a)
            # The gates activated in place, c, tanh(c) and h: one pass in the core.
            _core.lstm_forward_step(a_gates + row * 4 * H * item,
                                    a_c + offsets[t - 1] * H * item if t else 0,
                                    a_c + row * H * item, a_tanh_c + row * H * item,
                                    a_h + row * H * item, rows, H, double)
        ctx.packing = packing
        ctx.save_for_backward(packed_x, w_ih, w_hh, gates, c, tanh_c, h)
        return x.new_zeros(B * T, H).index_copy_(0, packing.index, h).view(B, T, H)

    @staticmethod
    @once_differentiable  # the core's pass is outside autograd: no double backward through it
    def backward(ctx, grad):
        packed_x, w_ih, w_hh, gates, c, tanh_c, h = ctx.saved_tensors
        packing = ctx.packing
        H, offsets, sizes = w_hh.shape[1], packing.offsets, packing.batch_sizes
        # dh of every step, the recurrent dh added in as the steps go back; fresh, contiguous.
        dh = grad.reshape(-1, H).index_select(0, packing.index)
        d_gates = torch.empty_like(gates)
        dc = gates.new_zeros(sizes[0], H)  # dc of step t + 1's rows; zeros past them
        addresses = [t.data_ptr() for t in (gates, tanh_c, c, dh, dc, d_gates)]
        a_gates, a_tanh_c, a_c, a_dh, a_dc, a_d_gates = addresses
        item, double = gates.element_size(), gates.dtype == torch.float64
        for t in range(len(sizes) - 1, -1, -1):
            rows, row = sizes[t], offsets[t]
            c_before = a_c + offsets[t - 1] * H * item if t else 0
            _core.lstm_backward_step(a_gates + row * 4 * H * item, a_tanh_c + row * H * item,
                                     c_before, a_dh + row * H * item, a_dc,
                                     a_d_gates + row * 4 * H * item, rows, H, double)
            if t:
                dh_before = dh[offsets[t - 1]:offsets[t - 1] + rows]
                dh_before[:] = kernels.product(d_gates[row:row + rows], w_hh.t(), add=dh_before)
        need_x, need_ih, need_hh, need_bias = ctx.needs_input_grad[1:]
        dx = dw_ih = dw_hh = dbias = None
        if need_x:
            packed_dx = kernels.product(d_gates, w_ih.t())
            dx = packed_dx.new_zeros(packing.B * packing.T, packed_dx.shape[1])
            dx = dx.index_copy_(0, packing.index, packed_dx).view(packing.B, packing.T, -1)
        if need_ih:
            dw_ih = kernels.weight_gradient(d_gates, packed_x)
        if need_hh:
            dw_hh = kernels.weight_gradient(d_gates[sizes[0]:],
                                            h.index_select(0, packing.previous))
        if need_bias:
            dbias = d_gates.sum(0)
        return None, dx, dw_ih, dw_hh, dbias


# ---- oneDNN / cuDNN ------------------------------------------------------------------------------


def _length_groups(lengths: np.ndarray, ratio: float = 1.5) -> list[np.ndarray]:
    """Rows by length, longest first: a row joins the current group while its length is at
    least the group's longest / ratio, so padding is under a third of any group's steps."""
    order = np.argsort(-lengths, kind="stable")
    groups, start = [], 0
    while start < len(order):
        end, top = start, lengths[order[start]]
        while end < len(order) and lengths[order[end]] * ratio >= top:
            end += 1
        groups.append(order[start:end])
        start = end
    return groups


def _torch_lstm(x: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor,
                bias: torch.Tensor) -> torch.Tensor:
    """torch's LSTM (oneDNN's RNN primitive on CPU, cuDNN on CUDA) over `x` [B, T, D] from a
    zero state, with the cell's single bias: the h of every step, [B, T, H]."""
    h0 = x.new_zeros(1, x.shape[0], w_hh.shape[1])
    return torch.lstm(x, (h0, h0), (w_ih, w_hh, bias, torch.zeros_like(bias)), True, 1, 0.0,
                      False, False, True)[0]


class _LengthGroups:
    """The rows of a padded batch [B, T, ...] in groups of similar length (`_length_groups`):
    each group's rows and longest length, and the steps of its shorter rows past their own
    ends (a group runs to its longest length; the result has zeros there)."""

    __slots__ = ("members", "longest", "past_end", "past_end_in_group", "B", "T")

    def __init__(self, lengths: np.ndarray, T: int, device: torch.device):
        self.B, self.T = len(lengths), T
        self.members, self.longest, self.past_end_in_group, past_end = [], [], [], []
        for group in _length_groups(lengths):
            longest = int(lengths[group[0]])
            self.members.append(torch.from_numpy(group).to(device))
            self.longest.append(longest)
            # (row, step) past its row's end, as a flat row of the group's [n * longest, ...]
            # and of the batch's [B * T, ...]
            rows, steps = np.nonzero(np.arange(longest)[None, :] >= lengths[group][:, None])
            self.past_end_in_group.append(torch.from_numpy(rows * longest + steps).to(device))
            past_end.append(group[rows] * T + steps)
        self.past_end = torch.from_numpy(np.concatenate(past_end)).to(device)

    def split(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each group's rows of `t` [B, T, ...], cut at its longest length."""
        return tuple(t[:, :longest].index_select(0, members)
                     for members, longest in zip(self.members, self.longest))

    def join(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The groups' [n, longest, ...] back in one [B, T, ...], zeros past each row's end."""
        out = parts[0].new_zeros(self.B, self.T, *parts[0].shape[2:])
        for part, members, longest in zip(parts, self.members, self.longest):
            out[:, :longest].index_copy_(0, members, part)
        out.view(self.B * self.T, -1).index_fill_(0, self.past_end, 0.0)
        return out


class _SplitGroups(torch.autograd.Function):
    """`groups.split(x)`; backward joins the groups' gradients into one tensor (instead of a
    zero-filled copy of x per group, as the selects' own backward would make)."""

    @staticmethod
    def forward(ctx, groups, x):
        ctx.groups = groups
        return groups.split(x)

    @staticmethod
    def backward(ctx, *grads):
        return None, ctx.groups.join(grads)


class _JoinGroups(torch.autograd.Function):
    """`groups.join(parts)`; backward splits the gradient back into the groups, with zeros
    past each row's end (those outputs are the zeros of the join, not the group's)."""

    @staticmethod
    def forward(ctx, groups, *parts):
        ctx.groups = groups
        return groups.join(parts)

    @staticmethod
    def backward(ctx, grad):
        parts = ctx.groups.split(grad)  # fresh tensors: zeroed in place
        for part, past_end in zip(parts, ctx.groups.past_end_in_group):
            part.view(part.shape[0] * part.shape[1], -1).index_fill_(0, past_end, 0.0)
        return (None, *parts)
