"""Captured `nn.LSTM` and `nn.GRU` over one instance's sequence: one packed launch per layer.

Each instance calls the torch module on its own sequence, as code written for batch size one
does (input (T, 1, I), batch-first (1, T, I), or unbatched (T, I)), with zero or given initial
states. Inside a graph each layer, both directions included, is ONE node whose kernel runs every
instance's sequence as one packed sequence: for instances of lengths 1..9 the outputs, `h_n`,
`c_n` and every gradient (parameters, inputs, initial states) equal eager PyTorch's, under every
strategy and `map_batched`, with one launch of the layer per layer. What the packed layer does
not compute (several rows per instance, dropout between layers in training) is unrolled into
cells, as before, and still equals torch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import flybatch as fb
from flybatch.graph import STRATEGIES

F64 = torch.float64
ATOL = 1e-9
IN, H = 3, 4
LENGTHS = [3, 1, 9, 4, 9, 2, 7, 5, 6, 8]  # 1..9, two of equal length

pytestmark = pytest.mark.usefixtures("one_thread")


def seeded(module: nn.Module, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    module.reset_parameters() if hasattr(module, "reset_parameters") else None
    return module.double()


class Instance:
    """One instance's sequence, and initial states when given, as leaves that require grad."""

    def __init__(self, gen: torch.Generator, length: int, layout: str, states: tuple | None,
                 rows: int = 1):
        shape = {"seq": (length, rows, IN), "batch_first": (rows, length, IN),
                 "unbatched": (length, IN)}[layout]
        self.x = torch.randn(shape, generator=gen, dtype=F64).requires_grad_()
        self.states = None if states is None else tuple(
            torch.randn(s, generator=gen, dtype=F64).requires_grad_() for s in states)
        self.own = [self.x, *(self.states or ())]  # the leaves of this instance alone

    def leaves(self) -> list[torch.Tensor]:
        return self.own

    def call(self, module: nn.Module):
        """The module on this instance: (output, h_n, c_n), c_n None for a GRU."""
        states = self.states
        if states is not None and isinstance(module, nn.LSTM):
            states = tuple(states)
        elif states is not None:
            states = states[0]
        output, finals = module(self.x, states)
        h_n, c_n = finals if isinstance(finals, tuple) else (finals, None)
        return output, h_n, c_n


def instances(module: nn.Module, layout: str, given: bool, lengths=LENGTHS) -> list[Instance]:
    gen = torch.Generator().manual_seed(len(lengths))
    dirs = 2 if module.bidirectional else 1
    state = (module.num_layers * dirs,) + (() if layout == "unbatched" else (1,)) + (H,)
    states = None if not given else (state, state) if isinstance(module, nn.LSTM) else (state,)
    return [Instance(gen, n, layout, states) for n in lengths]


def loss(output, h_n, c_n):
    """A scalar that weighs every element of the results differently."""
    total = output.square().sum() + (h_n * 1.5).sin().sum()
    return total if c_n is None else total + (c_n * 0.7).cos().sum()


class Result:
    def __init__(self, values, loss, grads):
        self.values, self.loss, self.grads = values, loss, grads


def grads_of(module, items) -> list:
    tensors = list(module.parameters()) + [t for item in items for t in item.leaves()]
    return [t.grad.clone() for t in tensors]


def clear(module, items) -> None:
    module.zero_grad(set_to_none=True)
    for item in items:
        for t in item.leaves() + list(item.states or ()):
            t.grad = None


def eagerly(module, items) -> Result:
    clear(module, items)
    outs = [item.call(module) for item in items]
    total = sum(loss(*out) for out in outs)
    total.backward()
    return Result([[t for t in out if t is not None] for out in outs], total.item(),
                  grads_of(module, items))


def batched(module, items, strategy: str, mapped: bool = False) -> tuple[Result, fb.Stats]:
    clear(module, items)
    with fb.Graph(strategy=strategy, dtype=F64) as g:
        if mapped:
            outs = fb.map_batched(lambda item: item.call(module), items)
        else:
            outs = [item.call(module) for item in items]
        total = torch.stack([loss(*out) for out in outs]).sum()
        values = [[e.value() for e in out if e is not None] for out in outs]
        total.backward()
        return Result(values, total.item(), grads_of(module, items)), g.stats()


def assert_same(got: Result, want: Result) -> None:
    assert got.loss == pytest.approx(want.loss, abs=ATOL, rel=0)
    for got_values, want_values in zip(got.values, want.values):
        for a, b in zip(got_values, want_values, strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=0, atol=ATOL)
    for a, b in zip(got.grads, want.grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL)


def layer_launches(stats: fb.Stats) -> int:
    return sum(n for sig, n in stats.by_signature.items() if sig.startswith("packed_"))


MODULES = {"LSTM": nn.LSTM, "GRU": nn.GRU}


