"""Incremental forward: a forwarded graph keeps growing, and the next forward runs only the new
nodes, reading earlier results where it needs them.

Values and gradients after any number of intermediate forwards equal those of one forward over
the whole graph, and no node is ever computed twice (counted in kernel launches).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import eager
import flybatch as fb
from flybatch.graph import STRATEGIES

VOCAB, H = 9, 4
TOL = eager.TOLERANCE[torch.float64]


def make_params():
    gen = torch.Generator().manual_seed(0)

    def p(*shape):
        return torch.nn.Parameter(torch.randn(*shape, generator=gen, dtype=torch.float64) * 0.5)

    return {"E": p(VOCAB, H), "W": p(H, 2 * H), "b": p(H), "U": p(3, H)}


def build(P, batch, checkpoint):
    """The README's RNN per instance; `checkpoint()` after every step (a forward, or nothing)."""
    outs = []
    for words, label in batch:
        h = fb.zeros(H)
        for w in words:
            h = fb.tanh(P["W"] @ fb.concat([h, fb.lookup(P["E"], w)]) + P["b"])
            outs.append(h)
            checkpoint()
        outs.append(fb.pick_neg_log_softmax(P["U"] @ h, label))
    return outs


def run(strategy, batch, forward_at=frozenset()):
    """Values, gradients and launches, forwarding after the steps numbered in `forward_at`."""
    P = make_params()
    steps = iter(range(10**6))
    with fb.Graph(strategy=strategy, dtype=torch.float64) as g:
        def checkpoint():
            if next(steps) in forward_at:
                g.forward()

        outs = build(P, batch, checkpoint)
        values = [v.detach().clone() for v in g.forward(outs)]
        fb.esum([fb.sum_elems(o) for o in outs]).backward()
        launches = g.stats().batches
    return values, {k: p.grad for k, p in P.items()}, launches


batches = st.lists(st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
                             st.integers(0, 2)), min_size=1, max_size=5)


@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=15)
@given(batch=batches, forward_at=st.frozensets(st.integers(0, 30), max_size=6))
def test_extending_a_forwarded_graph_gives_the_one_shot_values(strategy, batch, forward_at):
    values, _, _ = run(strategy, batch, forward_at)
    expected, _, _ = run(strategy, batch)
    for v, e in zip(values, expected, strict=True):
        torch.testing.assert_close(v, e, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=15)
@given(batch=batches, forward_at=st.frozensets(st.integers(0, 30), max_size=6))
def test_gradients_through_incremental_forwards_equal_the_one_shot_gradients(
        strategy, batch, forward_at):
    _, grads, _ = run(strategy, batch, forward_at)
    _, expected, _ = run(strategy, batch)
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], rtol=TOL, atol=TOL, msg=name)


@given(batch=batches, forward_at=st.frozensets(st.integers(0, 30), max_size=6))
def test_incremental_forwards_compute_every_node_exactly_once(batch, forward_at):
    # Under `none` every non-leaf node is one launch, so a recomputed node would show.
    _, _, launches = run("none", batch, forward_at)
    _, _, expected = run("none", batch)
    assert launches == expected


@pytest.mark.parametrize("strategy", ["depth", "agenda"])
@given(n=st.integers(1, 10), k=st.integers(1, 5), m=st.integers(1, 5))
def test_extending_chains_launches_only_the_new_ops(strategy, n, k, m):
    with fb.Graph(strategy=strategy) as g:
        ends = []
        for _ in range(n):
            x = fb.input(torch.randn(3))
            for _ in range(k):
                x = fb.tanh(x)
            ends.append(x)
        g.forward()
        assert g.stats().batches == k
        for x in ends:
            for _ in range(m):
                x = fb.sigmoid(x)
        g.forward()
        assert g.stats().batches == k + m


def test_asking_for_a_computed_value_launches_nothing():
    with fb.Graph() as g:
        y = fb.tanh(fb.input([1.0, 2.0]))
        y.value()
        before = g.stats().batches
        y.value()
        y.numpy()
        g.forward([y])
        g.forward()
        assert g.stats().batches == before


