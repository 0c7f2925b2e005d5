"""Elementwise ops and reductions of variable-length results run as ONE kernel across lengths.

A result whose leading dim is a length (a stack of rows, a softmax of any length, the rows of
`M_i @ q`: length-led) is stored padded with zeros. Unary and binary elementwise ops of it (the
other operand as long, or a broadcast row, or a scalar), reductions to a scalar and `x[i]`
batch across lengths in turn: one launch per op whatever the mix of lengths, the padding of
their results zeros again, and values and gradients those of eager PyTorch (float64, 1e-12),
with nothing leaking from the padding into real entries or broadcast operands. Nodes of equal
shapes batch as before, and a leading dim that is not a length keeps its exact signature.
"""

from __future__ import annotations

import pytest
import torch

import flybatch as fb
from across_lengths import F64, launches, parameters, same_as_eager, vectors
from flybatch.graph import STRATEGIES

TOLERANCE = 1e-12
D = 4
LENGTHS = [3, 1, 7, 4, 2, 6, 5]  # source lengths 1..7, mixed on purpose


def _vectors(seed: int, n: int, size: int = D) -> list[torch.Tensor]:
    return vectors(seed, n, size)


P = parameters(W=(D, D), u=(D,), row=(D,), Wa=(D, D), Ua=(D, D), va=(D,))


def same_as_eager_to_1e12(strategy: str, build) -> None:
    """Values, every parameter's gradient and the loss agree with eager's to 1e-12."""
    same_as_eager(strategy, build, list(P.values()), TOLERANCE)


def keys(B, seed: int, n: int):
    """An (n, D) matrix of encoder states `tanh(W x_j)`, stacked: length-led."""
    return B.stack([B.tanh(B.matmul(P["W"], B.input(x))) for x in _vectors(seed, n)])


def scores(B, seed: int, n: int):
    """A vector of n scores `K u` (length-led), depending on W and u."""
    return B.matmul(keys(B, seed, n), P["u"])


# ---- unary elementwise ---------------------------------------------------------------------------
UNARY = ("tanh", "sigmoid", "relu", "exp", "abs", "square", "neg", "log", "sqrt")


def unary(B, op: str) -> list:
    """`op` of a score vector and of a key matrix per instance (log and sqrt of positive ones),
    and their sums, which read the padding of the results: it must be zeros."""
    f, outs = getattr(B, op), []
    for seed, n in enumerate(LENGTHS):
        s, k = scores(B, seed, n), keys(B, seed, n)
        if op in ("log", "sqrt"):  # (exp is length-led too)
            s, k = B.exp(s), B.exp(k)
        outs += [f(s), f(k), B.sum_elems(f(s)), B.matmul(f(k), P["u"])]
    return outs


@pytest.mark.parametrize("op", UNARY)
def test_a_unary_op_of_vectors_and_matrices_of_any_length_is_one_launch(op):
    for strategy in ("depth", "agenda", "auto"):
        stats = launches(lambda B: unary(B, op), strategy)
        assert stats.by_signature[f"{op}(n,)"] == 1
        assert stats.by_signature[f"{op}(n, {D})"] == 1


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("op", UNARY)
def test_a_unary_op_across_lengths_matches_eager(op, strategy):
    same_as_eager_to_1e12(strategy, lambda B: unary(B, op))


def test_the_padding_of_exp_and_sigmoid_is_zero_again():
    """f(0) != 0: their results are zeroed past each node's length, which a later product
    over the padded rows (`weights @ K`) relies on."""
    with fb.Graph(dtype=F64) as g:
        outs = [f(scores(fb, seed, n)) for seed, n in enumerate(LENGTHS)
                for f in (fb.exp, fb.sigmoid)]
        g.forward(outs)
        batch, _ = g.position(g.node_of(outs[0]))
        stored = g.values[batch]
        assert stored.shape == (len(LENGTHS), max(LENGTHS))
        for row, n in enumerate(LENGTHS):
            assert (stored[row, n:] == 0).all()


# ---- binary elementwise ------------------------------------------------------------------------
def binary(B) -> list:
    """Scores and keys with an operand as long (another length-led result, a per-instance
    input), a broadcast row (a parameter) or a scalar, on either side; and reductions and
    products that read the padding of such results, which must be zeros."""
    outs = []
    for seed, n in enumerate(LENGTHS):
        s, k = scores(B, seed, n), keys(B, seed, n)
        mask = B.input(torch.arange(n, dtype=F64) % 2)  # (n,): as long, not length-led
        outs += [s * 0.5, 0.5 * s, s + 1.0, 2.0 - s, s + mask, mask * s, s / B.exp(s),
                 1.0 / B.exp(s), B.exp(s) / 2.0,
                 k + P["row"], P["row"] - k, k * P["row"], k / B.exp(P["row"]),
                 P["row"] / B.exp(k), k - k * k]
        outs += [B.sum_elems(o) for o in outs[-15:]] + [B.matmul(k + P["row"], P["u"])]
    return outs


