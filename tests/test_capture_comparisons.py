"""Comparisons on expressions: torch's elementwise masks, except a scalar against a scalar, which
asks for the value (a Python bool) so that per-instance control flow can branch on it."""

import pytest
import torch
import torch.nn as nn

import flybatch as fb
from native import check, draw, seeded

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


def test_a_comparison_of_two_scalars_asks_for_the_value_as_a_torch_bool():
    with fb.Graph() as g:
        score = fb.sum_elems(fb.input([1.0, 2.0]))
        above, below = score > 2.5, score <= 2.5
        assert g.n_done == g.n_nodes  # computed at the comparison (a value request)
        assert type(above) is torch.Tensor and above.dtype == torch.bool and above.shape == ()
        assert above and not below
        assert bool(~above) is False and (~below).item() is True  # not Python's ~True == -2
        assert above.float().item() == 1.0


# ---- `==` and `!=` between two expressions: torch's elementwise comparison -------------------
STRATEGIES = ["none", "depth", "agenda", "auto"]


class TwoReaders(nn.Module):
    """Two linear readers of one input, whose outputs the losses below compare."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(3, 4)


def agreement_loss(model, x):
    """Masks of equal (rounded) values and of agreeing argmaxes, all between expressions."""
    a, b = model.a(x), model.b(x)
    same = torch.round(2 * a) == torch.round(2 * b)
    differ = torch.round(2 * a) != torch.round(2 * b)
    agree = a.argmax(dim=0) == b.argmax(dim=0)
    return (same * a).sum() + (differ * b).sum() + agree * b.sum() + (a == a).sum()


def branching_loss(model, x):
    """Python control flow on `==` of two 0-d expressions: bool() asks for the value."""
    a, b = model.a(x), model.b(x)
    if a.argmax(dim=0) == b.argmax(dim=0):
        return (a * b).sum()
    return (a - b).square().sum()


@pytest.mark.parametrize("mapped", [False, True], ids=["graph", "map_batched"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("loss_of", [agreement_loss, branching_loss],
                         ids=["masks", "branch"])
def test_eq_and_ne_between_expressions_compare_values_as_torch_does(loss_of, strategy, mapped):
    model = seeded(TwoReaders())
    xs = draw(3, *[(3,)] * 12)
    agreeing = sum(int(model.a(x).argmax() == model.b(x).argmax()) for x in xs)
    assert 0 < agreeing < len(xs)  # both outcomes occur: the comparison is not vacuous
    check(model, lambda x: loss_of(model, x), xs, strategy, mapped)


@pytest.mark.parametrize("mapped", [False, True], ids=["graph", "map_batched"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_accuracy_count_of_predictions_against_gold_expressions_counts_values(strategy,
                                                                                 mapped):
    model = seeded(TwoReaders())
    xs = draw(4, *[(3,)] * 12)

    def correct(x):
        return (model.a(x).argmax(dim=0) == model.b(x).argmax(dim=0)).sum()

    want = sum(int(correct(x)) for x in xs)
    assert 0 < want < len(xs)
    with fb.Graph(strategy=strategy):
        counts = fb.map_batched(correct, xs) if mapped else [correct(x) for x in xs]
        assert int(torch.stack(counts).sum()) == want


def test_bool_of_a_comparison_of_two_vectors_raises_as_torch_does():
    with fb.Graph(dtype=F64):
        a, b = fb.input([1.0, 2.0]), fb.input([1.0, 3.0])
        with pytest.raises(RuntimeError, match="more than one value is ambiguous"):
            bool(a == b)
        assert (a == b).value().tolist() == [True, False]
        assert (a != b).value().tolist() == [False, True]


def scalar_comparison_loss(model, x):
    """Comparisons of two 0-d expressions used as torch code uses 0-d masks."""
    a, b = model.a(x).sum(), model.b(x).sum()
    keep = ~(a > b)  # eagerly a 0-d bool tensor: logical not
    picked = torch.where(a <= b, a, b)
    return keep * a + (a >= b).float() * b + picked + max(a, b) + sorted([a, b])[0]


@pytest.mark.parametrize("mapped", [False, True], ids=["graph", "map_batched"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_comparisons_of_two_scalars_are_torch_bools_in_arithmetic_and_where(strategy, mapped):
    model = seeded(TwoReaders())
    xs = draw(5, *[(3,)] * 12)
    above = sum(int(model.a(x).sum() > model.b(x).sum()) for x in xs)
    assert 0 < above < len(xs)
    check(model, lambda x: scalar_comparison_loss(model, x), xs, strategy, mapped)
