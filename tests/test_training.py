"""Training: a small per-instance model trained with `torch.optim` lowers its loss, and the
strategy changes only the speed, never the numbers.

The model (embeddings, an LSTM cell, an MLP classifier over the last state) is written per
instance; every step builds one graph over a minibatch of sequences of different lengths.
"""

from __future__ import annotations

import random

import pytest
import torch

import eager
import flybatch as fb
from flybatch.graph import STRATEGIES

VOCAB, EMBED, HIDDEN, CLASSES = 12, 5, 6, 3
STEPS = 6


class Tagger(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = fb.nn.Embedding(VOCAB, EMBED)
        self.cell = fb.nn.LSTMCell(EMBED, HIDDEN)
        self.out = fb.nn.MLP([HIDDEN, HIDDEN, CLASSES])
        self.double()

    def loss(self, B, words: list[int], label: int):
        """Per-instance code, for a backend B (flybatch or eager)."""
        embed, cell, out = (m if B is fb else eager.twin(m) for m in (self.embed, self.cell,
                                                                      self.out))
        state = None
        for w in words:
            state = cell(embed(w), state)
        return B.pick_neg_log_softmax(out(state.h), label)


def minibatches():
    rng = random.Random(0)
    data = [([rng.randrange(VOCAB) for _ in range(rng.randint(1, 7))], rng.randrange(CLASSES))
            for _ in range(8)]
    return [data[:4], data[4:]]


def train(B, strategy: str) -> tuple[list[float], dict]:
    """Losses of every step and the final parameters."""
    model = Tagger()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    losses = []
    for step in range(STEPS):
        batch = minibatches()[step % 2]
        opt.zero_grad()
        with B.Graph(strategy=strategy, dtype=torch.float64) as g:
            loss = B.esum([model.loss(B, words, label) for words, label in batch])
            loss.backward()
            losses.append(float(g.forward([loss])[0].detach()))
        opt.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def runs():
    """Training runs under every strategy and eagerly (each is deterministic)."""
    out = {s: train(fb, s) for s in STRATEGIES}
    out["eager"] = train(eager, "eager")
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_training_lowers_the_loss(runs, strategy):
    losses, _ = runs[strategy]
    assert losses[-2] < losses[0] and losses[-1] < losses[1]  # each minibatch improves


@pytest.mark.parametrize("strategy", ["depth", "agenda"])
def test_training_gives_the_same_losses_as_without_batching(runs, strategy):
    assert runs[strategy][0] == pytest.approx(runs["none"][0], rel=1e-12, abs=0)


@pytest.mark.parametrize("strategy", ["depth", "agenda"])
def test_training_ends_with_the_same_parameters_as_without_batching(runs, strategy):
    params, expected = runs[strategy][1], runs["none"][1]
    for name in expected:
        torch.testing.assert_close(params[name], expected[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_training_gives_the_losses_of_eager_pytorch(runs, strategy):
    assert runs[strategy][0] == pytest.approx(runs["eager"][0], rel=1e-10, abs=0)
