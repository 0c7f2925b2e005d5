"""Batched kernels: the GEMM path of shared-weight products.

Every product with a shared parameter (`W @ x`, `affine`, the fused cells) goes through
`linear(x, W, b)`. On a CPU in float32 it can run through oneDNN with the weight prepacked into
oneDNN's blocked layout (`mkldnn._linear_pointwise`): packed once per parameter version (an
optimizer step makes a new version) and reused by every launch, backward's dX = dY W on the
packed transpose. In mode "auto" the path is chosen per shape class by a one-time calibration
against the default, forward and backward timed together for products autograd records.
float64, CUDA and non-parameter operands always take the default path (cuBLAS as is).

The default mode is "default" (torch's own product, MKL here), because oneDNN did not pay on
the benchmark machine (one AMD EPYC core, 2026-11-23): alone it is 5-25% faster per forward
GEMM (about 103-111 vs 85-101 GFLOP/s, the core's FMA peak being ~115) and 0-12% per
forward + backward, but in the benchmarks, alternating paths minibatch by minibatch in one
process, "auto" trained the Tree-LSTM at 0.97x and the BiLSTM tagger at 1.01x of "default".
The GEMMs there are a quarter to two fifths of a step, so the gain on paper is a few percent,
and in situ it is lost: oneDNN creates a primitive per new batch size (~0.5 ms each, and a
tree's batch sizes vary; warming up 12 minibatches with a large primitive cache did not change
the result), and, unmeasured, the packed copies add to the weights' cache footprint. "auto"
also makes results depend on a noisy timing. On a machine where oneDNN wins, opt in with
FLYBATCH_GEMM=auto. Measured again on 2026-11-24 on a host where a repeated oneDNN product
ran 2.3x faster than MKL's (~245 vs ~108 GFLOP/s): "onednn" still trained the Tree-LSTM at the
default's speed (step CPU 74.3 vs 74.4 / 74.7 ms, the cells as torch ops), a primitive per new
batch shape eating the gain; that host's advantage went to the LSTM layers instead
(lstm_layer.py uses `onednn_speedup` below).

`set_gemm("default" | "auto" | "onednn")` (or the environment variable FLYBATCH_GEMM) picks
the mode; `gemm_counts` counts launches per path, so a benchmark can say which one ran.

`flops` counts the model FLOPs of the matrix products (these, the fused cells' other products,
the batched `matmul` and attention kernels) where they run, so that a benchmark can divide a
step's FLOPs by its time and compare with the machine's GEMM peak.
"""

from __future__ import annotations

import os
import time
import weakref
from typing import Callable

import torch
import torch.nn.functional as F

class KernelChoice:
    """Which implementation a family of kernels runs, one of `choices`: forced by the user
    (`set`, or the environment variable `variable` at import) or "auto", the library's rule.
    The GEMM path here and the LSTM layer's (lstm_layer.py) are two."""

    def __init__(self, setter: str, noun: str, choices: tuple[str, ...], variable: str,
                 default: str):
        self.setter, self.noun, self.choices = setter, noun, choices
        self.set(os.environ.get(variable, default))

    def set(self, choice: str) -> None:
        if choice not in self.choices:
            raise ValueError(f"{self.setter}: {self.noun} must be one of {self.choices}, "
                             f"got {choice!r}")
        self.choice = choice

    def get(self) -> str:
        return self.choice


GEMM_MODES = ("default", "auto", "onednn")
gemm_counts: dict[str, int] = {"default": 0, "onednn": 0}
_gemm = KernelChoice("set_gemm", "mode", GEMM_MODES, "FLYBATCH_GEMM", "default")
# (m bucket, k, n, transposed, with backward) -> "default" | "onednn", measured once per process.
_decisions: dict[tuple[int, int, int, bool, bool], str] = {}


def set_gemm(mode: str) -> None:
    """Force the GEMM path of shared-weight products: "default" (torch's own: MKL, cuBLAS),
    "onednn" (prepacked oneDNN wherever it applies) or "auto" (the faster, per shape class)."""
    _gemm.set(mode)


def get_gemm() -> str:
    return _gemm.get()


