"""Greedy decoding written for ONE instance: the decoder takes its best word (`out.argmax()`,
`out.topk(1)[1]`...) and feeds it back (`emb(pred)`, `E[pred]`, `torch.tensor([pred])`...).

Eagerly the best word is a 0-d (or one-element) int64 tensor, and every one of these forms
works. Inside `fb.Graph` and `fb.map_batched` each must give eager PyTorch's decisions, loss and
gradients under every strategy; `x.argmax()` stays the Python int flybatch code uses too, and
so does integer arithmetic on it (`pred + 1`), which is also the tensor torch computes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flybatch as fb
from native import assert_same_training, check, run_batched, run_eager, seeded

STRATEGIES = ["none", "depth", "agenda", "auto"]
VOCAB, HIDDEN, SOS, EOS = 6, 5, 0, 1
SEED = 25  # weights whose greedy decisions vary: words 3, 4 and 5, EOS after 2 to 5 steps

pytestmark = pytest.mark.usefixtures("one_thread")

# Each way per-instance code takes the best word of `logits` (shape [1, VOCAB]).
BEST_WORD = {
    "out.argmax()": lambda logits: logits.argmax(),
    "out.argmax(-1)": lambda logits: logits.argmax(-1),
    "out.topk(1)[1]": lambda logits: logits.topk(1)[1],
    "out[0].max(0)[1]": lambda logits: logits[0].max(0)[1],
    "torch.argmax(out)": lambda logits: torch.argmax(logits),
}

# Each way it feeds that word back: the next input, shape [1, HIDDEN].
FEED_BACK = {
    "emb(pred)": lambda emb, pred: emb(pred).view(1, -1),
    "F.embedding(pred, E)": lambda emb, pred: F.embedding(pred, emb.weight).view(1, -1),
    "E[pred]": lambda emb, pred: emb.weight[pred].view(1, -1),
    "torch.tensor([pred])": lambda emb, pred: emb(torch.tensor([pred])).view(1, -1),
    "pred.item()": lambda emb, pred: emb(torch.tensor([pred.item()])),
    "pred.view(1, -1)": lambda emb, pred: emb(pred.view(1, -1)).view(1, -1),
    "int(pred)": lambda emb, pred: emb(torch.tensor([int(pred)])),
    "pred.squeeze().detach()": lambda emb, pred: emb(pred.squeeze().detach()).view(1, -1),
    # integer arithmetic on the word (a shifted vocabulary, a wrap-around)
    "emb((pred + 1) % VOCAB)": lambda emb, pred: emb((pred + 1) % VOCAB).view(1, -1),
    "emb(VOCAB - 1 - pred)": lambda emb, pred: emb(VOCAB - 1 - pred).view(1, -1),
}


class GreedyTranslator(nn.Module):
    """A GRU encoder, and a GRU-cell decoder with dot-product attention over the encoder's
    outputs that feeds its own best word back in (the tutorials' decoding without teacher
    forcing), written for batch size one."""

    def __init__(self, best_word=BEST_WORD["out.argmax()"], feed_back=FEED_BACK["emb(pred)"]):
        super().__init__()
        self.best_word, self.feed_back = best_word, feed_back
        self.source_embedding = nn.Embedding(VOCAB, HIDDEN)
        self.encoder = nn.GRU(HIDDEN, HIDDEN)
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.decoder = nn.GRUCell(2 * HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, VOCAB)

    def forward(self, source, target, decoded=None):
        embedded = self.source_embedding(torch.tensor(source)).view(len(source), 1, -1)
        outputs, hidden = self.encoder(embedded)
        keys, h = outputs.squeeze(1), hidden[0]
        x = self.embedding(torch.tensor([SOS]))
        loss = 0
        for step, gold in enumerate(target):
            weights = F.softmax(keys @ h.t(), dim=0)
            context = (weights * keys).sum(0, keepdim=True)
            h = self.decoder(torch.cat([x, context], 1), h)
            logits = self.out(h)
            loss = loss + F.cross_entropy(logits, torch.tensor([gold]))
            pred = self.best_word(logits)
            if decoded is not None:
                decoded.append(int(pred))
            if pred == EOS:
                break
            x = self.feed_back(self.embedding, pred)
        return loss / len(target)


PAIRS = [([2, 3, 4], [5, 2, 1]), ([3], [2, 2, 2, 4, 1]), ([5, 4, 3, 2, 2], [3, 1]),
         ([4, 4], [5, 4, 3, 1]), ([2, 5, 3], [4, 4, 5, 2, 3, 1])]


def decodings(model: GreedyTranslator, mapped: bool | None) -> list[list[int]]:
    """The words each pair's decoder chose: eagerly (mapped None), in a graph or mapped."""
    decoded = [[] for _ in PAIRS]
    items = list(zip(PAIRS, decoded))
    if mapped is None:
        run_eager(model, lambda item: model(*item[0], item[1]), items)
    else:
        run_batched(model, lambda item: model(*item[0], item[1]), items, "auto", mapped)
    return decoded