def test_a_value_request_computes_every_pending_node():
    with fb.Graph() as g:
        a = fb.tanh(fb.input([1.0]))
        b = fb.sigmoid(fb.input([2.0]))
        a.value()
        launches = g.stats().batches
        b.value()
        assert g.stats().batches == launches == 2


def test_earlier_values_are_unchanged_by_extending_the_graph():
    with fb.Graph(dtype=torch.float64):
        x = fb.input([0.5, -1.0, 2.0])
        y = fb.tanh(x)
        first = y.value().clone()
        z = fb.esum([fb.sigmoid(y), fb.tanh(y), y * 2])
        z.value()
        assert torch.equal(y.value(), first)


def greedy_decode(B, P, start: int, steps: int) -> list:
    """Per-instance code whose control flow depends on computed values (argmax feedback)."""
    h = B.zeros(H)
    w, outs = start, []
    for _ in range(steps):
        h = B.tanh(P["W"] @ B.concat([h, B.lookup(P["E"], w)]) + P["b"])
        scores = P["U"] @ h
        w = int(scores.argmax()) * 3 % VOCAB  # asks for a value: forwards what is pending
        outs += [h, B.pick_neg_log_softmax(scores, w % 3)]
    return outs


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_control_flow_on_computed_values_matches_eager(strategy):
    P = make_params()

    def build(B):
        return [o for start in range(5) for o in greedy_decode(B, P, start, 2 + start)]

    expected = eager.run(eager, strategy, torch.float64, build, list(P.values()))
    actual = eager.run(fb, strategy, torch.float64, build, list(P.values()))
    eager.assert_same(actual, expected, torch.float64)


def test_forward_given_a_generator_of_new_expressions_returns_their_values():
    x = torch.arange(3.0)
    with fb.Graph() as g:
        values = g.forward(fb.tanh(fb.input(x)) * k for k in (1.0, 2.0))
        torch.testing.assert_close(torch.stack(values), torch.stack([x.tanh(), 2 * x.tanh()]))


@pytest.mark.parametrize("order", ["in order", "shuffled", "two results"])
def test_forward_stacked_returns_the_values_as_one_tensor_with_their_gradients(order):
    P = make_params()
    words = [3, 1, 4, 1, 5, 8]

    def scores(g_words, extra):
        out = [P["U"] @ fb.tanh(fb.lookup(P["E"], w)) for w in g_words]
        return out + [fb.tanh(P["U"] @ fb.lookup(P["E"], w)) for w in extra]

    with fb.Graph() as g:
        exprs = scores(words, [2, 7] if order == "two results" else [])
        if order == "shuffled":
            exprs = exprs[::-1][::2] + exprs[::-1][1::2]
        stacked = g.forward(exprs, stack=True)
        listed = torch.stack(g.forward(exprs))
        torch.testing.assert_close(stacked, listed)
        stacked.pow(2).sum().backward()
        grad = P["U"].grad.clone()
    P["U"].grad = None
    with fb.Graph() as g:
        exprs = scores(words, [2, 7] if order == "two results" else [])
        if order == "shuffled":
            exprs = exprs[::-1][::2] + exprs[::-1][1::2]
        torch.stack(g.forward(exprs)).pow(2).sum().backward()
    torch.testing.assert_close(grad, P["U"].grad)


def test_forward_stacked_refuses_expressions_of_different_shapes():
    with fb.Graph() as g:
        a, b = fb.input(torch.ones(2)), fb.input(torch.ones(3))
        with pytest.raises(fb.ShapeError, match=r"one shape, got \(2,\), \(3,\)"):
            g.forward([a, b], stack=True)


def test_forward_stacked_reads_a_generator_and_refuses_another_graphs_expression():
    x = torch.arange(3.0)
    with fb.Graph() as g:
        values = g.forward((fb.tanh(fb.input(x)) * k for k in (1.0, 2.0)), stack=True)
        torch.testing.assert_close(values, torch.stack([x.tanh(), 2 * x.tanh()]))
        mine = fb.tanh(fb.input(x))
        with fb.Graph() as h:
            theirs = fb.tanh(fb.input(x))
            h.forward()
            with pytest.raises(fb.GraphError, match="another graph"):
                g.forward([mine, theirs], stack=True)
