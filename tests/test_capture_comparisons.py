"""Comparisons on expressions: torch's elementwise masks, except a scalar against a scalar, which
asks for the value (a Python bool) so that per-instance control flow can branch on it."""

import torch

import flybatch as fb

F64 = torch.float64


def test_a_comparison_of_a_vector_is_an_elementwise_mask_usable_in_torch_where():
    W = torch.nn.Parameter(torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=F64))
    xs = [torch.tensor([1.0, 1.0], dtype=F64), torch.tensor([-1.0, 2.0], dtype=F64)]

    def relu_by_mask(x):
        h = W @ x
        return torch.where(h > 0, h, torch.zeros_like(h)).sum()

    expected = sum(relu_by_mask(x) for x in xs)
    expected.backward()
    grad, W.grad = W.grad.clone(), None
    with fb.Graph():
        mask = (W @ xs[0]) > 0
        assert isinstance(mask, fb.Expression) and mask.value().tolist() == [False, True]
        loss = sum(relu_by_mask(x) for x in xs)
        loss.backward()
        assert abs(loss.item() - expected.item()) < 1e-12
    torch.testing.assert_close(W.grad, grad)


def test_a_comparison_of_two_scalars_is_a_python_bool():
    with fb.Graph():
        score = fb.sum_elems(fb.input([1.0, 2.0]))
        assert (score > 2.5) is True and (score <= 2.5) is False
