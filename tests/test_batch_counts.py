"""Batch counts: how many kernels each strategy launches, exactly, on graphs whose best schedule
is known; the lower bound on hand-computed graphs; the contiguity optimisation.

A launch is one kernel for a batch of non-leaf nodes (`stats().batches`); leaves (inputs,
parameters, constants) cost no launch.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flybatch as fb
from flybatch.datasets import generate_sst_text, parse_sst

VOCAB, HIDDEN = 50, 6


def _p(gen, *shape):
    return torch.nn.Parameter(torch.randn(*shape, generator=gen) * 0.3)


class RNN:
    """The README's model: per step lookup, concat, W @ ., + b, tanh; then U @ h and the loss."""

    OPS_PER_STEP, OPS_PER_LOSS = 5, 2

    def __init__(self, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.W, self.b = _p(gen, HIDDEN, 2 * HIDDEN), _p(gen, HIDDEN)
        self.E, self.U = _p(gen, VOCAB, HIDDEN), _p(gen, 5, HIDDEN)

    def loss(self, words: list[int], label: int) -> fb.Expression:
        h = fb.zeros(HIDDEN)
        for w in words:
            h = fb.tanh(self.W @ fb.concat([h, fb.lookup(self.E, w)]) + self.b)
        return fb.pick_neg_log_softmax(self.U @ h, label)


def launches_of(stats: fb.Stats, op: str) -> int:
    return sum(n for sig, n in stats.by_signature.items() if sig.startswith(op + "(")
               or sig.startswith(op + "["))


def figure1(strategy: str, n: int) -> fb.Stats:
    """The paper's Figure 1: RNNs of lengths 1..n, each followed by a loss, summed."""
    rnn = RNN()
    with fb.Graph(strategy=strategy) as g:
        loss = fb.esum([rnn.loss([k % VOCAB for k in range(length)], length % 5)
                        for length in range(1, n + 1)])
        loss.backward()
        return g.stats()


# ---- identical chains ------------------------------------------------------------------------
CHAIN_OPS = {
    "tanh": lambda P, x: fb.tanh(x),
    "sigmoid": lambda P, x: fb.sigmoid(x),
    "relu": lambda P, x: fb.relu(x),
    "W @ x": lambda P, x: P["W"] @ x,
    "affine": lambda P, x: fb.affine(P["W"], x, P["b"]),
    "x + b": lambda P, x: x + P["b"],
    "2 * x": lambda P, x: 2 * x,
    "x * x": lambda P, x: x * x,
    "softmax": lambda P, x: fb.softmax(x),
    "emax([x, x, x])": lambda P, x: fb.emax([x, x, x]),
}


@pytest.mark.parametrize("strategy", ["depth", "agenda"])
@given(n=st.integers(1, 40), ops=st.lists(st.sampled_from(sorted(CHAIN_OPS)), min_size=1,
                                          max_size=8))
def test_identical_chains_of_k_ops_take_k_launches_for_any_number_of_chains(strategy, n, ops):
    P = {"W": torch.nn.Parameter(torch.randn(4, 4) * 0.3), "b": torch.nn.Parameter(torch.ones(4))}
    with fb.Graph(strategy=strategy) as g:
        for _ in range(n):
            x = fb.input(torch.randn(4))
            for op in ops:
                x = CHAIN_OPS[op](P, x)
        g.forward()
        assert g.stats().batches == len(ops)


@given(n=st.integers(1, 12), ops=st.lists(st.sampled_from(sorted(CHAIN_OPS)), min_size=1,
                                          max_size=6))
def test_none_launches_once_per_chain_op(n, ops):
    P = {"W": torch.nn.Parameter(torch.randn(4, 4) * 0.3), "b": torch.nn.Parameter(torch.ones(4))}
    with fb.Graph(strategy="none") as g:
        for _ in range(n):
            x = fb.input(torch.randn(4))
            for op in ops:
                x = CHAIN_OPS[op](P, x)
        g.forward()
        assert g.stats().batches == n * len(ops)


@given(lengths=st.lists(st.integers(1, 8), min_size=1, max_size=8))
def test_none_launches_once_per_non_leaf_node(lengths):
    rnn = RNN()
    with fb.Graph(strategy="none") as g:
        fb.esum([rnn.loss(list(range(n)), 0) for n in lengths]).backward()
        non_leaf = RNN.OPS_PER_STEP * sum(lengths) + RNN.OPS_PER_LOSS * len(lengths) + 1
        assert g.stats().batches == non_leaf
        assert g.stats().batch_sizes == {1: non_leaf}


# ---- the paper's Figure 1 --------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_agenda_puts_every_loss_of_figure1_in_one_batch(n):
    stats = figure1("agenda", n)
    assert launches_of(stats, "pick_neg_log_softmax") == 1


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_depth_batches_the_losses_of_figure1_by_length(n):
    stats = figure1("depth", n)
    assert launches_of(stats, "pick_neg_log_softmax") == n


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_agenda_reaches_the_lower_bound_on_figure1(n):
    stats = figure1("agenda", n)
    # per step: concat, W @, + b, tanh (n each); then one lookup, U @ h, loss and sum batch
    assert stats.lower_bound == 4 * n + 4
    assert stats.batches == stats.lower_bound


# ---- trees -----------------------------------------------------------------------------------
SST_TREES = parse_sst(generate_sst_text(64, seed=3))


class TreeRNN:
    """Leaf: lookup, affine, tanh. Internal node: concat, affine, tanh. Three ops per node."""

    OPS_PER_NODE = 3

    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.E, self.WL, self.bL = _p(gen, VOCAB, HIDDEN), _p(gen, HIDDEN, HIDDEN), _p(gen, HIDDEN)
        self.W, self.b = _p(gen, HIDDEN, 2 * HIDDEN), _p(gen, HIDDEN)
        self.U = _p(gen, 5, HIDDEN)

    def encode(self, tree) -> fb.Expression:
        if tree.is_leaf:
            word = sum(map(ord, tree.word)) % VOCAB
            return fb.tanh(fb.affine(self.WL, fb.lookup(self.E, word), self.bL))
        left, right = (self.encode(child) for child in tree.children)
        return fb.tanh(fb.affine(self.W, fb.concat([left, right]), self.b))


class TreeLSTM:
    """`fb.nn.TreeLSTMCell`: one fused cell node and two slices (h, c) per tree node."""

    OPS_PER_NODE = 3

    def __init__(self):
        torch.manual_seed(0)
        self.cell = fb.nn.TreeLSTMCell(HIDDEN, HIDDEN)
        self.E = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN) * 0.3)
        self.U = torch.nn.Parameter(torch.randn(5, HIDDEN) * 0.3)

    def encode(self, tree) -> fb.Expression:
        def state(t):
            if t.is_leaf:
                return self.cell.leaf(fb.lookup(self.E, sum(map(ord, t.word)) % VOCAB))
            return self.cell([state(child) for child in t.children])
        return state(tree).h


