"""The fast kernels compute what the default ones compute.

The oneDNN GEMM path (forced, so that it runs whatever the calibration would pick) gives the
values and gradients of torch's own product; it never serves a stale packed weight after an
optimizer step; float64 stays on the default path; and whole models train the same on either.
The FLOP counter counts every matrix product once, exactly, however the graph batched it.
"""

from __future__ import annotations

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


def test_a_packed_weight_is_never_stale_after_an_optimizer_step(gemm):
    gemm("onednn")
    w, b = weights(8, 4)
    x = torch.randn(5, 4)
    kernels.linear(x, w, b).sum().backward()
    torch.optim.SGD([w, b], lr=0.5).step()
    torch.testing.assert_close(kernels.linear(x, w, b), torch.nn.functional.linear(x, w, b))
    with torch.no_grad():
        w.data = torch.randn(8, 4)  # rebound, not updated in place
    torch.testing.assert_close(kernels.linear(x, w, b), torch.nn.functional.linear(x, w, b))


def test_float64_and_computed_weights_take_the_default_path(gemm):
    gemm("onednn")
    w, b = weights(8, 4)
    before = dict(kernels.gemm_counts)
    kernels.linear(torch.randn(3, 4, dtype=torch.float64), w.double(), b.double())
    kernels.linear(torch.randn(3, 4), w * 2, b)  # a computed matrix: nothing to pack once
    assert kernels.gemm_counts["default"] == before["default"] + 2
    assert kernels.gemm_counts["onednn"] == before["onednn"]


def test_auto_mode_picks_a_path_once_per_shape_class_without_touching_grads(gemm):
    gemm("auto")
    w, b = weights(32, 16)
    kernels.linear(torch.randn(40, 16), w, b)
    decided = dict(kernels._decisions)
    kernels.linear(torch.randn(50, 16), w, b)  # the same m bucket: no new calibration
    assert kernels._decisions == decided
    assert w.grad is None and b.grad is None  # calibration ran backward on detached copies
    assert (64, 16, 32, False, True) in decided  # x needs no grad, but the weight does
    with torch.no_grad():
        kernels.linear(torch.randn(50, 16), w, b)
    assert (64, 16, 32, False, False) in kernels._decisions  # eval is a class of its own


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