@pytest.mark.parametrize("given", [False, True], ids=["zero_states", "given_states"])
@pytest.mark.parametrize("layout", ["seq", "batch_first", "unbatched"])
@pytest.mark.parametrize("layers,bidirectional", [(1, False), (1, True), (2, False), (2, True)],
                         ids=["1", "1bi", "2", "2bi"])
@pytest.mark.parametrize("kind", MODULES)
def test_a_torch_rnn_on_sequences_of_any_length_is_one_launch_per_layer_and_equals_torch(
        kind, layers, bidirectional, layout, given):
    module = seeded(MODULES[kind](IN, H, num_layers=layers, bidirectional=bidirectional,
                                  batch_first=layout == "batch_first"))
    items = instances(module, layout, given)
    want = eagerly(module, items)
    for strategy in STRATEGIES:
        got, stats = batched(module, items, strategy)
        assert_same(got, want)
        per_forward = len(items) if strategy == "none" else 1
        assert layer_launches(stats) == layers * per_forward, strategy
    got, stats = batched(module, items, "auto", mapped=True)
    assert_same(got, want)
    assert layer_launches(stats) == layers


@pytest.mark.parametrize("kind", MODULES)
def test_a_learned_initial_state_shared_by_every_instance_gets_their_summed_gradient(kind):
    module = seeded(MODULES[kind](IN, H, bidirectional=True))
    learned = [nn.Parameter(torch.randn(2, 1, H, dtype=F64)) for _ in range(2)]
    items = instances(module, "seq", given=False)
    for item in items:  # every instance starts from the same parameters
        item.states = tuple(learned) if kind == "LSTM" else (learned[0],)
    want = eagerly(module, items), [p.grad for p in learned]
    got, stats = batched(module, items, "auto")
    assert_same(got, want[0])
    for p, grad in zip(learned, want[1]):
        torch.testing.assert_close(p.grad, grad, rtol=0, atol=ATOL)
    assert layer_launches(stats) == 1


def test_a_layer_without_biases_equals_torch():
    module = seeded(nn.LSTM(IN, H, num_layers=2, bias=False, bidirectional=True))
    items = instances(module, "seq", given=True)
    got, stats = batched(module, items, "auto")
    assert_same(got, eagerly(module, items))
    assert layer_launches(stats) == 2


def test_the_layer_states_and_output_batch_over_lengths_as_a_few_launches():
    """The whole minibatch's LSTM: its two layers, the output rows of the top one, the picks of
    the state rows and their reshapes, whatever the mix of lengths."""
    module = seeded(nn.LSTM(IN, H, num_layers=2, bidirectional=True))
    with fb.Graph(strategy="agenda", dtype=F64) as g:
        outs = [item.call(module) for item in instances(module, "seq", given=False)]
        g.forward([e for out in outs for e in out])
        launches = g.stats().by_signature
    assert layer_launches(g.stats()) == 2
    assert launches["rnn_output(n, 8)[2]"] == 1
    assert launches["rnn_state(n, 8)"] == 1  # h_n and c_n of both layers


def test_the_reverse_direction_of_a_short_sequence_starts_at_its_own_end():
    """(Padding would run it over the zeros past its end first.)"""
    module = seeded(nn.GRU(IN, H, bidirectional=True))
    items = instances(module, "seq", given=False, lengths=[1, 9])
    got, _ = batched(module, items, "auto")
    assert_same(got, eagerly(module, items))


# ---- what stays unrolled ------------------------------------------------------------------------
def cells(stats: fb.Stats) -> int:
    return sum(n for sig, n in stats.by_signature.items() if "_step" in sig)


def test_several_rows_per_instance_are_unrolled_into_cells_and_equal_torch():
    module = seeded(nn.LSTM(IN, H, bidirectional=True))
    gen = torch.Generator().manual_seed(0)
    items = [Instance(gen, n, "seq", None, rows=2) for n in (2, 5, 3)]  # 2 rows each
    got, stats = batched(module, items, "auto")
    assert_same(got, eagerly(module, items))
    assert layer_launches(stats) == 0 and cells(stats) > 0


def test_dropout_between_layers_in_training_is_unrolled_and_in_evaluation_is_packed():
    module = seeded(nn.LSTM(IN, H, num_layers=2, dropout=0.5))
    items = instances(module, "seq", given=False)
    _, stats = batched(module, items, "auto")
    assert layer_launches(stats) == 0 and cells(stats) > 0
    assert any(sig.startswith("dropout") for sig in stats.by_signature)
    module.eval()
    got, stats = batched(module, items, "auto")
    assert_same(got, eagerly(module, items))
    assert layer_launches(stats) == 2


def test_an_lstm_with_projections_raises_naming_the_op():
    module = seeded(nn.LSTM(IN, H, proj_size=2))
    with fb.Graph(dtype=F64), pytest.raises(ValueError, match="torch.lstm: 5 weights per layer"):
        module(torch.randn(4, 1, IN, dtype=F64))
