"""A constant index of a parameter (`U_f[0]` in per-instance torch code) is one shared node per
graph, read when the forward runs like the parameter itself."""

import pytest
import torch
import torch.nn.functional as F

import flybatch as fb

F64 = torch.float64


def test_products_with_a_constant_index_of_a_parameter_share_one_launch():
    U = torch.nn.Parameter(torch.randn(2, 3, 3, dtype=F64))
    xs = [torch.randn(3, dtype=F64) for _ in range(6)]
    expected = sum(F.linear(x, U[1]).sum() for x in xs)
    expected.backward()
    grad, U.grad = U.grad.clone(), None
    with fb.Graph(strategy="agenda") as g:
        loss = sum(F.linear(x, U[1]).sum() for x in xs)
        loss.backward()
        assert abs(loss.item() - expected.item()) < 1e-12
        products = [s for s, n in g.launches if "linear" in fb.signatures.describe(s, g)]
    assert len(products) == 1
    torch.testing.assert_close(U.grad, grad)


def test_a_view_of_a_rebound_parameter_is_read_anew_by_the_next_forward():
    U = torch.nn.Parameter(torch.ones(2, 3, dtype=F64))
    x = torch.ones(3, dtype=F64)
    with fb.Graph():
        first = F.linear(x, U[0:1]).sum()
        assert first.item() == 3.0
        U.data = 2 * torch.ones(2, 3, dtype=F64)
        second = F.linear(x, U[0:1]).sum()
        assert second.item() == 6.0


def _row_then_write(W, out):
    """`W[1]` taken, used, W written in place, the row used again: eagerly a view throughout."""
    r = W[1]
    before = r * 2
    out.append(before.sum().item())  # computed before the write
    with torch.no_grad():
        W.mul_(3)
    out.append(r.sum().item())  # the row itself, computed before the write: now W's new row
    after = r * before
    loss = after.sum() + W[1].sum()
    loss.backward()
    out.append(loss.item())


@pytest.mark.parametrize("strategy", ["none", "depth", "agenda", "auto"])
def test_a_row_taken_as_w_of_i_is_a_view_that_later_uses_see_written(strategy):
    W = torch.nn.Parameter(torch.arange(6, dtype=F64).reshape(3, 2))
    expected: list = []
    _row_then_write(W, expected)
    grad, W.grad = W.grad.clone(), None
    with torch.no_grad():
        W.copy_(torch.arange(6, dtype=F64).reshape(3, 2))
    got: list = []
    with fb.Graph(strategy=strategy):
        _row_then_write(W, got)
    assert got == expected
    torch.testing.assert_close(W.grad, grad)


@pytest.mark.parametrize("strategy", ["depth", "auto"])
def test_a_row_taken_before_a_rebinding_keeps_the_storage_it_was_taken_of(strategy):
    # eagerly `W.data = ...` leaves earlier views on the old storage; a later write there is
    # theirs, not W's
    def program(W, out):
        r = W[0]
        old = W.data
        W.data = torch.zeros(2, 2, dtype=F64)
        with torch.no_grad():
            old.add_(1)
        out.append(r.tolist())
        out.append(W[0].tolist())

    expected: list = []
    program(torch.nn.Parameter(torch.ones(2, 2, dtype=F64)), expected)
    got: list = []
    with fb.Graph(strategy=strategy):
        program(torch.nn.Parameter(torch.ones(2, 2, dtype=F64)), got)
    assert got == expected


def test_an_int_index_and_the_same_index_as_a_tuple_are_one_node():
    U = torch.nn.Parameter(torch.randn(2, 3, 3, dtype=F64))
    with fb.Graph():
        assert U[1].id == U[(1,)].id == U[1].id != U[0].id
        assert U[True].shape == (1, 2, 3, 3)  # a bool is no int index: torch adds a dim
        torch.testing.assert_close(U[1].value(), U.detach()[1])
