"""The harness of the torch-native model tests (test_torch_native, test_torch_native_models):
a model's per-instance loss over a minibatch run eagerly, one instance at a time, and inside
`fb.Graph` (or `fb.map_batched`), compared loss for loss and gradient for gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import flybatch as fb

ATOL = 1e-9


def seeded(module: nn.Module, seed: int = 0) -> nn.Module:
    """`module` in float64 with reproducible weights (torch's own init, from a fixed seed)."""
    torch.manual_seed(seed)
    for m in module.modules():
        if hasattr(m, "reset_parameters") and m is not module:
            m.reset_parameters()
    return module.double()


def draw(seed: int, *shapes) -> list[torch.Tensor]:
    """Float64 inputs of these shapes from a generator of their own (the global one untouched)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in shapes]


class CountOps(TorchDispatchMode):
    """Counts the ops eager torch dispatches (each one a kernel launch)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class Run:
    """What one run of a model over a minibatch gave: the loss, the gradients, and either the
    eager op count or the graph's stats."""

    def __init__(self, loss, grads, ops=None, stats=None):
        self.loss, self.grads, self.ops, self.stats = loss, grads, ops, stats


def gradients(model: nn.Module) -> dict:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def run_eager(model: nn.Module, loss_of, items) -> Run:
    model.zero_grad(set_to_none=True)
    with CountOps() as counter:
        losses = [loss_of(x) for x in items]
    total = sum(losses)
    total.backward()
    return Run(total.item(), gradients(model), ops=counter.count)


def run_batched(model: nn.Module, loss_of, items, strategy: str, mapped: bool = False) -> Run:
    model.zero_grad(set_to_none=True)
    keys = list(model.state_dict())
    with fb.Graph(strategy=strategy) as g:
        losses = fb.map_batched(loss_of, items) if mapped else [loss_of(x) for x in items]
        assert all(isinstance(x, fb.Expression) for x in losses), [type(x) for x in losses]
        total = torch.stack(losses).sum()
        total.backward()
        run = Run(total.item(), gradients(model), stats=g.stats())
    assert list(model.state_dict()) == keys
    return run


def assert_same_training(eager: Run, batched: Run) -> None:
    """Equal losses, and every parameter's gradient equal (None where eager has None)."""
    assert batched.loss == pytest.approx(eager.loss, abs=ATOL, rel=0)
    assert batched.grads.keys() == eager.grads.keys()
    for name, want in eager.grads.items():
        got = batched.grads[name]
        assert (got is None) == (want is None), name
        if want is not None:
            torch.testing.assert_close(got, want, rtol=0, atol=ATOL, msg=name)


def check(model, loss_of, items, strategy, mapped=False) -> tuple[Run, Run]:
    """Run `model` eagerly and batched, assert they train alike; returns both runs."""
    eager = run_eager(model, loss_of, items)
    batched = run_batched(model, loss_of, items, strategy, mapped)
    assert_same_training(eager, batched)
    stats = batched.stats
    print(f"{strategy}: {stats.batches} launches, lower bound {stats.lower_bound}, "
          f"eager {eager.ops} ops, {stats.nodes} nodes")
    assert stats.batches >= stats.lower_bound
    return eager, batched
