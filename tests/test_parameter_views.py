"""A constant index of a parameter (`U_f[0]` in per-instance torch code) is one shared node per
graph, read when the forward runs like the parameter itself."""

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


def test_an_int_index_and_the_same_index_as_a_tuple_are_one_node():
    U = torch.nn.Parameter(torch.randn(2, 3, 3, dtype=F64))
    with fb.Graph():
        assert U[1].id == U[(1,)].id == U[1].id != U[0].id
        assert U[True].shape == (1, 2, 3, 3)  # a bool is no int index: torch adds a dim
        torch.testing.assert_close(U[1].value(), U.detach()[1])
