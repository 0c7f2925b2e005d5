"""The LSTM layer's two kernels (flybatch/lstm_layer.py) compute the same h and gradients.

`StepwiseLSTM`, the hand-written layer, is checked with float64 gradcheck and against the
oneDNN path (torch's LSTM in groups of similar length) on the same padded batch; the path rule
of "auto" and the switch are specified here too. fb.nn.LSTM's equivalence tests against torch
run on both paths (tests/test_nn.py, the `lstm_path` fixture).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

from flybatch import kernels, lstm_layer

D, H = 5, 4


def padded_batch(lengths, dtype=torch.float64, seed=0):
    """x [B, T, D] with zeros past each length, and the layer's weights, all requiring grad."""
    gen = torch.Generator().manual_seed(seed)
    lengths = np.asarray(lengths)
    x = torch.randn(len(lengths), int(lengths.max()), D, generator=gen, dtype=dtype)
    x[torch.from_numpy(np.arange(x.shape[1])[None, :] >= lengths[:, None])] = 0.0
    weights = [torch.randn(4 * H, D, generator=gen, dtype=dtype) * 0.5,
               torch.randn(4 * H, H, generator=gen, dtype=dtype) * 0.5,
               torch.randn(4 * H, generator=gen, dtype=dtype) * 0.5]
    return [t.requires_grad_() for t in (x, *weights)]


def run(path, x, w_ih, w_hh, bias, lengths):
    before = lstm_layer.get_lstm()
    lstm_layer.set_lstm(path)
    try:
        return lstm_layer.kernel([x, w_ih[None], w_hh[None], bias[None]], None, None, lengths)
    finally:
        lstm_layer.set_lstm(before)


def test_packing_is_a_packed_sequences_time_major_order():
    lengths = np.array([2, 5, 1, 5, 3])
    packing = lstm_layer._Packing(lengths, 5, torch.device("cpu"))
    rows = torch.arange(5 * 5).reshape(5, 5, 1)
    theirs = pack_padded_sequence(rows, torch.from_numpy(lengths), batch_first=True,
                                  enforce_sorted=False)
    assert packing.batch_sizes == theirs.batch_sizes.tolist()
    assert torch.equal(packing.index, theirs.data.flatten())


@pytest.mark.parametrize("lengths", [[3, 1, 4, 1, 5], [2, 2, 2], [1]],
                         ids=["ragged", "equal", "one-step"])
def test_stepwise_lstm_passes_gradcheck_in_float64(lengths):
    x, w_ih, w_hh, bias = padded_batch(lengths)
    packing = lstm_layer._Packing(np.array(lengths), x.shape[1], x.device)
    assert torch.autograd.gradcheck(
        lambda *args: lstm_layer.StepwiseLSTM.apply(packing, *args), (x, w_ih, w_hh, bias))


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)],
                         ids=["float64", "float32"])
def test_stepwise_equals_onednn_in_values_and_gradients(dtype, tol):
    lengths = np.array([7, 1, 3, 7, 2, 5, 4])  # three of oneDNN's groups
    results = []
    for path in ("onednn", "stepwise"):
        x, w_ih, w_hh, bias = padded_batch(lengths, dtype)
        h = run(path, x, w_ih, w_hh, bias, lengths)
        dh = torch.randn(h.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
        results.append([h, *torch.autograd.grad(h, (x, w_ih, w_hh, bias), dh)])
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol)


@pytest.mark.parametrize("gemm", ["onednn", "default"])
def test_stepwise_in_float32_is_the_same_on_either_gemm_path(gemm):
    # Its products go through kernels.product / weight_gradient: forced onto each path (the
    # rows here are tiny; "auto" would keep them on the default one), the same h and gradients
    # as oneDNN's RNN primitive.
    lengths = np.array([7, 1, 3, 7, 2, 5, 4])
    before = kernels.get_gemm()
    kernels.set_gemm(gemm)
    try:
        results = []
        for path in ("onednn", "stepwise"):
            x, w_ih, w_hh, bias = padded_batch(lengths, torch.float32)
            h = run(path, x, w_ih, w_hh, bias, lengths)
            dh = torch.randn(h.shape, generator=torch.Generator().manual_seed(1))
            results.append([h, *torch.autograd.grad(h, (x, w_ih, w_hh, bias), dh)])
    finally:
        kernels.set_gemm(before)
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_stepwise_leaves_zeros_past_each_sequence_end():
    lengths = np.array([4, 2])
    h = run("stepwise", *padded_batch(lengths), lengths)
    assert torch.count_nonzero(h[1, 2:]) == 0 and torch.count_nonzero(h[:, :2]) == 2 * 2 * H


@pytest.mark.parametrize("lengths, speedup, training, path", [
    ([3, 1, 2], 1.1, True, "stepwise"), ([3, 1, 2], 1.1, False, "stepwise"),
    (None, 1.1, True, "onednn"),
    ([3, 1, 2], 2.3, True, "stepwise"), ([3, 1, 2], 2.3, False, "onednn"),
    (None, 2.3, True, "onednn")],
    ids=["lengths-differ", "lengths-differ-eval", "lengths-equal",
         "lengths-differ-onednn-faster", "lengths-differ-eval-onednn-faster",
         "lengths-equal-onednn-faster"])
def test_auto_runs_stepwise_where_lengths_differ_but_oneDNN_in_fast_evaluation(
        lengths, speedup, training, path, monkeypatch):
    monkeypatch.setattr(kernels, "_onednn_speedup", speedup)
    batch = padded_batch([3, 3, 3] if lengths is None else lengths, torch.float32)
    before = dict(lstm_layer.lstm_counts)
    with torch.set_grad_enabled(training):
        run("auto", *batch, None if lengths is None else np.array(lengths))
    assert {k: lstm_layer.lstm_counts[k] - before[k] for k in before} == {
        p: int(p == path) for p in before}


def test_auto_keeps_float64_stepwise_where_lengths_differ_even_if_onednn_is_faster(monkeypatch):
    monkeypatch.setattr(kernels, "_onednn_speedup", 2.3)
    before = dict(lstm_layer.lstm_counts)
    with torch.no_grad():
        run("auto", *padded_batch([3, 1, 2], torch.float64), np.array([3, 1, 2]))
    assert lstm_layer.lstm_counts["stepwise"] == before["stepwise"] + 1


def test_onednn_speedup_is_measured_once_per_process(monkeypatch):
    monkeypatch.setattr(kernels, "_onednn_speedup", None)
    first = kernels.onednn_speedup()
    assert first > 0 and kernels.onednn_speedup() == first


def test_set_lstm_rejects_an_unknown_path():
    with pytest.raises(ValueError, match="set_lstm: path must be one of"):
        lstm_layer.set_lstm("fast")


def test_stepwise_refuses_a_double_backward_instead_of_getting_it_wrong():
    lengths = np.array([3, 1])
    x, w_ih, w_hh, bias = padded_batch(lengths)
    h = run("stepwise", x, w_ih, w_hh, bias, lengths)
    dh = torch.ones_like(h, requires_grad=True)
    (dx,) = torch.autograd.grad(h, x, dh, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dx.sum().backward()