def test_binary_ops_across_lengths_are_one_launch_per_op_and_operand_shapes():
    for strategy in ("depth", "agenda", "auto"):
        by_signature = launches(binary, strategy).by_signature
        for sig in ("mul(n,)()", "mul()(n,)", "add(n,)()", "sub()(n,)", "add(n,)(n,)",
                    "mul(n,)(n,)", "div(n,)(n,)", "div()(n,)", "div(n,)()",
                    f"add(n, {D})({D},)", f"sub({D},)(n, {D})", f"mul(n, {D})({D},)",
                    f"div(n, {D})({D},)", f"div({D},)(n, {D})", f"mul(n, {D})(n, {D})",
                    f"sub(n, {D})(n, {D})"):
            assert by_signature[sig] == 1, (strategy, sig)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_binary_ops_across_lengths_match_eager_broadcast_rows_included(strategy):
    """The row's gradient sums over each node's real rows only: `k + row` is zeroed past them."""
    same_as_eager_to_1e12(strategy, binary)


# ---- reductions and picks ---------------------------------------------------------------------
def reductions(B) -> list:
    outs = []
    for seed, n in enumerate(LENGTHS):
        s, k = scores(B, seed, n), keys(B, seed, n)
        outs += [B.sum_elems(s), B.mean_elems(s), B.squared_norm(s), B.mean_elems(k),
                 B.sum_elems(B.exp(s)), s[n - 1], s[0], k[n // 2], B.softmax(s)[n - 1]]
    return outs


def test_reductions_and_picks_across_lengths_are_one_launch_each():
    for strategy in ("depth", "agenda", "auto"):
        by_signature = launches(reductions, strategy).by_signature
        for sig in ("mean_elems(n,)", "squared_norm(n,)", f"mean_elems(n, {D})",
                    f"pick(n, {D})"):
            assert by_signature[sig] == 1, (strategy, sig)
        assert by_signature["sum_elems(n,)"] <= 2  # (of s, and of exp(s), one step later)
        assert by_signature["pick(n,)"] <= 2  # (of s, and of its softmax, one step later)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reductions_and_picks_across_lengths_match_eager(strategy):
    """A mean divides by each node's own number of elements, not the padded width."""
    same_as_eager_to_1e12(strategy, reductions)


# ---- additive attention ------------------------------------------------------------------------
STEPS = 3


def bahdanau_decoder(B, lengths=LENGTHS) -> list:
    """Per instance: keys K (n, D); at each step the additive scores `tanh(K Wa + s Ua) va`,
    their softmax, the context `weights K`, and a pointer loss over the positions."""
    outs = []
    for seed, n in enumerate(lengths):
        k = keys(B, seed, n)
        projected = B.matmul(k, P["Wa"])
        s = B.tanh(B.matmul(P["W"], B.input(_vectors(100 + seed, 1)[0])))
        for t in range(STEPS):
            score = B.matmul(B.tanh(projected + B.matmul(s, P["Ua"])), P["va"])
            weights = B.softmax(score)
            s = B.tanh(B.matmul(weights, k) + s)
            outs += [weights, B.pick_neg_log_softmax(score, (seed + t) % n), s]
    return outs


def test_additive_attention_across_lengths_is_one_launch_per_op_per_step():
    for strategy in ("depth", "agenda", "auto"):
        by_signature = launches(bahdanau_decoder, strategy).by_signature
        for sig in (f"add(n, {D})({D},)", f"tanh(n, {D})", f"matmul(n, {D})({D},)",
                    "softmax(n,)", f"matmul(n,)(n, {D})"):
            assert by_signature[sig] == STEPS, (strategy, sig)
        assert by_signature[f"matmul(n, {D})({D}, {D})"] == 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_additive_attention_across_lengths_matches_eager(strategy):
    same_as_eager_to_1e12(strategy, bahdanau_decoder)


def test_additive_attention_over_equal_lengths_batches_as_exact_shapes_would():
    """All lengths equal: the same launches as lengths 1..7 (one per op per step), nothing
    stored padded, and each launch's batch as large as before."""
    for strategy in ("depth", "agenda", "auto"):
        with fb.Graph(strategy=strategy, dtype=F64) as g:
            fb.esum([fb.sum_elems(o) for o in bahdanau_decoder(fb, [4] * 5)]).backward()
            assert not g.padded
            stats = g.stats()
        assert stats.batches == launches(bahdanau_decoder, strategy).batches
        assert stats.batches >= stats.lower_bound


# ---- what keeps its exact signature -------------------------------------------------------------
def test_a_leading_dim_that_is_no_length_keeps_its_exact_signature():
    """Parameters' rows, inputs and lookups are not lengths: their elementwise ops batch by
    shape as ever (a (3, 4) and a (5, 4) input never share a tanh)."""
    with fb.Graph(dtype=F64) as g:
        a, b = fb.input(torch.ones(3, D, dtype=F64)), fb.input(torch.ones(5, D, dtype=F64))
        outs = [fb.tanh(a), fb.tanh(b), fb.tanh(P["W"]), a * 2.0, b * 2.0, fb.sum_elems(a),
                fb.sum_elems(b), a[1], b[1], fb.exp(P["u"]) + P["row"]]
        g.forward(outs)
        assert {"tanh(3, 4)", "tanh(5, 4)", "tanh(4, 4)", "mul(3, 4)()", "mul(5, 4)()",
                "sum_elems(3, 4)", "sum_elems(5, 4)", "pick(3, 4)", "pick(5, 4)",
                "add(4,)(4,)"} <= set(g.stats().by_signature)


@pytest.mark.parametrize("strategy", ["depth", "agenda", "auto"])
def test_the_lower_bound_stays_below_the_launches(strategy):
    for build in (binary, reductions, bahdanau_decoder):
        stats = launches(build, strategy)
        assert stats.lower_bound <= stats.tight_bound <= stats.batches
