"""The fast kernels compute what the default ones compute.

The oneDNN GEMM path (forced, so that it runs whatever this CPU's speed would pick) gives the
values and gradients of torch's own product, on operands of any layout, double backward
included; float64 stays on the default path; "auto" takes oneDNN only where it pays; and whole
models train the same on either.
The FLOP counter counts every matrix product once, exactly, however the graph batched it.
"""

from __future__ import annotations

import time

import pytest
import torch

import flybatch as fb
from flybatch import kernels

F32 = torch.float32


@pytest.fixture
def gemm():
    """Run a test under a forced GEMM path; the process's mode is restored afterwards."""
    before = kernels.get_gemm()
    yield kernels.set_gemm
    kernels.set_gemm(before)


def weights(n: int, k: int, seed: int = 0) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.nn.Parameter(torch.randn(n, k, generator=gen)),
            torch.nn.Parameter(torch.randn(n, generator=gen)))


def test_set_gemm_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="onednn"):
        kernels.set_gemm("fast")


@pytest.mark.parametrize("m", [1, 3, 64])
def test_onednn_linear_equals_torch_linear_forward_and_backward(gemm, m):
    gemm("onednn")
    w, b = weights(24, 16)
    x = torch.randn(m, 16, requires_grad=True)
    before = kernels.gemm_counts["onednn"]
    y = kernels.linear(x, w, b)
    assert kernels.gemm_counts["onednn"] == before + 1
    dy = torch.randn_like(y)
    y.backward(dy)
    grads = x.grad, w.grad, b.grad
    x.grad = w.grad = b.grad = None
    expected = torch.nn.functional.linear(x, w, b)
    expected.backward(dy)
    torch.testing.assert_close(y, expected)
    for ours, theirs in zip(grads, (x.grad, w.grad, b.grad)):
        torch.testing.assert_close(ours, theirs)


def test_a_weight_is_never_stale_after_an_optimizer_step(gemm):
    gemm("onednn")
    w, b = weights(8, 4)
    x = torch.randn(5, 4)
    kernels.linear(x, w, b).sum().backward()
    torch.optim.SGD([w, b], lr=0.5).step()
    torch.testing.assert_close(kernels.linear(x, w, b), torch.nn.functional.linear(x, w, b))
    with torch.no_grad():
        w.data = torch.randn(8, 4)  # rebound, not updated in place
    torch.testing.assert_close(kernels.linear(x, w, b), torch.nn.functional.linear(x, w, b))


def test_a_parameter_is_packed_once_per_version_and_a_computed_weight_never(gemm, monkeypatch):
    gemm("onednn")
    packs = []
    reorder = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(kernels._Pack, "__init__", lambda self, source: (
        packs.append(source.shape), setattr(self, "source", source),
        setattr(self, "version", source._version),
        setattr(self, "packed", reorder(source.contiguous()))) and None)
    w, b = weights(8, 4)
    x = torch.randn(5, 4)
    for _ in range(3):
        kernels.product(x, w, b)
    assert packs == [(8, 4)]
    kernels.product(torch.randn(5, 8), w.t())  # dX's transpose: a view packed on its own
    assert packs == [(8, 4), (4, 8)]
    with torch.no_grad():
        w.add_(1.0)  # an optimizer step: a new version
    torch.testing.assert_close(kernels.product(x, w, b), x @ w.T + b)
    assert packs == [(8, 4), (4, 8), (8, 4)]
    kernels.product(x, w * 2)  # computed: multiplied as it is
    assert len(packs) == 3


def test_float64_takes_the_default_path_and_a_computed_weight_gets_its_gradient(gemm):
    gemm("onednn")
    w, b = weights(8, 4)
    before = dict(kernels.gemm_counts)
    kernels.linear(torch.randn(3, 4, dtype=torch.float64), w.double(), b.double())
    assert kernels.gemm_counts["default"] == before["default"] + 1
    x = torch.randn(3, 4)
    kernels.linear(x, w * 2, b).sum().backward()  # a computed matrix: oneDNN too
    assert kernels.gemm_counts["onednn"] == before["onednn"] + 2  # forward, dW (x needs none)
    expected = w.grad.clone()
    w.grad = None
    torch.nn.functional.linear(x, w * 2, b).sum().backward()
    torch.testing.assert_close(expected, w.grad)