@pytest.mark.parametrize("mapped", [False, True], ids=["graph", "map_batched"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_greedy_decoder_feeding_back_its_argmax_trains_as_eagerly(strategy, mapped):
    model = seeded(GreedyTranslator(), seed=SEED)
    eager, batched = check(model, lambda pair: model(*pair), PAIRS, strategy, mapped)
    if mapped:  # one round per decoding step of the longest, not per step of each pair
        assert batched.stats.batches * 2 < eager.ops


def test_the_greedy_decoder_stops_where_eager_stops():
    """The same decisions, so the same lengths: some pairs stop at their EOS early."""
    model = seeded(GreedyTranslator(), seed=SEED)
    eager = decodings(model, None)
    assert decodings(model, False) == eager
    assert decodings(model, True) == eager
    stopped_early = [len(words) < len(target) for words, (_, target) in zip(eager, PAIRS)]
    assert any(stopped_early) and not all(stopped_early), eager


@pytest.mark.parametrize("feed_back", FEED_BACK)
@pytest.mark.parametrize("best_word", BEST_WORD)
def test_every_way_of_feeding_back_the_best_word_trains_as_eagerly(best_word, feed_back):
    model = seeded(GreedyTranslator(BEST_WORD[best_word], FEED_BACK[feed_back]), seed=SEED)
    check(model, lambda pair: model(*pair), PAIRS, "auto")


@pytest.mark.parametrize("feed_back", FEED_BACK)
def test_every_way_of_feeding_back_the_argmax_trains_as_eagerly_under_map_batched(feed_back):
    model = seeded(GreedyTranslator(feed_back=FEED_BACK[feed_back]), seed=SEED)
    check(model, lambda pair: model(*pair), PAIRS, "agenda", mapped=True)


# ---- the value `x.argmax()` returns ----------------------------------------------------------
SCORES = torch.tensor([0.1, 0.2, 0.9, 0.3], dtype=torch.float64)


def test_argmax_is_the_int_flybatch_code_uses():
    with fb.Graph():
        best = fb.input(SCORES).argmax()
        assert isinstance(best, int) and best == 2 and int(best) == 2
        assert "abcd"[best] == "c" and {2: "c"}[best] == "c" and f"{best}" == "2"
        assert best.item() == 2 and type(best.item()) is int
        table = torch.eye(4, dtype=torch.float64)
        torch.testing.assert_close(fb.lookup(table, best).value(), table[2])


def test_argmax_is_also_the_tensor_torch_returns():
    eager = SCORES.argmax()
    with fb.Graph():
        best = fb.input(SCORES).argmax()
        assert best.shape == eager.shape and best.dtype == eager.dtype and best.dim() == 0
        for same in (lambda i: i.view(1, -1), lambda i: i.unsqueeze(0), lambda i: i.detach(),
                     lambda i: F.one_hot(i, 4), lambda i: torch.stack([i, i]),
                     lambda i: torch.tensor([i]), lambda i: i == 2, lambda i: i != 2,
                     lambda i: i < 3):
            assert torch.equal(same(best), same(eager))
        assert (best == 2).item() is True


def test_integer_arithmetic_on_argmax_is_both_the_int_and_the_tensor():
    """`pred + 1`, `n - pred`, `pred % n`... are the int flybatch code computes (a list index,
    a dict key) and the tensor eager torch computes, so `emb(pred + 1)` looks up its row."""
    eager = SCORES.argmax()
    arithmetic = {"i + 1": lambda i: i + 1, "1 + i": lambda i: 1 + i, "i - 1": lambda i: i - 1,
                  "5 - i": lambda i: 5 - i, "i * 2": lambda i: i * 2, "2 * i": lambda i: 2 * i,
                  "i // 2": lambda i: i // 2, "7 // i": lambda i: 7 // i,
                  "i % 2": lambda i: i % 2, "7 % i": lambda i: 7 % i, "-i": lambda i: -i,
                  "(i + 1) * 2 - i": lambda i: (i + 1) * 2 - i}
    with fb.Graph():
        best = fb.input(SCORES).argmax()
        for name, f in arithmetic.items():
            assert isinstance(f(best), int) and int(f(best)) == f(2), name
            assert "abcdefghij"[f(best) % 10] == "abcdefghij"[f(2) % 10], name
            assert torch.equal(f(best).view(1), f(eager).view(1)), name
            assert f(best).dtype == f(eager).dtype and f(best).shape == f(eager).shape, name


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_embedding_of_argmax_plus_one_trains_as_eagerly(strategy):
    """`emb(pred + 1)` with `pred = out.argmax()`: values and gradients as eagerly."""
    table = nn.Embedding(VOCAB + 1, HIDDEN)
    model = GreedyTranslator(feed_back=lambda emb, pred: table(pred + 1).view(1, -1))
    model.shifted = table  # a submodule: seeded, and its gradient compared too
    model = seeded(model, seed=SEED)
    check(model, lambda pair: model(*pair), PAIRS, strategy)