@pytest.mark.parametrize("model", [TreeRNN, TreeLSTM], ids=lambda m: m.__name__)
def test_agenda_runs_64_sst_trees_in_height_times_ops_per_node_launches(model):
    m = model()
    height = max(t.height() for t in SST_TREES)
    assert height >= 8  # SST-shaped: deep, unbalanced trees of different heights
    with fb.Graph(strategy="agenda") as g:
        loss = fb.esum([fb.pick_neg_log_softmax(m.U @ m.encode(t), t.label) for t in SST_TREES])
        g.forward([loss])
        # + lookup, U @ root, loss, sum: a small constant
        assert g.stats().batches <= height * model.OPS_PER_NODE + 4


# ---- lower bound -------------------------------------------------------------------------------
def _lower_bound(build) -> int:
    with fb.Graph() as g:
        build()
        return g.stats().lower_bound


def _diamond():
    a = fb.tanh(fb.input([1.0, 2.0]))
    fb.add(fb.tanh(a), fb.sigmoid(a))


def _two_paths_with_shared_signatures():
    fb.tanh(fb.sigmoid(fb.tanh(fb.input([1.0]))))          # tanh 2, sigmoid 1
    fb.sigmoid(fb.sigmoid(fb.sigmoid(fb.input([2.0]))))    # sigmoid 3


def _different_shapes_are_different_signatures():
    fb.tanh(fb.tanh(fb.input([1.0])))
    fb.tanh(fb.input([1.0, 2.0]))


def _shared_parameter_product():
    W = torch.nn.Parameter(torch.randn(2, 2))
    for k in range(3):
        x = fb.input([float(k), 1.0])
        W @ (W @ x)                                         # 2 products on the path


TABLE = torch.ones(4, 2)
LOWER_BOUNDS = [
    ("empty graph", lambda: None, 0),
    ("only leaves", lambda: (fb.input([1.0]), fb.zeros(3), fb.parameter(torch.ones(2))), 0),
    ("one op", lambda: fb.tanh(fb.input([1.0])), 1),
    ("chain of two", lambda: fb.tanh(fb.tanh(fb.input([1.0]))), 2),
    ("independent chains", lambda: [fb.tanh(fb.sigmoid(fb.input([float(k)]))) for k in range(5)],
     2),
    ("diamond", _diamond, 4),
    ("two paths sharing signatures", _two_paths_with_shared_signatures, 5),
    ("shapes in the signature", _different_shapes_are_different_signatures, 3),
    ("shared parameter product", _shared_parameter_product, 2),
    ("lookups into one table", lambda: [fb.lookup(TABLE, k) for k in range(4)], 1),
]


@pytest.mark.parametrize("build, expected", [c[1:] for c in LOWER_BOUNDS],
                         ids=[c[0] for c in LOWER_BOUNDS])
def test_lower_bound_of_hand_computed_graphs(build, expected):
    assert _lower_bound(build) == expected


@pytest.mark.parametrize("strategy", ["none", "depth", "agenda"])
def test_no_strategy_beats_the_lower_bound(strategy):
    rng = random.Random(0)
    rnn = RNN()
    with fb.Graph(strategy=strategy) as g:
        fb.esum([rnn.loss([rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))], 1)
                 for _ in range(10)]).backward()
        stats = g.stats()
    assert stats.batches >= stats.lower_bound


# ---- contiguity ----------------------------------------------------------------------------------
def test_agenda_reads_most_rnn_inputs_without_a_copy():
    rng = random.Random(0)
    rnn = RNN()
    with fb.Graph(strategy="agenda") as g:
        fb.esum([rnn.loss([rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))], 1)
                 for _ in range(16)]).backward()
        stats = g.stats()
    assert stats.gathers_avoided > stats.gathers


@pytest.mark.parametrize("strategy", ["none", "depth", "agenda"])
def test_lower_bound_counts_each_forward_separately(strategy):
    """A value request splits the graph: nodes of two forwards can never share a launch."""
    W = torch.nn.Parameter(torch.eye(3, dtype=torch.float64))
    with fb.Graph(strategy=strategy, dtype=torch.float64) as g:
        first = [fb.tanh(W @ fb.input([float(i), 1.0, 0.0])) for i in range(4)]
        g.forward(first)                         # forward 1: one matmul level, one tanh level
        second = [fb.tanh(W @ h) for h in first]  # forward 2: the same two signatures again
        g.forward(second)
        assert g.stats().lower_bound == 4
        if strategy != "none":
            assert g.stats().batches == 4