STRIDED = {
    "contiguous": lambda t: t,
    "transposed": lambda t: t.t().contiguous().t(),
    "a column slice": lambda t: torch.cat([t, t], 1)[:, t.shape[1]:],
    "every other row": lambda t: torch.stack([t, t], 1).flatten(0, 1)[::2],
    "an expanded row": lambda t: t[:1].expand_as(t),
    "a transposed column slice": lambda t: torch.cat([t.t(), t.t()], 1)[:, t.shape[0]:].t(),
}


@pytest.mark.parametrize("layout", STRIDED)
@pytest.mark.parametrize("mode", ["onednn", "default"])
def test_product_takes_operands_of_any_layout_with_a_bias_and_an_addend(gemm, mode, layout):
    gemm(mode)
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(6, 5, generator=gen), torch.randn(7, 5, generator=gen)
    b, add = torch.randn(7, generator=gen), torch.randn(6, 7, generator=gen)
    x_, w_, add_ = (STRIDED[layout](t) for t in (x, w, add))
    expected = x_ @ w_.T
    torch.testing.assert_close(kernels.product(x_, w_), expected)
    torch.testing.assert_close(kernels.product(x_, w_, b), expected + b)
    torch.testing.assert_close(kernels.product(x_, w_, b, add=add_), expected + b + add_)
    torch.testing.assert_close(kernels.product(x_, w_, add=add_), expected + add_)


@pytest.mark.parametrize("rows", [1, 17, 300, 1300])
@pytest.mark.parametrize("mode", ["onednn", "default"])
def test_weight_gradient_is_dy_transposed_times_x_whatever_the_rows(gemm, mode, rows):
    gemm(mode)
    gen = torch.Generator().manual_seed(rows)
    dy, x = torch.randn(rows, 12, generator=gen), torch.randn(rows, 2 * 9, generator=gen)
    x = x[:, 9:]  # a column slice, as a fused cell's children are
    # A sum of `rows` products in float32: as close to the float64 truth as torch's own (its
    # order of summation differs, so the last bits may too).
    truth = dy.double().t() @ x.double()
    error = (kernels.weight_gradient(dy, x).double() - truth).abs().max()
    assert error <= 2 * (dy.t() @ x - truth).abs().max() + 1e-6


def test_onednn_sees_few_row_counts_each_close_to_the_rows_asked():
    # oneDNN compiles a primitive per shape (~1 ms): a product's rows are padded up to a
    # bucket, a weight gradient's cut down to one; 8 buckets per doubling, within 1/8.
    above = {kernels._bucket_above(m) for m in range(1, 4097)}
    below = {kernels._bucket_below(m) for m in range(1, 4097)}
    assert above == below and len(above) == 16 + 8 * 8
    for m in range(1, 4097):
        assert m <= kernels._bucket_above(m) <= m * 9 / 8
        assert m * 8 / 9 <= kernels._bucket_below(m) <= m


@pytest.mark.parametrize("rows", [17, 300])
def test_a_padded_product_returns_exactly_the_rows_asked(gemm, rows):
    gemm("onednn")
    x, w, add = torch.randn(rows, 8), torch.randn(5, 8), torch.randn(rows, 5)
    y = kernels.product(x, w, add=add)
    assert y.shape == (rows, 5) and y.is_contiguous()
    torch.testing.assert_close(y, x @ w.T + add)


def test_rows_allocated_for_a_product_are_multiplied_without_a_padded_copy(gemm, monkeypatch):
    gemm("onednn")
    copies = []
    monkeypatch.setattr(torch.Tensor, "new_empty",
                        lambda t, *a, **k: copies.append(a) or torch.empty(*a, dtype=t.dtype))
    x, w = kernels.empty_rows(17, 8, torch.ones(1)), torch.randn(5, 8)
    x.copy_(torch.randn(17, 8))
    del copies[:]
    torch.testing.assert_close(kernels.product(x, w), x @ w.T)
    assert copies == []


