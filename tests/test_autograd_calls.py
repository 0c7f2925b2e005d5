"""torch.autograd beyond `loss.backward()`, on expressions, as eagerly (float64, every strategy,
in a plain loop and under `fb.map_batched`): `torch.autograd.grad` with respect to parameters
and to input tensors that require grad, `create_graph=True` (a gradient penalty, double
backward), `torch.autograd.backward` of several losses with their gradients, and
`backward(gradient, inputs=...)`. Gradients with respect to an expression raise: it has no
gradient tensor of its own."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import flybatch as fb
from flybatch.graph import STRATEGIES

F64 = torch.float64


def _model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 4).double()


def _inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(4, generator=gen, dtype=F64) for _ in range(3)]


def _loss(model: nn.Linear, x: torch.Tensor):
    h = torch.tanh(model(x))
    if h.sum() > 0:  # a value request: a round under map_batched
        h = h * 2
    return (h ** 2).sum()


def _losses(model, xs, mapped):
    return fb.map_batched(lambda x: _loss(model, x), xs) if mapped else [_loss(model, x) for x in xs]


@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_autograd_grad_of_a_loss_with_respect_to_parameters_is_eager_autograd_grad(strategy,
                                                                                   mapped):
    model, xs = _model(), _inputs()
    want = torch.autograd.grad(sum(_loss(model, x) for x in xs), list(model.parameters()))
    with fb.Graph(strategy=strategy):
        got = torch.autograd.grad(sum(_losses(model, xs, mapped)), list(model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_gradient_penalty_on_input_perturbations_trains_as_eagerly(strategy, mapped):
    model, xs = _model(), _inputs()

    def penalised(run):
        deltas = [torch.zeros(4, dtype=F64, requires_grad=True) for _ in xs]
        loss = sum(run([x + d for x, d in zip(xs, deltas)]))
        grads = torch.autograd.grad(loss, deltas, create_graph=True)
        (loss + sum((g ** 2).sum() for g in grads)).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return grads

    want = penalised(lambda perturbed: [_loss(model, x) for x in perturbed])
    with fb.Graph(strategy=strategy):
        got = penalised(lambda perturbed: _losses(model, perturbed, mapped))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_autograd_backward_of_several_losses_with_their_gradients_is_eager(strategy):
    model, xs = _model(), _inputs()
    weights = [torch.tensor(2.0, dtype=F64), torch.tensor(-1.0, dtype=F64),
               torch.tensor(0.5, dtype=F64)]
    torch.autograd.backward([_loss(model, x) for x in xs], weights)
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with fb.Graph(strategy=strategy):
        torch.autograd.backward([_loss(model, x) for x in xs], weights)
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_backward_with_a_gradient_into_chosen_inputs_only_is_eager(strategy):
    model, xs = _model(), _inputs()
    seed = torch.arange(4, dtype=F64)
    torch.tanh(model(xs[0])).backward(seed, inputs=[model.weight])
    want = model.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    with fb.Graph(strategy=strategy):
        torch.tanh(model(xs[0])).backward(seed, inputs=[model.weight])
    torch.testing.assert_close(model.weight.grad, want, rtol=0, atol=1e-12)
    assert model.bias.grad is None


def test_a_second_autograd_grad_without_retain_graph_raises_as_eagerly():
    model, xs = _model(), _inputs()
    with fb.Graph():
        loss = _loss(model, xs[0])
        torch.autograd.grad(loss, model.weight)
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            torch.autograd.grad(loss, model.weight)


def test_autograd_of_expressions_mixed_with_tensors_raises_naming_the_call():
    model, xs = _model(), _inputs()
    eager = model.weight.sum()
    with fb.Graph():
        with pytest.raises(TypeError, match="torch.autograd.backward of flybatch expressions "
                                            "and other tensors"):
            torch.autograd.backward([_loss(model, xs[0]), eager])