# ---- model FLOPs ----------------------------------------------------------------------------------
class FlopCounter:
    """The FLOPs of the matrix products run since `reset()`: 2k per dot product of length k (a
    product [m, k] x [k, n] has m*n of them), and as much again for each operand whose gradient
    autograd records (backward's dX = dY W and dW = dY^T X are products of the same size),
    counted when the forward runs, backward or not. Elementwise work (biases, activations,
    sums, the loss) is not counted: the count is what a GEMM peak bounds."""

    __slots__ = ("total",)

    def __init__(self) -> None:
        self.total = 0

    def __repr__(self) -> str:
        return f"FlopCounter(total={self.total:,})"

    def reset(self) -> None:
        self.total = 0

    def add(self, products: int, k: int, *operands: torch.Tensor) -> None:
        """Count `products` dot products of length `k` of these operands."""
        grads = sum(t.requires_grad for t in operands) if torch.is_grad_enabled() else 0
        self.total += 2 * products * k * (1 + grads)


flops = FlopCounter()


# ---- packed weights, one per parameter version ------------------------------------------------
class _Pack:
    """A parameter's oneDNN-packed weight (and its transpose, for backward's dX = dY W) as of
    one version. `source` keeps the packed storage alive, so that an equal `data_ptr` can only
    mean the same storage, whose in-place writes bump the version counter."""

    __slots__ = ("source", "version", "packed", "packed_t")

    def __init__(self, source: torch.Tensor):
        self.source, self.version = source, source._version
        self.packed = self.packed_t = None


# id of a parameter -> its views' packs (a view: offset, shape, strides; a kernel may multiply
# by several views of one parameter, as by the slices of a stacked weight), dropped with the
# parameter.
_packs: dict[int, dict[tuple, _Pack]] = {}


def _root(w: torch.Tensor) -> torch.Tensor | None:
    """The parameter `w` is a view of (kernels see `W.unsqueeze(0)` squeezed), or None when `w`
    is a computed or per-instance matrix: packing one that lives for a single launch never pays."""
    root = w if w._base is None else w._base
    return root if root.is_leaf and root.requires_grad else None


def _packed(w: torch.Tensor, transposed: bool) -> torch.Tensor:
    root = _root(w)
    views = _packs.get(id(root))
    if views is None:
        views = _packs[id(root)] = {}
        weakref.finalize(root, _packs.pop, id(root), None)
    view = (w.storage_offset(), tuple(w.shape), w.stride())
    pack = views.get(view)
    if pack is None or pack.version != w._version or pack.source.data_ptr() != w.data_ptr():
        pack = views[view] = _Pack(w.detach())
    if transposed:
        if pack.packed_t is None:
            pack.packed_t = torch.ops.mkldnn._reorder_linear_weight(pack.source.t().contiguous())
        return pack.packed_t
    if pack.packed is None:
        pack.packed = torch.ops.mkldnn._reorder_linear_weight(pack.source)
    return pack.packed


def _onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
            transposed: bool = False) -> torch.Tensor:
    """`x @ w.T + b` (`x @ w` with `transposed`) through oneDNN with `w` prepacked."""
    return torch.ops.mkldnn._linear_pointwise(x, _packed(w, transposed), b, "none", [], "")


def _default(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
             transposed: bool = False) -> torch.Tensor:
    return F.linear(x, w.t() if transposed else w, b)


# ---- choosing the path ----------------------------------------------------------------------------
def _bucket(m: int) -> int:
    return 1 << max(m - 1, 0).bit_length()


_CALIBRATION_ROWS = 256


def _calibrate(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, transposed: bool,
               grad: bool) -> str:
    """The faster path on these very operands, forward and, for a product autograd records,
    backward too (the oneDNN path's autograd.Function costs ~20 us more per launch, which thin
    batches feel): best of three alternating runs each, the minimum because the machine is
    shared. Backward runs on detached copies, so no parameter's .grad is touched. At most
    `_CALIBRATION_ROWS` rows are timed: both paths' GFLOP/s are flat beyond, and timing all of
    a 2,000-row batch made the first minibatches of a benchmark pay over a second."""
    x = x[:_CALIBRATION_ROWS]
    if grad:
        x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
        b = None if b is None else b.detach()
        dy = torch.ones(x.shape[0], w.shape[0], dtype=x.dtype)
        paths: dict[str, Callable] = {
            "default": lambda: torch.autograd.grad(_default(x, w, b), (x, w), dy),
            "onednn": lambda: torch.autograd.grad(_Linear.apply(x, w, b), (x, w), dy)}
    else:
        paths = {name: lambda path=path: path(x, w, b, transposed)
                 for name, path in (("default", _default), ("onednn", _onednn))}
    with torch.enable_grad() if grad else torch.no_grad():
        best = _best_times(paths, 3)
    return min(best, key=best.get)