def test_rows_read_past_an_operand_never_reach_its_result(gemm):
    # A row slice of a larger tensor is multiplied in its bucket's rows, reading the storage's
    # next rows as they are: NaN there, and in the addend's, must not show in the result.
    gemm("onednn")
    big, add_big = torch.full((40, 8), float("nan")), torch.full((40, 5), float("nan"))
    big[:17], add_big[:17] = torch.randn(17, 8), torch.randn(17, 5)
    x, add, w = big[:17], add_big[:17], torch.randn(5, 8)
    y = kernels.product(x, w, add=add)
    assert y.shape == (17, 5) and not y.isnan().any()
    torch.testing.assert_close(y, x @ w.T + add)


@pytest.mark.parametrize(("speedup", "rows", "path"), [
    (2.3, 16, "onednn"),    # 16 x 256 x 256 = 2^20 multiply-adds: big enough
    (2.3, 15, "default"),   # one row fewer: oneDNN's fixed cost per call would not pay
    (1.2, 64, "default"),   # a CPU where oneDNN is not clearly faster
])
def test_auto_takes_onednn_where_it_is_faster_and_the_product_is_big_enough(
        gemm, monkeypatch, speedup, rows, path):
    gemm("auto")
    monkeypatch.setattr(kernels, "_onednn_speedup", speedup)
    before = dict(kernels.gemm_counts)
    kernels.product(torch.randn(rows, 256), torch.randn(256, 256))
    assert kernels.gemm_counts[path] == before[path] + 1


@pytest.mark.parametrize("layout", STRIDED)
def test_a_weight_of_any_layout_multiplies_at_gemm_speed(gemm, layout):
    # oneDNN runs a reference loop (~2,000x slower) on a weight that is not dense: such a
    # weight is copied first. The bound is loose (a GEMM of this size takes ~0.2 ms): it
    # catches the slow loop (~0.7 s), not a noisy machine.
    gemm("onednn")
    x, w = torch.randn(267, 256), STRIDED[layout](torch.randn(256, 256))
    kernels.product(x, w)
    start = time.perf_counter()
    kernels.product(x, w)
    assert time.perf_counter() - start < 0.1


@pytest.mark.filterwarnings("ignore:TF32 acceleration")
def test_auto_takes_no_onednn_where_the_user_turned_it_off(gemm, monkeypatch):
    gemm("auto")
    monkeypatch.setattr(kernels, "_onednn_speedup", 2.3)
    before = dict(kernels.gemm_counts)
    with torch.backends.mkldnn.flags(enabled=False):
        kernels.product(torch.randn(64, 256), torch.randn(256, 256))
    assert kernels.gemm_counts["default"] == before["default"] + 1


def test_a_double_backward_through_a_fast_product_is_exact(gemm):
    gemm("onednn")
    w, b = weights(6, 4)
    x = torch.randn(3, 4, requires_grad=True)
    (dx,) = torch.autograd.grad(kernels.linear(x, w, b).pow(2).sum(), x, create_graph=True)
    (ddw,) = torch.autograd.grad(dx.sum(), w)
    (dx_eager,) = torch.autograd.grad(torch.nn.functional.linear(x, w, b).pow(2).sum(), x,
                                      create_graph=True)
    (ddw_eager,) = torch.autograd.grad(dx_eager.sum(), w)
    torch.testing.assert_close(ddw, ddw_eager)


