"""Padded ops: vectors (and matrix rows) of any length run as ONE kernel.

`softmax`, `log_softmax` and `pick_neg_log_softmax` of vectors, products of an instance matrix
(n_i, d) with a vector (`M_i @ q`) and of a vector with it (`weights_i @ M_i`), and `stack` of
any number of rows batch across lengths: one launch per op, whatever the mix of lengths, with
eager PyTorch's values and gradients (float64), under every strategy. A result whose length
varies is stored padded; every node still has, and shows, its own shape.
"""

from __future__ import annotations

import pytest
import torch

import eager
import flybatch as fb
from across_lengths import F64, launches, parameters, same_as_eager, vectors
from flybatch.graph import STRATEGIES

D = 4
LENGTHS = [2, 5, 7, 1, 5, 3]  # source lengths of the instances, mixed on purpose
STEPS = 3


def _vectors(seed: int, n: int, size: int = D) -> list[torch.Tensor]:
    return vectors(seed, n, size)


# ---- softmaxes of vectors of any length -------------------------------------------------------
P = parameters(W=(D, D), u=(D,))


def scores(B, seed: int, n: int):
    """A vector of n scores that depends on the parameters: `tanh(W x_j) . u` stacked."""
    return B.stack([B.dot(P["u"], B.tanh(B.matmul(P["W"], B.input(x))))
                    for x in _vectors(seed, n)])


def softmaxes(B, lengths=LENGTHS) -> list:
    outs = []
    for seed, n in enumerate(lengths):
        s = scores(B, seed, n)
        outs += [B.softmax(s), B.log_softmax(s), B.pick_neg_log_softmax(s, seed % n)]
    return outs


def test_softmaxes_of_vectors_of_different_lengths_are_one_launch_each():
    for strategy in ("depth", "agenda", "auto"):
        stats = launches(lambda B: softmaxes(B, [2, 5, 7]), strategy)
        assert stats.by_signature["softmax(n,)"] == 1
        assert stats.by_signature["log_softmax(n,)"] == 1
        assert stats.by_signature["pick_neg_log_softmax(n,)"] == 1
        assert stats.by_signature["stack(n,)"] == 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_softmaxes_of_vectors_of_different_lengths_match_eager(strategy):
    same_as_eager(strategy, softmaxes, list(P.values()))


def test_a_softmax_of_a_padded_vector_sums_to_one_over_its_own_length():
    with fb.Graph(dtype=F64):
        weights = [fb.softmax(scores(fb, seed, n)) for seed, n in enumerate(LENGTHS)]
        for w, n in zip(weights, LENGTHS):
            assert w.value().shape == (n,)
            assert w.value().sum().item() == pytest.approx(1.0, abs=1e-15)


# ---- attention over source positions ------------------------------------------------------------
A = parameters(1, W=(D, D), U=(D, D), V=(D, 2 * D))


def attention_decoder(B, lengths=LENGTHS, steps: int = STEPS) -> list:
    """Per instance: encoder states of its n source positions stacked as keys (n, D); a decoder
    that, at each step, scores the keys (`K @ s`), takes their softmax, reads the context
    (`weights @ K`) and moves on `s = tanh(V [context; s])`, with a pointer loss over the
    positions (`pick_neg_log_softmax(scores, gold)`)."""
    outs = []
    for seed, n in enumerate(lengths):
        keys = B.stack([B.tanh(B.matmul(A["W"], B.input(x))) for x in _vectors(seed, n)])
        s = B.tanh(B.matmul(A["U"], B.input(_vectors(100 + seed, 1)[0])))
        for t in range(steps):
            score = B.matmul(keys, s)
            weights = B.softmax(score)
            context = B.matmul(weights, keys)
            outs += [weights, B.log_softmax(score), B.pick_neg_log_softmax(score, (seed + t) % n)]
            s = B.tanh(B.matmul(A["V"], B.concat([context, s])))
        outs.append(s)
    return outs


def test_attention_over_sources_of_different_lengths_is_one_launch_per_op_per_step():
    """(The losses, which no later step reads, may wait and run as fewer launches.)"""
    assert len(set(LENGTHS)) == 5
    for strategy in ("depth", "agenda", "auto"):
        stats = launches(attention_decoder, strategy)
        assert stats.by_signature["stack(n, 4)"] == 1
        for sig in ("matmul(n, 4)(4,)", "softmax(n,)", "matmul(n,)(n, 4)"):
            assert stats.by_signature[sig] == STEPS, sig
        for sig in ("log_softmax(n,)", "pick_neg_log_softmax(n,)"):
            assert 1 <= stats.by_signature[sig] <= STEPS, sig


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_attention_over_sources_of_different_lengths_matches_eager(strategy):
    same_as_eager(strategy, attention_decoder, list(A.values()))


