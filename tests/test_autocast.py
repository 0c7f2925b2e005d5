"""`torch.autocast` and a graph: never a silent change of precision.

Eagerly, a torch call inside an autocast region computes in the region's lower precision (an
`nn.Linear` in bfloat16), and one outside it in its operands' dtype. A graph runs its kernels
later, at a forward, so:
- a node computes in the precision of its recording, whatever autocast region the forward that
  computes it runs in (a value asked for inside a region, of nodes recorded outside it);
- a torch call recorded inside an autocast region raises TypeError at the call, naming it: its
  batched kernel would compute in the operands' dtype instead of the region's, a silent change
  of values and dtype.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import flybatch as fb
from flybatch.graph import STRATEGIES


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def _inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(4, generator=gen) for _ in range(3)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_values_asked_for_inside_an_autocast_region_are_those_of_the_recording(strategy):
    linear, xs = _linear(), _inputs()
    with fb.Graph(strategy=strategy):
        hidden = [torch.tanh(linear(x)) for x in xs]
        joined = torch.cat([hidden[0], linear(xs[1])])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            values = [h.value() for h in hidden] + [joined.value()]
    want = [torch.tanh(linear(x)) for x in xs]
    want.append(torch.cat([want[0], linear(xs[1])]))
    for got, expected in zip(values, want):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_forward_forced_by_a_backward_inside_an_autocast_region_is_the_recorded_one(strategy):
    """The loss is computed as recorded; the backward itself, eagerly too, runs under autocast
    (its products in bfloat16: batched, they round otherwise, hence the tolerance)."""
    linear, xs = _linear(), _inputs()
    loss = sum(linear(x).square().sum() for x in xs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss.backward()
    want = [p.grad.clone() for p in linear.parameters()]
    linear.zero_grad(set_to_none=True)
    with fb.Graph(strategy=strategy):
        batched = sum(linear(x).square().sum() for x in xs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            batched.backward()
        assert batched.value().dtype == torch.float32
        torch.testing.assert_close(batched.value(), loss.detach(), rtol=0, atol=0)
    for p, expected in zip(linear.parameters(), want):
        torch.testing.assert_close(p.grad, expected, rtol=0, atol=1e-2)


def test_a_torch_call_recorded_inside_an_autocast_region_raises_naming_it():
    linear, xs = _linear(), _inputs()
    with fb.Graph():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with pytest.raises(TypeError, match=r"linear.*torch\.autocast"):
                linear(xs[0])
        assert linear(xs[0]).value().dtype == torch.float32  # outside the region: as before


@pytest.mark.parametrize("call", [lambda e: torch.tanh(e), lambda e: e.sum(),
                                  lambda e: e @ e, lambda e: e.unsqueeze(0) @ e])
def test_a_torch_call_or_product_of_expressions_inside_an_autocast_region_raises(call):
    linear, xs = _linear(), _inputs()
    with fb.Graph():
        h = linear(xs[0])
        with torch.autocast("cpu", dtype=torch.bfloat16), \
                pytest.raises(TypeError, match="torch.autocast"):
            call(h)


def test_elementwise_operators_inside_an_autocast_region_compute_as_eagerly():
    """Autocast leaves `+ - * /` in their operands' dtype: so do the graph's operators."""
    linear, xs = _linear(), _inputs()
    with fb.Graph():
        h = linear(xs[0])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = ((h * 2 + 1) / 3 - h).value()
    want = linear(xs[0])
    torch.testing.assert_close(got, ((want * 2 + 1) / 3 - want).detach(), rtol=0, atol=0)


def test_an_autocast_region_that_is_disabled_records_as_usual():
    linear, xs = _linear(), _inputs()
    with fb.Graph():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
            got = torch.tanh(linear(xs[0])).value()
    torch.testing.assert_close(got, torch.tanh(linear(xs[0])).detach(), rtol=0, atol=0)


def test_an_autocast_region_inside_map_batched_raises_map_batched_error_from_type_error():
    linear, xs = _linear(), _inputs()

    def instance(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return linear(x)

    with fb.Graph(), pytest.raises(fb.MapBatchedError) as raised:
        fb.map_batched(instance, xs)
    assert isinstance(raised.value.__cause__, TypeError)
