"""Batched kernels: the GEMM path of matrix products.

Every product of a launch (`W @ x`, `affine`, the fused cells' gates and their backward) goes
through `product(x, W, b)` (`x @ W.T + b`, no autograd) or `linear(x, W, b)` (the same under
autograd, for shared parameters). On a CPU in float32 they run through oneDNN
(`mkldnn._linear_pointwise` on the operands as they are, any strides) where this CPU's oneDNN
is clearly faster than torch's default product (MKL here), and the product is big enough to
pay oneDNN's fixed cost per call; backward's dX = dY W and dW = dY^T X run the same way.
float64, CUDA, and everything in mode "default" take torch's own product (cuBLAS as is).

Why: on the benchmark host of 2026-11-24 (one AMD EPYC core) oneDNN's float32 product ran
2.0-2.5x faster than MKL's for every operand layout the kernels use (dense weights ~230-265
GFLOP/s, transposed operands for dX and dW ~200-265, MKL ~100-115), with a fixed cost of
~9.5 us a call against MKL's ~2 us: it wins from ~0.75M multiply-adds (4 x 256 x 768 broke
even). The treelstm benchmark's GEMMs were ~70% of its training step. On the earlier hosts of
2026-11-23 oneDNN was only 5-25% faster and did not pay in situ, so the choice is measured per
process (`onednn_speedup`, ~10 ms, once) rather than assumed. A parameter's views (the weight,
its transpose for dX) are packed into oneDNN's blocked layout once per parameter version
(`_packed`): a dense weight is reordered on every call (treelstm step CPU paired ratio packed /
dense 0.96-0.97 in training, 0.957 in evaluation; the parser level).

`set_gemm("default" | "auto" | "onednn")` (or the environment variable FLYBATCH_GEMM) picks
the mode: "auto" (the default) is the rule above, and respects `torch.backends.mkldnn.enabled`
(a user who turned oneDNN off gets none); "onednn" takes oneDNN for every float32 CPU product
(tests), "default" never. `gemm_counts` counts products per path, so a benchmark can
say which one ran.

Inside a graph's execution, `linear` defers a shared weight's gradient to one product over all
the graph's launches (weight_grads.py): its Function then computes dX and hands (dY, X) on.

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

from . import weight_grads


# `Function.apply` less its Python layers (capture/generic.py's check of every argument for an
# expression, then torch's default-argument and functorch checks): the C apply itself, which
# is what those layers call for a Function without `setup_context` when no functorch transform
# is active. Kernels apply a Function per launch (a sink read, a deferred product); the layers
# cost a fifth of it.
_c_apply = torch._C._FunctionBase.__dict__["apply"]


def apply_function(function: type, *args: object) -> object:
    """`function.apply(*args)`, through the C apply where no functorch transform is active."""
    if torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    return _c_apply.__get__(None, function)(*args)


class KernelChoice:
    """Which implementation a family of kernels runs, one of `choices`: forced by the user
    (`set`, or the environment variable `variable` at import) or "auto", the library's rule.
    The GEMM path here, the LSTM layer's (lstm_layer.py) and the Tree-LSTM cells'
    (tree_lstm.py) are three."""

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
_gemm = KernelChoice("set_gemm", "mode", GEMM_MODES, "FLYBATCH_GEMM", "auto")

# "auto" takes oneDNN where it is at least this many times faster than the default product on
# this CPU (`onednn_speedup`), for products of at least ONEDNN_MIN_MACS multiply-adds (below,
# its ~8 us more per call outweigh a 2.3x faster product; at a smaller speedup the break-even
# moves up, which the speedup threshold covers).
ONEDNN_FASTER = 1.3
ONEDNN_MIN_MACS = 1 << 20


def set_gemm(mode: str) -> None:
    """Force the GEMM path of the kernels' products: "default" (torch's own: MKL, cuBLAS),
    "onednn" (oneDNN for every float32 CPU product) or "auto" (oneDNN where it pays here)."""
    _gemm.set(mode)


def get_gemm() -> str:
    return _gemm.get()


# ---- model FLOPs --------------------------------------------------------------------------------
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


# ---- how this CPU's two GEMM libraries compare ---------------------------------------------
_onednn_speedup: float | None = None


def onednn_speedup() -> float:
    """How many times faster oneDNN's float32 product is than torch's default one (MKL) on this
    CPU, one thread, measured once per process (~10 ms): the best of 5 runs of each on a
    [256, 512] x [512, 1024] product. It differs by CPU more than by shape: on the AMD EPYC
    hosts of 2026-11-23 about 1.05-1.25x, on the one of 2026-11-24 about 2.3x (MKL ~108
    GFLOP/s, oneDNN ~245). It decides the GEMM path here and whether oneDNN's RNN primitive
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
            paths = {"default": lambda: F.linear(x, w), "onednn": lambda: _onednn(x, w, None)}
            for run in paths.values():
                run()  # the primitive, the caches
            best = _best_times(paths, 5)
            return best["default"] / best["onednn"]
    except RuntimeError:  # a build whose oneDNN lacks the product
        return 1.0
    finally:
        torch.set_num_threads(threads)


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