def _best_times(paths: dict[str, Callable], repeats: int) -> dict[str, float]:
    """Each path's best time of `repeats` runs, the paths alternating (the minimum, because
    the machine is shared)."""
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(repeats):
        for name, run in paths.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _path(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, transposed: bool,
          grad: bool) -> str:
    mode = _gemm.choice
    if mode == "default" or x.dtype != torch.float32 or x.device.type != "cpu" \
            or x.dim() != 2 or w.dim() != 2 or _root(w) is None \
            or transposed and grad:  # dX of a double backward: autograd must see the product
        return "default"
    if mode == "onednn":
        return "onednn"
    n, k = (w.shape[1], w.shape[0]) if transposed else w.shape
    key = (_bucket(x.shape[0]), k, n, transposed, grad)
    path = _decisions.get(key)
    if path is None:
        path = _decisions[key] = _calibrate(x, w, b, transposed, grad)
    return path


# ---- how this CPU's two GEMM libraries compare ---------------------------------------------
_onednn_speedup: float | None = None


def onednn_speedup() -> float:
    """How many times faster oneDNN's float32 product is than torch's default one (MKL) on this
    CPU, one thread, measured once per process (~10 ms): the best of 5 runs of each on a
    [256, 512] x [512, 1024] product with the weight prepacked. It differs by CPU more than by
    shape: on the AMD EPYC hosts of 2026-11-23 about 1.05-1.25x, on the one of 2026-11-24
    about 2.3x (MKL ~108 GFLOP/s, oneDNN ~245), which decides whether oneDNN's RNN primitive
    beats the stepwise LSTM layer (lstm_layer.py). 1.0 where oneDNN is not built in."""
    global _onednn_speedup
    if _onednn_speedup is None:
        _onednn_speedup = _measure_onednn_speedup()
    return _onednn_speedup


def _measure_onednn_speedup() -> float:
    if not torch.backends.mkldnn.is_available():
        return 1.0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            x, w = torch.randn(256, 512), torch.randn(1024, 512)
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
            paths = {"default": lambda: F.linear(x, w),
                     "onednn": lambda: torch.ops.mkldnn._linear_pointwise(
                         x, packed, None, "none", [], "")}
            for run in paths.values():
                run()  # the primitive, the caches
            best = _best_times(paths, 5)
            return best["default"] / best["onednn"]
    except RuntimeError:  # a build whose oneDNN lacks the packed product
        return 1.0
    finally:
        torch.set_num_threads(threads)


# ---- the product ----------------------------------------------------------------------------------
class _Linear(torch.autograd.Function):
    """`x @ w.T + b` with the forward and dX = dY W through packed oneDNN; dW = dY^T X stays
    on MKL's `mm`, as fast here as oneDNN and without the transposed copies oneDNN needs."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return _onednn(x, w, b)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _product(dy, w, None, transposed=True)
        if ctx.needs_input_grad[1]:
            dw = dy.t().mm(x)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0)
        return dx, dw, db


def _product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
             transposed: bool = False) -> torch.Tensor:
    grad = torch.is_grad_enabled() and (
        x.requires_grad or w.requires_grad or b is not None and b.requires_grad)
    path = _path(x, w, b, transposed, grad)
    gemm_counts[path] += 1
    if path == "default":
        return _default(x, w, b, transposed)
    return _Linear.apply(x, w, b) if grad else _onednn(x, w, b, transposed)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           model_flops: bool = True) -> torch.Tensor:
    """`x @ w.T + b` for a batch `x` [m, k] and a shared weight `w` [n, k], on the faster path.
    `model_flops=False`: a product the model did not write (projection.py's, which counts the
    model's products it replaces instead), left out of `flops`."""
    if model_flops:
        flops.add(x.shape[0] * w.shape[0], x.shape[1], x, w)
    return _product(x, w, b)
