"""Node-free views: the pure reshapes per-instance torch code writes around a [1, n] row
(`x.unsqueeze(0)`, `x.view(1, -1)`, `x.reshape(1, n)[0]`) add no node where
their consumer reads the node as it is (a view of a view, `[0]` of a [1, n] view, a one-class
cross-entropy), and a reshape node, as before, where anything else reads them. Values and
gradients equal eager torch's under every strategy."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flybatch as fb
from flybatch import _core

F64 = torch.float64
ATOL = 1e-9
STRATEGIES = ["none", "depth", "agenda", "auto"]


def params(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    W = nn.Parameter(torch.randn(5, 4, generator=gen, dtype=F64))
    E = nn.Parameter(torch.randn(7, 4, generator=gen, dtype=F64))
    xs = [torch.randn(4, generator=gen, dtype=F64) for _ in range(3)]
    return W, E, xs


def grads(*tensors):
    out = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return out


def assert_same(eager_loss, batched_loss, eager_grads, batched_grads):
    assert batched_loss == pytest.approx(eager_loss, abs=ATOL, rel=0)
    for want, got in zip(eager_grads, batched_grads):
        torch.testing.assert_close(got.to_dense(), want.to_dense(), rtol=0, atol=ATOL)


def test_unsqueeze_view_and_reshape_of_an_expression_add_no_node():
    W, _, xs = params()
    want = F.linear(xs[0], W).detach()
    with fb.Graph(dtype=F64) as g:
        h = F.linear(xs[0], W)
        before = g.n_nodes
        row = h.unsqueeze(0)
        assert (row.shape, _core.is_view(row)) == ((1, 5), True)
        assert row.view(-1).shape == (5,) and torch.reshape(row, (5, 1)).shape == (5, 1)
        assert h.view(1, -1).shape == (1, 5) and h.reshape(1, 5).shape == (1, 5)
        assert row[0].shape == (5,) and not _core.is_view(row[0])
        assert g.n_nodes == before
        torch.testing.assert_close(row[0].value(), want)


def test_a_view_read_as_a_node_gets_its_reshape_node_once():
    W, _, xs = params()
    want = F.linear(xs[0], W).detach().unsqueeze(0)
    with fb.Graph(dtype=F64) as g:
        row = F.linear(xs[0], W).unsqueeze(0)
        doubled, tripled = row * 2, row * 3
        assert [g.op_of(i).name for i in range(g.n_nodes)].count("reshape") == 1
        assert not _core.is_view(row) and g.op_of(row.id).name == "reshape"
        torch.testing.assert_close((doubled.value(), tripled.value()), (2 * want, 3 * want))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_a_one_class_cross_entropy_of_an_unsqueezed_row_is_one_loss_node(strategy, reduction):
    """`F.cross_entropy(logits.unsqueeze(0), torch.tensor([label]))`: one pick_neg_log_softmax
    node of the logits, the label its constant (no reshape node, no index input node)."""
    W, _, xs = params()

    def losses():
        out = []
        for i, x in enumerate(xs):
            logits = F.linear(x, W)
            out.append(F.cross_entropy(logits.unsqueeze(0), torch.tensor([i + 1]),
                                       reduction=reduction))
        return torch.stack(out).sum()

    eager = losses()
    eager.backward()
    want = grads(W)
    with fb.Graph(strategy=strategy, dtype=F64) as g:
        total = losses()
        ops = [g.op_of(i).name for i in range(g.n_nodes)]
        assert ops.count("pick_neg_log_softmax") == 3
        # (reduction='none': a [1] view of the loss, which torch.stack reads as a reshape node)
        assert ops.count("reshape") == (3 if reduction == "none" else 0)
        assert ops.count("input") == 3  # the three x; no label's index input
        loss = total.item()
        total.backward()
    assert_same(eager.item(), loss, [W.grad], want)


@pytest.mark.parametrize("case", ["ignored", "weighted", "smoothed"])
def test_a_cross_entropy_the_fold_does_not_cover_is_recorded_as_before(case):
    """An ignored class, class weights, label smoothing: the loss node of the handler, equal to
    eager (the ignored class's mean is 0 / 0, NaN, as eagerly)."""
    W, _, xs = params()
    weight = torch.rand(5, dtype=F64) + 0.5
    kwargs = {"ignored": dict(ignore_index=2), "weighted": dict(weight=weight),
              "smoothed": dict(label_smoothing=0.1)}[case]

    def loss():
        return F.cross_entropy(F.linear(xs[0], W).unsqueeze(0), torch.tensor([2]),
                               reduction="sum", **kwargs)

    eager = loss()
    eager.backward()
    want = grads(W)
    with fb.Graph(dtype=F64) as g:
        out = loss()
        assert "pick_neg_log_softmax" not in [g.op_of(i).name for i in range(g.n_nodes)]
        value = out.item()
        out.backward()
    assert_same(eager.item(), value, [W.grad], want)


def test_a_class_out_of_range_raises_as_before():
    W, _, xs = params()
    with fb.Graph(dtype=F64), pytest.raises(IndexError, match="out of bounds"):
        F.cross_entropy(F.linear(xs[0], W).unsqueeze(0), torch.tensor([5]), reduction="sum")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_view_and_its_base_both_carry_gradient(strategy):
    W, _, xs = params()

    def loss():
        h = F.linear(xs[0], W)
        row = h.unsqueeze(0)
        return F.cross_entropy(row, torch.tensor([1]), reduction="sum") + (h * h).sum() + \
            (row * 3).sum()

    eager = loss()
    eager.backward()
    want = grads(W)
    with fb.Graph(strategy=strategy, dtype=F64):
        out = loss()
        value = out.item()
        out.backward()
    assert_same(eager.item(), value, [W.grad], want)


def test_a_view_taken_under_no_grad_carries_no_gradient():
    """As eagerly: `h.unsqueeze(0)` under no_grad is a tensor without history (recorded as its
    reshape node under no_grad); a view taken with grad enabled and read under no_grad keeps
    its gradient for the reads outside."""
    W, _, xs = params()

    def loss():
        h = F.linear(xs[0], W)
        with torch.no_grad():
            frozen = h.unsqueeze(0)
        live = h.unsqueeze(0)
        with torch.no_grad():
            (live * 2).sum()
            row = live[0]  # of a view taken with grad: no gradient either
        return F.cross_entropy(frozen * h, torch.tensor([1]), reduction="sum") + \
            F.cross_entropy(live, torch.tensor([2]), reduction="sum") + (row * h).sum()

    eager = loss()
    eager.backward()
    want = grads(W)
    with fb.Graph(dtype=F64):
        out = loss()
        value = out.item()
        out.backward()
    assert_same(eager.item(), value, [W.grad], want)


@pytest.mark.parametrize("written", ["base", "row of an embedding"])
def test_a_view_of_an_expression_written_in_place_is_refused_when_read(written):
    """Eagerly a view shares its base's storage, so an in-place write to one changes the other:
    a read of the stale one after the write raises, as it did with reshape nodes."""
    W, E, xs = params()
    with fb.Graph(dtype=F64), pytest.raises(RuntimeError, match="shares storage"):
        if written == "base":
            h = F.linear(xs[0], W)
            row = h.unsqueeze(0)
            h += 1
        else:
            row = F.embedding(torch.tensor([3]), E)
            x = row[0]
            x += 1
        (row * 2).sum().item()


def test_a_view_of_an_integer_expression_keeps_its_dtype():
    W, _, xs = params()
    with fb.Graph(dtype=F64):
        index = F.linear(xs[0], W).argmax(dim=0, keepdim=True)  # int64, shape (1,)
        row = index.unsqueeze(0)
        assert (row.shape, row.dtype) == ((1, 1), torch.int64)
        assert row.value().tolist() == [[int(F.linear(xs[0], W).argmax())]]