def train_tree_lstm(mode: str) -> tuple[list[float], list[torch.Tensor]]:
    """Three SGD steps of an fp32 Tree-LSTM with a loss at every node, under GEMM `mode`."""
    kernels.set_gemm(mode)
    torch.manual_seed(0)
    H = 16
    cell, out = fb.nn.TreeLSTMCell(H, H), fb.nn.Linear(H, 5)
    emb = torch.nn.Parameter(torch.randn(30, H) * 0.1)
    params = [emb, *cell.parameters(), *out.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    trees = [((1, 2), (3, (4, 5))), (((6, 7), 8), 9), (10, 11)]
    losses = []

    def node(tree, losses_of_tree):
        if isinstance(tree, int):
            state = cell.leaf(fb.lookup(emb, tree))
        else:
            state = cell([node(child, losses_of_tree) for child in tree])
        losses_of_tree.append(fb.pick_neg_log_softmax(out(state.h), 1))
        return state

    for _ in range(3):
        opt.zero_grad()
        with fb.Graph():
            parts = []
            for tree in trees:
                node(tree, parts)
            loss = fb.esum(parts)
            losses.append(loss.item())
            loss.backward()
        opt.step()
    return losses, [p.detach().clone() for p in params]


def test_a_model_trains_the_same_on_the_onednn_and_default_paths(gemm):
    fast_losses, fast_params = train_tree_lstm("onednn")
    losses, params = train_tree_lstm("default")
    assert fast_losses == pytest.approx(losses, rel=1e-5)
    for ours, theirs in zip(fast_params, params):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_flops_are_2k_per_output_and_as_much_again_per_operand_gradient():
    w, b = weights(24, 16)
    x = torch.randn(5, 16)
    forward = 2 * 5 * 16 * 24
    counted = []
    for grad_of_x, grad_mode in ((False, False), (False, True), (True, True)):
        kernels.flops.reset()
        with torch.set_grad_enabled(grad_mode):
            kernels.linear(x.clone().requires_grad_(grad_of_x), w, b)
        counted.append(kernels.flops.total)
    assert counted == [forward, 2 * forward, 3 * forward]  # eval; + dW; + dW and dX


@pytest.mark.parametrize("strategy", ["none", "agenda"])
def test_a_graph_counts_the_same_flops_whatever_its_batching(strategy):
    gen = torch.Generator().manual_seed(0)
    W = torch.nn.Parameter(torch.randn(8, 12, generator=gen))
    U = torch.nn.Parameter(torch.randn(5, 8, generator=gen))
    E = torch.nn.Parameter(torch.randn(10, 4, generator=gen))
    sequences = [[1, 2, 3], [4], [5, 6, 7, 8]]
    kernels.flops.reset()
    with fb.Graph(strategy=strategy):
        losses = []
        for words in sequences:
            h = fb.zeros(8)
            for word in words:
                h = fb.tanh(W @ fb.concat([h, fb.lookup(E, word)]))
            M = torch.randn(3, 8, generator=gen)  # a per-instance matrix: no gradient of its own
            losses.append(fb.sum_elems(U @ h) + fb.sum_elems(M @ h))
        fb.esum(losses).item()
    tokens = sum(map(len, sequences))
    with_both_grads, with_one_grad = 3 * 2, 2 * 2  # forward + dX + dW; forward + dX
    assert kernels.flops.total == (with_both_grads * (tokens * 8 * 12 + 3 * 5 * 8)
                                   + with_one_grad * 3 * 3 * 8)


def test_a_captured_product_with_a_per_instance_weight_counts_its_flops():
    W = torch.nn.Parameter(torch.randn(6, 4))
    kernels.flops.reset()
    with fb.Graph():
        # F.linear on a computed weight: a generic node of the torch-native capture
        outs = [torch.nn.functional.linear(fb.input(torch.randn(4)), W * (i + 1.0)).sum()
                for i in range(3)]
        fb.esum(outs).item()
    assert kernels.flops.total == 3 * 2 * 6 * 4 * 2  # forward + dW (the input needs none)


def test_an_lstm_layer_counts_the_products_of_its_valid_steps():
    # Per step: the input's product (the weight's gradient recorded, the input is constant)
    # and the state's (after a sequence's first step, the state's gradient too), 2 FLOPs per
    # multiply-add; the padding of shorter sequences is not counted.
    torch.manual_seed(0)
    D, H, lengths = 3, 4, (5, 1, 3)
    cell = fb.nn.LSTMCell(D, H)
    kernels.flops.reset()
    with fb.Graph():
        last = [fb.nn.LSTM.run(cell, [torch.randn(D) for _ in range(n)])[-1] for n in lengths]
        fb.esum([fb.sum_elems(h) for h in last]).value()
    steps, first_steps = sum(lengths), len(lengths)
    expected = (steps * 4 * H * D * 2 * 2 + first_steps * 4 * H * H * 2 * 2
                + (steps - first_steps) * 4 * H * H * 2 * 3)
    assert kernels.flops.total == expected