# ---- padded results, read by any op ------------------------------------------------------------
def readers(B) -> list:
    """Ops that batch only equal shapes, reading padded results: each reads its own length."""
    outs = []
    for seed, n in enumerate(LENGTHS):
        w = B.softmax(scores(B, seed, n))
        keys = B.stack([B.input(x) for x in _vectors(50 + seed, n)])
        outs += [w, keys, B.tanh(w), w[n - 1], w[0:n], B.sum_elems(w), B.concat([w, w]),
                 B.reshape(keys, (n * D,)), B.transpose(keys), keys[n // 2],
                 B.squared_norm(w - B.ones(n))]
    return outs


def test_padded_results_read_by_ops_of_equal_shapes_have_each_nodes_shape():
    with fb.Graph(dtype=F64) as g:
        outs = readers(fb)
        for o, value in zip(outs, g.forward(outs)):
            assert value.shape == o.shape
            assert o.value().shape == o.shape


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_padded_results_read_by_ops_of_equal_shapes_match_eager(strategy):
    same_as_eager(strategy, readers, list(P.values()))


def test_a_padded_op_reads_results_of_an_earlier_forward_as_eager_does():
    def build(B, peek: bool):
        first = [scores(B, seed, n) for seed, n in enumerate(LENGTHS)]
        if peek:  # a forward: the scores are done (stored padded) before their readers exist
            first[0].value()
        return [B.log_softmax(s) for s in first] + [B.softmax(s * 2.0) for s in first]

    params = list(P.values())
    eager.assert_same(eager.run(fb, "auto", F64, lambda B: build(B, True), params),
                      eager.run(eager, "eager", F64, lambda B: build(B, False), params), F64)


# ---- signatures ------------------------------------------------------------------------------
def test_any_length_is_written_n_in_the_signature():
    with fb.Graph(dtype=F64) as g:
        keys = fb.stack([fb.input(x) for x in _vectors(0, 3)])
        fb.matmul(fb.softmax(keys @ fb.input(_vectors(1, 1)[0])), keys).value()
        assert set(g.stats().by_signature) == {"stack(n, 4)", "matmul(n, 4)(4,)", "softmax(n,)",
                                               "matmul(n,)(n, 4)"}


def test_a_product_with_a_parameter_keeps_its_shapes_in_the_signature():
    """A parameter's shape is fixed: `W @ x` batches by W, and `x @ W` by W's rows too."""
    with fb.Graph(dtype=F64) as g:
        x = fb.input(_vectors(0, 1)[0])
        (P["W"] @ x).value()
        (x @ P["W"]).value()
        (P["u"] @ x).value()
        assert {"matmul[param](4, 4)(4,)", "matmul(4,)(4, 4)", "matmul[param](4,)(4,)"} \
            <= set(g.stats().by_signature)


# ---- bad input --------------------------------------------------------------------------------
def test_bad_shapes_still_raise_at_the_call():
    with fb.Graph(dtype=F64):
        keys = fb.stack([fb.input(x) for x in _vectors(0, 3)])  # (3, 4)
        with pytest.raises(fb.ShapeError, match="softmax: needs a vector"):
            fb.softmax(keys)
        with pytest.raises(fb.ShapeError, match="pick_neg_log_softmax: needs a vector"):
            fb.pick_neg_log_softmax(keys, 0)
        with pytest.raises(IndexError, match="out of range"):
            fb.pick_neg_log_softmax(keys @ fb.ones(D), 3)
        with pytest.raises(fb.ShapeError, match="cannot multiply"):
            keys @ fb.ones(D + 1)
        with pytest.raises(fb.ShapeError, match="cannot multiply"):
            fb.ones(2) @ keys
        with pytest.raises(fb.ShapeError, match="stack: all shapes must be equal"):
            fb.stack([fb.ones(D), fb.ones(D + 1)])
        with pytest.raises(ValueError, match="at least one"):
            fb.stack([])


def test_forward_stacked_reads_rows_of_a_padded_result_at_their_own_length():
    xs = [torch.arange(float(n), dtype=F64) for n in (3, 5, 3, 3)]
    with fb.Graph() as g:
        sm = [fb.softmax(fb.input(x)) for x in xs]  # one padded batch, rows 5 long
        stacked = g.forward([sm[0], sm[2], sm[3]], stack=True)
        assert stacked.shape == (3, 3)
        torch.testing.assert_close(stacked, torch.stack([xs[k].softmax(0) for k in (0, 2, 3)]))
        torch.testing.assert_close(g.forward([sm[3], sm[0]], stack=True),
                                   torch.stack([xs[3].softmax(0), xs[0].softmax(0)]))


@pytest.mark.parametrize("strategy", ["depth", "agenda", "auto"])
def test_torch_attention_over_sources_of_any_length_is_one_launch_per_op(strategy):
    # Unchanged torch code: torch.stack of the keys, `keys @ q`, F.softmax / F.log_softmax
    # over the source positions. Captured, each runs once for every length.
    P = parameters(W=(D, D), q=(D,))
    sources = [_vectors(n, n) for n in LENGTHS]

    def build(lib):
        losses = []
        for source in sources:
            keys = torch.stack([torch.tanh(P["W"] @ x) for x in source])
            scores = keys @ P["q"]
            context = torch.nn.functional.softmax(scores, dim=0) @ keys
            losses.append(context.sum() - torch.log_softmax(scores, -1).sum())
        return losses

    eager_losses = build(None)
    expected = [loss.detach() for loss in eager_losses]
    sum(eager_losses).backward()
    grads = {k: p.grad.clone() for k, p in P.items()}
    for p in P.values():
        p.grad = None
    with fb.Graph(strategy=strategy) as g:
        losses = build(fb)
        torch.testing.assert_close(torch.stack([l.value() for l in losses]).detach(),
                                   torch.stack(expected))
        sum(losses).backward()
        by_signature = g.stats().by_signature
    for k, p in P.items():
        torch.testing.assert_close(p.grad, grads[k])
    for op in ("stack", "softmax", "log_softmax"):
        assert sum(n for sig, n in by_signature.items() if sig.startswith(op + "(")) == 1, op
