"""A shared-weight product of a concat of earlier forwards' results (a transition parser's
`affine(M, concat([v_s0, v_s1, v_s2, v_b0]), m)` over encoder states) runs as a gather of
projections computed once per source (projection.py): eager values and gradients under every
strategy, and only where it pays."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import flybatch as fb
from flybatch import _core, kernels, signatures, weight_grads
from flybatch.errors import ExecutionError

STRATEGIES = ["none", "depth", "agenda", "auto"]
TOKENS, WIDTH, FEATURES, OUT = 24, 5, 4, 5


def _parameters():
    torch.manual_seed(0)
    make = lambda *shape: torch.nn.Parameter(torch.randn(*shape, dtype=torch.float64))  # noqa: E731
    return {"W": make(WIDTH, 3), "E": make(TOKENS, 3), "pad": make(WIDTH),
            "M": make(OUT, FEATURES * WIDTH), "m": make(OUT)}


def _steps(n_steps: int = 10, states: int = 8, seed: int = 0):
    """Per step, per state, the tokens of its features (None: the learned pad)."""
    rng = random.Random(seed)
    return [[[rng.choice([None, *range(TOKENS)]) for _ in range(FEATURES)]
             for _ in range(states)] for _ in range(n_steps)]


def _flybatch(p, steps, strategy, **graph_args):
    """Encode every token in one forward, then each step's scores in a forward of their own;
    returns the score values per step, the loss's gradients and the graph's projections."""
    with fb.Graph(strategy=strategy, **graph_args) as g:
        states = [fb.tanh(p["W"] @ fb.lookup(p["E"], i)) for i in range(TOKENS)]
        g.forward()
        values, losses = [], []
        for step in steps:
            scores = [fb.tanh(fb.affine(p["M"], fb.concat(
                [p["pad"] if t is None else states[t] for t in features]), p["m"]))
                for features in step]
            values.append(g.forward(scores, stack=True))
            losses += [fb.sum_elems(s) for s in scores]
        loss = fb.esum(losses)
        if loss.value().requires_grad:
            loss.backward()
        return values, g.projections


def _eager(p, steps):
    states = [torch.tanh(p["W"] @ p["E"][i]) for i in range(TOKENS)]
    values = [torch.stack([torch.tanh(p["M"] @ torch.cat(
        [p["pad"] if t is None else states[t] for t in features]) + p["m"])
        for features in step]) for step in steps]
    return values, torch.autograd.grad(sum(v.sum() for v in values), list(p.values()))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_product_of_a_concat_of_earlier_results_gives_eager_values_and_gradients(strategy):
    p, steps = _parameters(), _steps()
    want_values, want_grads = _eager(p, steps)
    values, projections = _flybatch(p, steps, strategy)
    # the later steps read projections; not under `none`, whose batches are single nodes
    assert (projections.batches > 0) == (strategy != "none")
    for got, want in zip(values, want_values):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for got, want in zip([q.grad for q in p.values()], want_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_product_of_a_concat_gives_eager_values_under_no_grad(strategy):
    p, steps = _parameters(), _steps()
    want_values, _ = _eager(p, steps)
    with torch.no_grad():
        values, projections = _flybatch(p, steps, strategy)
    assert (projections.batches > 0) == (strategy != "none")  # (single-node batches)
    for got, want in zip(values, want_values):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert not got.requires_grad


def test_each_source_is_projected_once_and_each_later_step_gathers_instead_of_multiplying():
    p, steps = _parameters(), _steps(n_steps=12)
    before, weight_products = dict(kernels.gemm_counts), weight_grads.deferred_counts["products"]
    _, projections = _flybatch(p, steps, "agenda")
    products = sum(kernels.gemm_counts.values()) - sum(before.values())
    # Two sources (the encoder's states and the pad), each projected once by M; the steps
    # before it paid multiplied as written (one product each), the others gathered.
    assert projections.products == 2
    assert projections.batches < len(steps)
    direct = len(steps) - projections.batches
    # Backward: a weight-gradient product per weight whose gradient was deferred (none of
    # these small ones at the default threshold; weight_grads.py).
    weight_products = weight_grads.deferred_counts["products"] - weight_products
    assert products == 1 + direct + projections.products + weight_products
    # Both projections multiply by one copy of M's blocks (autograd saves it once)
    assert len(projections.blocks) == 1


def test_the_concat_of_a_product_that_gathers_projections_is_not_run():
    """Its only reader gathers projections instead of reading it: the concat batch is deferred
    (no launch, no reads), and the steps before the projections pay run it."""
    p, steps = _parameters(), _steps(n_steps=12)
    with fb.Graph(strategy="agenda") as g:
        states = [fb.tanh(p["W"] @ fb.lookup(p["E"], i)) for i in range(TOKENS)]
        g.forward()
        for step in steps:
            g.forward([fb.affine(p["M"], fb.concat(
                [p["pad"] if t is None else states[t] for t in features]), p["m"])
                for features in step])
        gathered = g.projections.batches
        assert 0 < gathered < len(steps)
        assert len(g.deferred) == gathered
        stats = g.stats()  # the schedule's launches: run, and deferred
        assert stats.deferred == gathered and stats.launches_over_bound == 1.0
        concats = [size for sig, size in g.launches
                   if signatures.describe(sig, g).startswith("concat")]
        assert concats == [len(steps[0])] * (len(steps) - gathered)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_deferred_concat_read_later_gives_eager_values_and_gradients(strategy):
    """A concat left uncomputed by its forward is computed when a later forward or a value
    request reads it, from the results it read: eager values and gradients."""
    p, steps = _parameters(), _steps(n_steps=12)
    eager_feats = [[torch.cat([p["pad"] if t is None else torch.tanh(p["W"] @ p["E"][t])
                               for t in features]) for features in step] for step in steps]
    want_scores = [torch.stack([p["M"] @ f + p["m"] for f in step]) for step in eager_feats]
    want_loss = sum(f.sum() for step in eager_feats for f in step) + \
        sum(s.sum() for s in want_scores)
    want_grads = torch.autograd.grad(want_loss, list(p.values()))
    with fb.Graph(strategy=strategy) as g:
        states = [fb.tanh(p["W"] @ fb.lookup(p["E"], i)) for i in range(TOKENS)]
        g.forward()
        feats, scores = [], []
        for step in steps:
            feats.append([fb.concat([p["pad"] if t is None else states[t] for t in features])
                          for features in step])
            scores.append([fb.affine(p["M"], f, p["m"]) for f in feats[-1]])
            g.forward(scores[-1])
        assert (len(g.deferred) > 0) == (strategy != "none")
        # value requests (of one, of a step's stacked, of a step's as a list), then a later
        # forward reading every one
        torch.testing.assert_close(feats[-1][0].value(), eager_feats[-1][0], rtol=1e-12,
                                   atol=1e-12)
        torch.testing.assert_close(g.forward(feats[-2], stack=True),
                                   torch.stack(eager_feats[-2]), rtol=1e-12, atol=1e-12)
        for got, want in zip(g.forward(feats[-3]), eager_feats[-3]):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        loss = fb.esum([fb.sum_elems(f) for step in feats for f in step] +
                       [fb.sum_elems(s) for step in scores for s in step])
        torch.testing.assert_close(loss.value(), want_loss, rtol=1e-12, atol=1e-12)
        assert not g.deferred
        loss.backward()
    for got, want in zip([q.grad for q in p.values()], want_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_reading_a_deferred_concat_after_its_input_was_written_in_place_raises():
    """Eagerly the concat holds its inputs as they were; computed after a write into one, it
    would hold the new values: flybatch refuses, naming the write."""
    p, steps = _parameters(), _steps(n_steps=12)
    with fb.Graph(strategy="agenda") as g:
        states = [fb.tanh(p["W"] @ fb.lookup(p["E"], i)) for i in range(TOKENS)]
        g.forward()
        for step in steps:
            feats = [fb.concat([p["pad"], *[states[t or 0] for t in features[1:]]])
                     for features in step]
            g.forward([fb.affine(p["M"], f, p["m"]) for f in feats])
        assert feats[0].id in {int(v) for d in g.deferred.values() for v in d.nodes}
        with torch.no_grad():
            p["pad"].add_(1.0)
        with pytest.raises(ExecutionError, match="written in place or rebound"):
            feats[0].value()


def test_a_large_result_read_by_few_later_rows_is_not_projected():
    """Projecting the 24 encoder rows and the pad by four blocks costs 100 row products; two
    steps of two states multiply 16 (each at most ~2.5x slower as small products): it does not
    pay, the product runs as written."""
    p = _parameters()
    steps = [[[3, 5, None, 7]] * 2] * 2
    want_values, want_grads = _eager(p, steps)
    values, projections = _flybatch(p, steps, "agenda")
    assert projections.products == 0 and projections.batches == 0
    for got, want in zip(values, want_values):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_weight_whose_projections_would_dwarf_their_sources_is_multiplied_as_written():
    """A table holds k * out numbers per source row where the source holds d: 4 blocks of 24
    outputs would be 96 per row of 5, more than TABLE_MAX_GROWTH times as many."""
    p, steps = _parameters(), _steps(n_steps=12)
    p["M"] = torch.nn.Parameter(torch.randn(6 * FEATURES, FEATURES * WIDTH, dtype=torch.float64))
    p["m"] = torch.nn.Parameter(torch.randn(6 * FEATURES, dtype=torch.float64))
    want_values, want_grads = _eager(p, steps)
    values, projections = _flybatch(p, steps, "agenda")
    assert projections.products == 0
    for got, want in zip(values, want_values):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_concat_of_a_result_of_the_same_forward_is_multiplied_as_written():
    p, steps = _parameters(), _steps(n_steps=1)
    with fb.Graph(strategy="agenda") as g:  # encoder and steps in ONE forward
        states = [fb.tanh(p["W"] @ fb.lookup(p["E"], i)) for i in range(TOKENS)]
        scores = [fb.affine(p["M"], fb.concat([p["pad"] if t is None else states[t]
                                               for t in features]), p["m"])
                  for features in steps[0]]
        g.forward(scores)
        assert g.projections.products == 0


def test_a_weight_written_in_place_between_forwards_is_projected_anew():
    """As eagerly, a parameter is read when the forward runs: an in-place write (an optimizer
    step) between two forwards makes the next one read projections of the new weight."""
    p, steps = _parameters(), _steps(n_steps=12)
    with torch.no_grad():  # (computed outside the graph block, which would record it)
        eager_states = [torch.tanh(p["W"] @ p["E"][i]) for i in range(TOKENS)]
        wants = [torch.stack([(p["M"] if n < 8 else 0.5 * p["M"]) @ torch.cat(
            [p["pad"] if t is None else eager_states[t] for t in features]) + p["m"]
            for features in step]) for n, step in enumerate(steps)]
    with fb.Graph(strategy="agenda") as g:
        states = [fb.tanh(p["W"] @ fb.lookup(p["E"], i)) for i in range(TOKENS)]
        g.forward()
        for n, (step, want) in enumerate(zip(steps, wants)):
            if n == 8:
                with torch.no_grad():
                    p["M"].mul_(0.5)
            scores = [fb.affine(p["M"], fb.concat([p["pad"] if t is None else states[t]
                                                   for t in features]), p["m"])
                      for features in step]
            got = g.forward(scores, stack=True)
            torch.testing.assert_close(got.detach(), want, rtol=1e-12, atol=1e-12)
        assert g.projections.products == 4  # two sources, before and after the write


def test_a_concat_of_items_of_different_widths_is_multiplied_as_written():
    torch.manual_seed(0)
    E = torch.nn.Parameter(torch.randn(TOKENS, 4, dtype=torch.float64))
    F = torch.nn.Parameter(torch.randn(TOKENS, 2, dtype=torch.float64))
    M = torch.nn.Parameter(torch.randn(3, 6, dtype=torch.float64))
    m = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    rows = [[(step + j) % TOKENS for j in range(8)] for step in range(10)]
    wants = [torch.stack([M @ torch.cat([torch.tanh(E[r]), torch.tanh(F[r])]) + m for r in step])
             for step in rows]
    with fb.Graph(strategy="agenda") as g:
        a = [fb.tanh(fb.lookup(E, i)) for i in range(TOKENS)]
        b = [fb.tanh(fb.lookup(F, i)) for i in range(TOKENS)]
        g.forward()
        for step, want in zip(rows, wants):
            got = g.forward([fb.affine(M, fb.concat([a[r], b[r]]), m) for r in step],
                            stack=True)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert g.projections.products == 0



@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parsers_written_per_sentence_under_map_batched_read_projections(strategy):
    """Each instance encodes its sentence, then asks for its scores' values at every step: the
    steps of all instances share a forward, and read projections of the encoders' states."""
    p = _parameters()
    sentences = [_steps(n_steps=20 + i, states=1, seed=i) for i in range(5)]
    want_values, want_grads = _eager(p, [step for steps in sentences for step in steps])

    def parse(steps):
        states = [fb.tanh(p["W"] @ fb.lookup(p["E"], i)) for i in range(TOKENS)]
        values, losses = [], []
        for (features,) in steps:
            score = fb.tanh(fb.affine(p["M"], fb.concat(
                [p["pad"] if t is None else states[t] for t in features]), p["m"]))
            values.append(score.value())
            losses.append(fb.sum_elems(score))
        return values, losses

    with fb.Graph(strategy=strategy) as g:
        results = fb.map_batched(parse, sentences)
        fb.esum([loss for _, losses in results for loss in losses]).backward()
        assert (g.projections.batches > 0) == (strategy != "none")  # (single-node batches)
    got_values = [value for values, _ in results for value in values]
    torch.testing.assert_close(torch.stack(got_values), torch.cat(want_values), rtol=1e-12,
                               atol=1e-12)
    for got, want in zip([q.grad for q in p.values()], want_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_batch_reading_more_sources_than_it_has_rows_is_multiplied_as_written():
    """Under `none` every node is a batch of its own and every encoder state a source of one
    row: per-source projections would be many and tiny (MIN_ROWS_PER_SOURCE), so none is made;
    under `agenda` the same program reads two sources (the encoder's batch and the pad) per
    batch of eight states and is projected."""
    p, steps = _parameters(), _steps(n_steps=12)
    want_values, _ = _eager(p, steps)
    values, projections = _flybatch(p, steps, "none")
    assert projections.products == 0 and projections.batches == 0
    for got, want in zip(values, want_values):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    _, projections = _flybatch(p, steps, "agenda")
    assert projections.products > 0


def test_the_core_lists_the_projected_row_each_node_reads_as_each_block():
    """`_core.concat_rows`: the batches a concat batch's nodes read (ascending) and, at n * k +
    i, the row of their projection tables joined in that order that block i of node n reads:
    (its argument's row in the sources' results end to end) * k + i."""
    p = _parameters()
    features = [[3, None, 5, 7], [None, 0, 23, 3]]
    with fb.Graph(strategy="agenda") as g:
        states = [fb.tanh(p["W"] @ fb.lookup(p["E"], i)) for i in range(TOKENS)]
        g.forward()
        concats = [fb.concat([p["pad"] if t is None else states[t] for t in tokens])
                   for tokens in features]
        g.forward(concats)
        k, sources, source_rows, table_rows = _core.concat_rows(
            g, np.array([c.id for c in concats], np.int64))
        assert k == FEATURES
        assert list(sources) == sorted(sources) and len(sources) == 2  # encoder, pad
        assert list(source_rows) == [g.values[s].shape[0] for s in sources]
        start = dict(zip(sources, np.cumsum([0, *source_rows]).tolist()))
        pad = g.parameter_node(p["pad"])  # (the one node of the parameter in the graph)
        want = []
        for tokens in features:
            for i, t in enumerate(tokens):
                batch, row = g.position(pad if t is None else states[t].id)
                want.append((start[batch] + row) * k + i)
        assert np.frombuffer(table_rows, np.int64).tolist() == want


def test_the_core_lists_no_projected_rows_for_concats_of_different_arities():
    p = _parameters()
    with fb.Graph(strategy="none") as g:
        states = [fb.tanh(p["W"] @ fb.lookup(p["E"], i)) for i in range(TOKENS)]
        concats = [fb.concat(states[:2]), fb.concat(states[:3])]
        g.forward(concats)
        assert _core.concat_rows(g, np.array([c.id for c in concats], np.int64)) is None


def test_the_core_refuses_projected_rows_of_nodes_not_yet_placed():
    p = _parameters()
    with fb.Graph(strategy="agenda") as g:
        pending = fb.concat([fb.tanh(p["W"] @ fb.lookup(p["E"], 0))] * 2)
        with pytest.raises(ValueError, match="not placed"):
            _core.concat_rows(g, np.array([pending.id], np.int64))
