"""Ragged ops: nodes that differ only in the length of a list run as ONE kernel.

`emax`, `logsumexp`, `attention`, softmaxes over lists of scalars and the fused child-sum
Tree-LSTM cell batch across list lengths (arities, source lengths, numbers of children): one
launch per op, whatever the mix of lengths, with eager PyTorch's values and gradients (float64).
"""

from __future__ import annotations

import random

import pytest
import torch

import eager
import flybatch as fb
from across_lengths import F64, launches, same_as_eager, vectors
from flybatch.graph import STRATEGIES

D = 5
LENGTHS = [1, 3, 2, 5, 1, 4, 3]  # one instance per length, mixed on purpose


def launches_of(stats: fb.Stats, op: str) -> int:
    return sum(n for sig, n in stats.by_signature.items() if sig.split("(")[0].split("[")[0] == op)


def _vectors(seed: int, n: int, size: int = D) -> list[torch.Tensor]:
    return vectors(seed, n, size)


class Encoder:
    """Per-instance sources: `tanh(W x_j)` for each source position j (so that gradients reach
    W through every key), and a query `tanh(U x_0)`."""

    def __init__(self, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.W = torch.nn.Parameter(torch.randn(D, D, generator=gen, dtype=F64) * 0.5)
        self.U = torch.nn.Parameter(torch.randn(D, D, generator=gen, dtype=F64) * 0.5)
        self.w = torch.nn.Parameter(torch.randn(D, generator=gen, dtype=F64) * 0.5)
        self.params = [self.W, self.U, self.w]

    def sources(self, B, length: int, seed: int) -> list:
        return [B.tanh(B.matmul(self.W, B.input(x))) for x in _vectors(seed, length)]

    def query(self, B, seed: int):
        return B.tanh(B.matmul(self.U, B.input(_vectors(seed, 1)[0])))

    def score(self, B, source):
        return B.dot(self.w, source)


# ---- lists reduced elementwise ---------------------------------------------------------------
def reductions(B, m: Encoder, op: str) -> list:
    return [getattr(B, op)(m.sources(B, n, seed)) for seed, n in enumerate(LENGTHS)]


@pytest.mark.parametrize("op", ["emax", "logsumexp", "esum", "average"])
def test_a_list_reduction_is_one_launch_across_list_lengths(op):
    m = Encoder()
    for strategy in ("depth", "agenda", "auto"):
        stats = launches(lambda B: reductions(B, m, op), strategy)
        assert stats.by_signature[f"{op}({D},)"] == 1  # (the sum of the outputs is esum())


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("op", ["emax", "logsumexp"])
def test_a_list_reduction_across_lengths_matches_eager(op, strategy):
    m = Encoder()
    same_as_eager(strategy, lambda B: reductions(B, m, op), m.params)


def test_emax_of_one_node_repeated_reads_it_once_and_matches_eager():
    m = Encoder()
    build = lambda B: [B.emax([q] * n) for n, q in ((1, m.query(B, 0)), (3, m.query(B, 0)))]
    same_as_eager("auto", build, m.params)


# ---- softmax over a variable number of candidates -------------------------------------------
def candidate_losses(B, m: Encoder) -> list:
    """Per instance: scores of its source positions, their softmax and log-softmax weights, and
    the loss of a gold position."""
    outs = []
    for seed, n in enumerate(LENGTHS):
        scores = [m.score(B, s) for s in m.sources(B, n, seed)]
        outs += B.softmax(scores) + B.log_softmax(scores)
        outs.append(B.pick_neg_log_softmax(scores, seed % n))
    return outs


def test_softmax_over_lists_of_scalars_is_one_launch_per_op_across_lengths():
    m = Encoder()
    stats = launches(lambda B: candidate_losses(B, m))
    assert launches_of(stats, "logsumexp") == 1
    assert launches_of(stats, "dot") + launches_of(stats, "matmul") == 2  # W x_j and w . s_j
    assert launches_of(stats, "softmax") == launches_of(stats, "log_softmax") == 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_softmax_over_lists_of_scalars_matches_eager(strategy):
    m = Encoder()
    same_as_eager(strategy, lambda B: candidate_losses(B, m), m.params)


def test_softmax_of_a_list_is_a_list_of_weights_summing_to_one():
    with fb.Graph(dtype=F64):
        weights = fb.softmax([fb.input(torch.tensor(v, dtype=F64)) for v in (1.0, 2.0, -3.0)])
        assert len(weights) == 3
        assert sum(w.item() for w in weights) == pytest.approx(1.0, abs=1e-15)


# ---- attention over source positions ---------------------------------------------------------
def attended(B, m: Encoder, with_values: bool) -> list:
    outs = []
    for seed, n in enumerate(LENGTHS):
        keys = m.sources(B, n, seed)
        values = [B.sigmoid(k) for k in keys] if with_values else None
        outs.append(B.attention(keys, m.query(B, 100 + seed), values))
    return outs


@pytest.mark.parametrize("with_values", [False, True])
def test_attention_is_one_launch_across_source_lengths(with_values):
    m = Encoder()
    for strategy in ("depth", "agenda", "auto"):
        stats = launches(lambda B: attended(B, m, with_values), strategy)
        assert launches_of(stats, "attention_kv" if with_values else "attention") == 1


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("with_values", [False, True])
def test_attention_matches_eager_in_values_and_gradients(strategy, with_values):
    m = Encoder()
    same_as_eager(strategy, lambda B: attended(B, m, with_values), m.params)


def test_attention_checks_its_arguments_when_written():
    with fb.Graph(dtype=F64):
        keys = [fb.input(x) for x in _vectors(0, 3)]
        with pytest.raises(ValueError, match="at least one key"):
            fb.attention([], keys[0])
        with pytest.raises(ValueError, match="3 keys but 2 values"):
            fb.attention(keys, keys[0], keys[:2])
        with pytest.raises(fb.ShapeError, match="vector"):
            fb.attention([fb.input(torch.zeros(2, 2, dtype=F64))], fb.zeros((2, 2)))
        with pytest.raises(fb.ShapeError, match="attention"):
            fb.attention(keys, fb.zeros(D + 1))


# ---- child-sum Tree-LSTM over any number of children -------------------------------------------
def random_tree(rng: random.Random, depth: int):
    """(word, children) with 0..4 children per node; leaves only at the bottom level when
    `depth` reaches 0."""
    arity = 0 if depth == 0 else rng.choice((0, 1, 2, 3, 4, 2))
    return rng.randrange(7), [random_tree(rng, depth - 1) for _ in range(arity)]


TREES = [random_tree(random.Random(seed), 3) for seed in range(8)]
WORDS = _vectors(7, 7, 4)


def height(tree) -> int:
    return 1 + max((height(c) for c in tree[1]), default=0)


def child_sum(B, cell, trees) -> list:
    outs = []

    def encode(tree):
        word, children = tree
        state = cell([encode(c) for c in children], B.input(WORDS[word]))
        outs.extend([state.h, state.c])
        return state

    for t in trees:
        encode(t)
    return outs


def seeded_cell() -> fb.nn.TreeLSTMCell:
    torch.manual_seed(0)
    return fb.nn.TreeLSTMCell(4, D, child_sum=True).double()


def test_child_sum_cell_is_one_launch_per_tree_level_whatever_the_number_of_children():
    cell = seeded_cell()
    arities = {len(node[1]) for t in TREES for node in _nodes(t)}
    assert arities == {0, 1, 2, 3, 4}
    levels = max(height(t) for t in TREES)
    for strategy in ("depth", "agenda", "auto"):
        stats = launches(lambda B: child_sum(B, eager.twin(cell) if B is eager else cell,
                                             TREES), strategy)
        assert launches_of(stats, "tree_lstm_child_sum") == levels


def _nodes(tree):
    yield tree
    for child in tree[1]:
        yield from _nodes(child)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_child_sum_cell_over_mixed_arities_matches_eager(strategy):
    """(Under `depth` the leaves form a batch whose lists are all empty.)"""
    cell = seeded_cell()
    build = lambda B: child_sum(B, eager.twin(cell) if B is eager else cell, TREES)
    same_as_eager(strategy, build, list(cell.parameters()))


def test_child_sum_cell_rejects_a_child_state_of_the_wrong_size():
    cell = seeded_cell()
    with fb.Graph(dtype=F64):
        bad = fb.nn.State.of(h=fb.zeros(D + 1), c=fb.zeros(D + 1))
        with pytest.raises(fb.ShapeError, match="child 0"):
            cell([bad], fb.input(WORDS[0]))


def test_child_sum_cell_reads_children_computed_by_an_earlier_forward():
    cell = seeded_cell()

    def build(B, peek: bool):
        c = eager.twin(cell) if B is eager else cell
        leaves = [c([], B.input(x)) for x in WORDS[:4]]
        if peek:
            leaves[0].h.value()  # a forward: the leaves are done before their parents exist
        mid = c(leaves[:3], B.input(WORDS[4]))
        return [c([mid, leaves[3]], B.input(WORDS[5])).h, c([leaves[1]], B.input(WORDS[6])).c]

    params = list(cell.parameters())
    eager.assert_same(eager.run(fb, "auto", F64, lambda B: build(B, True), params),
                      eager.run(eager, "eager", F64, lambda B: build(B, False), params), F64)


# ---- Python's sum() of scalar losses --------------------------------------------------------
def summed_scores(B, m: Encoder, n: int = 12) -> list:
    """`sum(losses)` as users write it: a chain of scalar adds, one per instance; and a partial
    sum on the way, which must keep its own value."""
    scores = [m.score(B, m.query(B, seed)) for seed in range(n)]
    partial = sum(scores[: n // 2])
    return [sum(scores), partial * 1.0]


def test_python_sum_of_scalar_losses_is_one_launch_not_a_chain():
    m = Encoder()
    for strategy in ("agenda", "auto"):
        with fb.Graph(strategy=strategy, dtype=F64) as g:
            total, partial = summed_scores(fb, m)
            total.backward()
            by_op = g.stats().by_signature
        # `0 + s1` is one add; every later partial sum is an esum of its terms, all in one launch
        assert launches_of(g.stats(), "add") == 1 and launches_of(g.stats(), "esum") == 1, by_op


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_python_sum_of_scalar_losses_matches_eager(strategy):
    m = Encoder()
    same_as_eager(strategy, lambda B: summed_scores(B, m), m.params)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_sum_begun_under_no_grad_passes_no_gradient_to_its_first_terms(strategy):
    m = Encoder()

    def build(B):
        scores = [m.score(B, m.query(B, seed)) for seed in range(6)]
        with torch.no_grad():
            early = scores[0] + scores[1]
        return [early + scores[2] + scores[3]]

    same_as_eager(strategy, build, m.params)