# ---- the products -------------------------------------------------------------------------------
# oneDNN creates (and JIT-compiles) a primitive per operand shape, ~0.4-1.6 ms each, once; a
# tree's batches have ever new row counts, so in situ every product paid it again (the
# treelstm step ran 10% SLOWER on oneDNN than on MKL; the same minibatch repeated ran 29%
# faster). So the row counts oneDNN sees are few: a product's rows are padded up to the next
# "bucket" (the row count with all but its top 4 bits rounded up: at most 12.5% more rows,
# ~6% on average, 8 buckets per doubling), and a weight gradient's rows (its sum) are cut
# down to one, the rest added on the default path. A model's products then need a few hundred
# primitives, which oneDNN's cache (1,024) keeps.
def _bucket_above(rows: int) -> int:
    """The smallest bucket >= rows (rows itself up to 16)."""
    if rows <= 16:
        return rows
    step = 1 << (rows - 1).bit_length() - 4
    return -(-rows // step) * step


def _bucket_below(rows: int) -> int:
    """The largest bucket <= rows (rows itself up to 16)."""
    if rows <= 16:
        return rows
    step = 1 << rows.bit_length() - 4
    return rows // step * step


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` [m, n] as the first m of `rows` rows: where t's storage goes on past its last row
    with the same row stride, a view reaching into it (no copy: whatever those rows hold only
    makes output rows nobody reads, a product's rows being independent), else a copy with
    zero rows below (zeros, not whatever fresh memory holds: a denormal would slow it)."""
    m, cols = t.shape
    if t.stride(1) == 1 and t.stride(0) >= cols and t.storage_offset() + (rows - 1) * t.stride(
            0) + cols <= t.untyped_storage().nbytes() // t.element_size():
        return t.as_strided((rows, cols), t.stride())
    out = t.new_empty(rows, cols)
    out[:m] = t
    out[m:] = 0
    return out


def empty_rows(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised [rows, cols] tensor like `like` for a product's operand, in storage of
    its row bucket whose rows past `rows` are zero: `product` multiplies it without a copy."""
    full = like.new_empty(_bucket_above(rows), cols)
    full[rows:] = 0
    return full[:rows]


class _Pack:
    """A parameter view's oneDNN-packed copy as of one version. `source` keeps the packed
    storage alive, so that an equal `data_ptr` can only mean the same storage, whose in-place
    writes (an optimizer step) bump the version counter."""

    __slots__ = ("source", "version", "packed")

    def __init__(self, source: torch.Tensor):
        self.source, self.version = source, source._version
        self.packed = torch.ops.mkldnn._reorder_linear_weight(source.contiguous())


# id of a parameter -> its views' packs (a view: offset, shape, strides; the kernels multiply
# by views of one parameter: its [1, n, k] batch squeezed, its transpose for dX, the slices of
# a stacked weight), dropped with the parameter.
_packs: dict[int, dict[tuple, _Pack]] = {}


def _packed(w: torch.Tensor) -> torch.Tensor | None:
    """`w` packed into oneDNN's blocked layout, once per parameter version, where `w` is (a view
    of) a parameter; None for a computed or per-instance matrix, which packing would not pay.
    The product of a dense weight reorders it into that layout on every call: ~10 us of the
    ~90 of a [64, 200] x [200, 800] product (packed 88 us, dense 98; 6% on [300, 512] x
    [512, 768])."""
    root = w if w._base is None else w._base
    if not (root.is_leaf and root.requires_grad):
        return None
    views = _packs.get(id(root))
    if views is None:
        views = _packs[id(root)] = {}
        weakref.finalize(root, _packs.pop, id(root), None)
    view = (w.storage_offset(), tuple(w.shape), w.stride())
    pack = views.get(view)
    if pack is None or pack.version != w._version or pack.source.data_ptr() != w.data_ptr():
        pack = views[view] = _Pack(w.detach())
    return pack.packed


def _onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
            add: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ w.T + b (+ add)` through oneDNN, on these very shapes; `add` is fused into the
    product (a post-op). `x` and `add` may have any strides; a weight that is not dense, row-
    or column-major, is copied first: oneDNN multiplies by a column slice or an expanded row
    ~2,000x slower (0.1 GFLOP/s, measured on 267 x 256 x 256), a reference loop instead of
    its GEMM."""
    packed = _packed(w)
    rows, cols = w.shape
    if packed is not None:
        w = packed
    elif w.stride() != (cols, 1) and w.stride() != (1, rows):
        # dense in the order its unit stride is in: a transposing copy ran ~5x slower
        w = w.t().contiguous().t() if w.stride(0) == 1 else w.contiguous()
    if add is None:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, add, w, b, "add")


def _onednn_bucketed(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                     add: torch.Tensor | None = None) -> torch.Tensor:
    """`_onednn` on x's rows padded up to their bucket; the result's first rows (a view)."""
    m = x.shape[0]
    rows = _bucket_above(m)
    if rows == m:
        return _onednn(x, w, b, add)
    return _onednn(_padded(x, rows), w, b, None if add is None else _padded(add, rows))[:m]


def _takes_onednn(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `x @ w.T` runs on oneDNN: the mode's rule (module docstring)."""
    mode = _gemm.choice
    if mode == "default" or x.dtype != torch.float32 or x.device.type != "cpu" \
            or w.dtype != torch.float32 or x.dim() != 2 or w.dim() != 2 or 0 in w.shape:
        return False
    return mode == "onednn" or x.shape[0] * w.numel() >= ONEDNN_MIN_MACS \
        and torch._C._get_mkldnn_enabled() and onednn_speedup() >= ONEDNN_FASTER


def product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
            add: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ w.T (+ b) (+ add)` for matrices x [m, k], w [n, k] (any strides: `w` may be a
    transposed view, as backward's products take them), `b` [n], `add` [m, n]; on the faster
    path, outside autograd (the hand-written backwards' products). Not counted in `flops`."""
    if _takes_onednn(x, w):
        gemm_counts["onednn"] += 1
        return _onednn_bucketed(x, w, b, add)
    gemm_counts["default"] += 1
    if add is None:
        return F.linear(x, w, b)
    out = torch.addmm(add, x, w.t())
    return out if b is None else out.add_(b)


def weight_gradient(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`dy^T x` for dy [m, n], x [m, k]: the gradient [n, k] of the weight of `x @ W.T` (a sum
    over the m rows), on the faster path, outside autograd. On oneDNN, the rows up to their
    bucket below; the few left (< 1/8) are added in place on the default path.

    oneDNN contracts over its input's rows, so one operand is transposed into a copy: dY^T, or
    where x is at most a third as wide (an LSTM's input [m, 200] against its gates [m, 800]),
    x^T, the product then being dW^T (returned as its transposed view): [1100, 800] x [1100,
    200] 1.9 -> 1.5 ms, [1300, 768] x [1300, 256] 2.5 -> 2.35 (1 thread, 2026-11-24)."""
    if not _takes_onednn(dy.t(), x.t()):
        gemm_counts["default"] += 1
        return dy.t().mm(x)
    gemm_counts["onednn"] += 1
    m = dy.shape[0]
    rows = _bucket_below(m)
    transposed = 3 * x.shape[1] <= dy.shape[1]
    a, b = (x, dy) if transposed else (dy, x)  # out = a^T b: dW^T or dW
    out = _onednn(a[:rows].t(), b[:rows].t(), None)
    if rows != m:
        out.addmm_(a[rows:].t(), b[rows:])
    return out.t() if transposed else out


class _Linear(torch.autograd.Function):
    """`x @ w.T + b` with the forward and dX = dY W through oneDNN (`product`), dW = dY^T X
    through `weight_gradient`. Under a double backward (grad mode on in backward) its
    products are torch's, which autograd can differentiate again."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return _onednn_bucketed(x, w, b)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = dw = db = None
        fast = not torch.is_grad_enabled()
        if ctx.needs_input_grad[0]:
            dx = product(dy, w.t()) if fast else dy.mm(w)
        if ctx.needs_input_grad[1]:
            dw = weight_gradient(dy, x) if fast else dy.t().mm(x)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0)
        return dx, dw, db


class _DeferredLinear(torch.autograd.Function):
    """`x @ w.T + b` for the weight of a WeightGrad (weight_grads.py), `w` = `wg.weight`,
    which is not an input: the launch's edge towards it is the WeightGrad's token, so backward
    evaluates no node per launch on the way to the weight. Backward computes dX and db and
    hands (dY, X) to the WeightGrad, which computes dW once for all launches."""

    @staticmethod
    def forward(ctx, x, b, token, wg, fast):
        w = wg.weight
        ctx.save_for_backward(x, w)  # w too: a write to it before backward raises, as eagerly
        ctx.wg, ctx.fast = wg, fast
        return _onednn_bucketed(x, w, b) if fast else F.linear(x, w, b)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = db = None
        if ctx.needs_input_grad[0]:  # (a double backward differentiates torch's product)
            dx = product(dy, w.t()) if ctx.fast and not torch.is_grad_enabled() else dy.mm(w)
        if ctx.needs_input_grad[1]:
            db = dy.sum(0)
        ctx.wg.add(dy, x)
        return dx, db, None, None, None


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           model_flops: bool = True) -> torch.Tensor:
    """`x @ w.T + b` for a batch `x` [m, k] and a shared weight `w` [n, k], on the faster path,
    under autograd; inside a graph's execution with the weight's gradient deferred to one
    product over all launches (weight_grads.py). `model_flops=False`: a product the model did
    not write (projection.py's, which counts the model's products it replaces instead), left
    out of `flops`."""
    if model_flops:
        flops.add(x.shape[0] * w.shape[0], x.shape[1], x, w)
    fast = _takes_onednn(x, w)
    gemm_counts["onednn" if fast else "default"] += 1
    wg = weight_grads.weight_grad_of(w) if x.dim() == 2 else None
    if wg is not None:
        return apply_function(_DeferredLinear, x, b, wg.token, wg, fast)
    if not fast:
        return F.linear(x, w, b)
    grad = torch.is_grad_enabled() and (
        x.requires_grad or w.requires_grad or b is not None and b.requires_grad)
    return _Linear.apply(x, w, b) if grad else _onednn_bucketed(x, w, b)
