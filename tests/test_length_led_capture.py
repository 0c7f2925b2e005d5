"""A model written in PyTorch for ONE sentence batches across sentence lengths, unchanged.

The tutorial's LSTM tagger embeds a sentence's n words, views them as (n, 1, E), runs an
`nn.LSTM`, views its output as (n, 2H), applies an `nn.Linear`, a `log_softmax` over the tags
and an NLL summed over the tokens. Each of these calls acts on every row (token) on its own, so
inside `fb.Graph` each is ONE launch for sentences of every length: the embedding of a 1-D index,
and the reshapes, linear layers, softmaxes and NLL / cross-entropy losses of a *length-led*
operand (ops.py: its leading dim is a length, its batch stored padded with zeros). Values and
every gradient are eager PyTorch's (float64, 1e-9) under every strategy and `map_batched`; the
padding never reaches a real value, a count or a gradient. Calls that mix the length into other
dims, or reduce over it, keep one launch per length, and compute eager's values too.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flybatch as fb
from flybatch.graph import STRATEGIES

F64 = torch.float64
ATOL = 1e-9
VOCAB, EMBED, HIDDEN, TAGS = 50, 6, 5, 4
LENGTHS = [3, 1, 9, 4, 7, 2, 8, 5, 6, 4]  # 10 sentences, lengths 1..9, mixed on purpose

pytestmark = pytest.mark.usefixtures("one_thread")


def sentences(lengths=LENGTHS, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(words, tags) per sentence: index tensors of its length."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(VOCAB, (n,), generator=gen), torch.randint(TAGS, (n,), generator=gen))
            for n in lengths]


class Tagger(nn.Module):
    """The PyTorch tutorial's LSTM tagger (bidirectional here), written for one sentence."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, EMBED)
        self.lstm = nn.LSTM(EMBED, HIDDEN, bidirectional=True)
        self.out = nn.Linear(2 * HIDDEN, TAGS)

    def forward(self, words: torch.Tensor) -> torch.Tensor:
        embeds = self.emb(words)
        lstm_out, _ = self.lstm(embeds.view(len(words), 1, -1))
        return F.log_softmax(self.out(lstm_out.view(len(words), -1)), dim=1)


def seeded(module: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return module.double()


def train(params: list[torch.Tensor], loss_of: Callable, items: list, strategy: str | None,
          mapped: bool = False) -> tuple[float, list, fb.Stats | None]:
    """The summed loss of `items`, each parameter's gradient and, batched (`strategy` not
    None), the graph's stats."""
    for p in params:
        p.grad = None
    if strategy is None:
        total = torch.stack([loss_of(x) for x in items]).sum()
        total.backward()
        return total.item(), [p.grad for p in params], None
    with fb.Graph(strategy=strategy, dtype=F64) as g:
        losses = fb.map_batched(loss_of, items) if mapped else [loss_of(x) for x in items]
        total = torch.stack(losses).sum()
        total.backward()
        return total.item(), [p.grad for p in params], g.stats()


def same_as_eager(params: list[torch.Tensor], loss_of: Callable, items: list, strategy: str,
                  mapped: bool = False) -> fb.Stats:
    """The loss and every parameter's gradient agree with eager's; returns the stats."""
    want_loss, want_grads = train(params, loss_of, items, None)[:2]
    loss, grads, stats = train(params, loss_of, items, strategy, mapped)
    assert loss == pytest.approx(want_loss, abs=ATOL, rel=0)
    for k, (got, want) in enumerate(zip(grads, want_grads, strict=True)):
        assert (got is None) == (want is None), f"parameter {k}"
        if want is not None:
            torch.testing.assert_close(got, want, rtol=0, atol=ATOL, msg=f"parameter {k}")
    return stats


# ---- the tagger ------------------------------------------------------------------------------
def tagger_loss(model: Tagger) -> Callable:
    return lambda item: F.nll_loss(model(item[0]), item[1], reduction="sum")


@pytest.mark.parametrize("mapped", [False, True], ids=["graph", "map_batched"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_tagger_trains_as_eagerly_with_one_launch_per_op_across_lengths(strategy, mapped):
    model = seeded(Tagger())
    stats = same_as_eager(list(model.parameters()), tagger_loss(model), sentences(), strategy,
                          mapped)
    if strategy == "none":
        return
    # Across all lengths, one launch each: the embedding, the view to (n, 1, E), the LSTM layer,
    # its output rows, its final-state rows and their reshape to h_n (not used, computed all
    # the same), the view to (n, 2H), the linear layer, log_softmax and nll_loss; then the
    # stack of the losses and their sum. The one-word sentence's index is one element, a row
    # lookup as `torch.tensor([word])` is, not a length: its lookup and view, one launch each.
    # (`depth` batches by depth: that lookup has no index input, so from the LSTM on its
    # sentence is one level shallower than the others, and each of those 8 ops runs twice.)
    across_lengths, one_word = 12, 2
    shallower = 8 if strategy == "depth" else 0
    assert stats.batches == across_lengths + one_word + shallower, stats.by_signature


def test_sentences_of_one_length_launch_as_many_kernels():
    model = seeded(Tagger())
    loss_of = tagger_loss(model)
    equal = sentences([5] * len(LENGTHS))
    stats = same_as_eager(list(model.parameters()), loss_of, equal, "auto")
    mixed = same_as_eager(list(model.parameters()), loss_of, sentences([5, 6] * 5), "auto")
    assert stats.batches == mixed.batches == 12


# ---- each call on its own --------------------------------------------------------------------
def params(**shapes: tuple[int, ...]) -> dict[str, nn.Parameter]:
    gen = torch.Generator().manual_seed(1)
    return {name: nn.Parameter(torch.randn(*shape, generator=gen, dtype=F64) * 0.5)
            for name, shape in shapes.items()}


P = params(table=(VOCAB, EMBED), W=(TAGS, EMBED), b=(TAGS,))
CLASS_WEIGHTS = torch.tensor([0.5, 2.0, 1.0, 0.25], dtype=F64)  # a constant, as a loss's are
WORDS = sentences([n for n in LENGTHS if n > 1])  # lengths 2..9


def run(loss_of: Callable, strategy: str = "auto", items=WORDS) -> fb.Stats:
    return same_as_eager(list(P.values()), loss_of, items, strategy)


def embed(words: torch.Tensor, **options) -> torch.Tensor:
    """The words' rows: (n, E), length-led."""
    return F.embedding(words, P["table"], **options)


def launches_of(stats: fb.Stats, label: str) -> int:
    return sum(count for signature, count in stats.by_signature.items()
               if signature.startswith(label))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_embedding_of_every_length_is_one_gather_with_eager_gradients(strategy):
    def loss_of(item):
        words, tags = item
        rows = embed(words) * torch.arange(1.0, len(words) + 1, dtype=F64)[:, None]
        return rows.tanh().sum()  # the padding rows would add tanh(0) = 0: zeros, read back

    stats = run(loss_of, strategy)
    if strategy != "none":
        assert launches_of(stats, "embedding") == 1


def test_an_embedding_with_padding_idx_gives_that_row_no_gradient():
    def loss_of(item):
        words = item[0].clone()
        words[::2] = 3  # the padding index, at every other word
        return (embed(words, padding_idx=3) ** 2).sum()

    stats = run(loss_of)
    assert launches_of(stats, "embedding") == 1
    assert (P["table"].grad[3] == 0).all()


def test_views_that_keep_the_leading_dim_round_trip_in_one_launch_each():
    def loss_of(item):
        x = embed(item[0])
        n = len(item[0])
        y = x.view(n, 1, -1).squeeze(1).unsqueeze(1).reshape(n, -1).view(n, 2, EMBED // 2)
        return (y.flatten(1) * x).sum()

    stats = run(loss_of)
    # view to (n, 1, E), squeeze, unsqueeze, reshape to (n, E), view to (n, 2, E/2), flatten:
    # six reshapes, one after the other, each one launch for every length.
    assert launches_of(stats, "reshape") == 6


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_linear_layer_of_every_length_is_one_launch(strategy, bias):
    def loss_of(item):
        x = embed(item[0])
        scores = F.linear(x, P["W"], P["b"] if bias else None)
        return scores.sum() + (scores * scores).sum()  # bias rows past the end would count

    stats = run(loss_of, strategy)
    if strategy != "none":
        assert launches_of(stats, "linear") == 1


@pytest.mark.parametrize("dim", [1, -1])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_log_softmax_and_softmax_over_the_classes_are_one_launch(strategy, dim):
    def loss_of(item):
        scores = F.linear(embed(item[0]), P["W"], P["b"])
        return (F.log_softmax(scores, dim=dim) * scores).sum() + \
            torch.softmax(scores, dim).pow(2).sum()

    stats = run(loss_of, strategy)
    if strategy != "none":
        assert launches_of(stats, "log_softmax") == 1
        assert launches_of(stats, "softmax") == 1


LOSSES = {"nll_loss": lambda x, t, **kw: F.nll_loss(F.log_softmax(x, 1), t, **kw),
          "cross_entropy": F.cross_entropy}


@pytest.mark.parametrize("options", [{}, {"weight": True}, {"ignore_index": 2},
                                     {"weight": True, "ignore_index": 0}],
                         ids=["plain", "weight", "ignore_index", "weight+ignore_index"])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_a_loss_over_each_sentences_tokens_is_one_launch(loss, reduction, options):
    """Each sentence reduces over its own n tokens (mean: by its own count, or its targets'
    summed class weights, ignored targets left out), whatever the longest."""
    kwargs = dict(options, weight=CLASS_WEIGHTS) if "weight" in options else options

    def loss_of(item):
        scores = F.linear(embed(item[0]), P["W"], P["b"])
        out = LOSSES[loss](scores, item[1], reduction=reduction, **kwargs)
        return (out * out).sum() if reduction == "none" else out

    for strategy in STRATEGIES:
        stats = run(loss_of, strategy)
        if strategy != "none":
            assert launches_of(stats, loss) == 1


# ---- what does not batch across lengths ------------------------------------------------------
def test_calls_that_mix_the_length_into_other_dims_keep_one_launch_per_length():
    """A softmax over the words (the leading dim), a view flattening the words, and a loss
    over one sentence's (n, C) scores against targets of another length: exact per length,
    eager's values."""
    lengths = len({len(words) for words, _ in WORDS})

    def loss_of(item):
        x = F.linear(embed(item[0]), P["W"], P["b"])
        over_words = F.softmax(x, dim=0)
        flat = x.view(-1)
        return (over_words * x).sum() + flat.pow(2).sum()

    stats = run(loss_of)
    assert launches_of(stats, "softmax") == lengths
    assert launches_of(stats, "reshape") == lengths


def test_mismatched_targets_raise_torchs_error_naming_the_loss():
    with fb.Graph(dtype=F64):
        scores = F.linear(embed(torch.tensor([1, 2, 3])), P["W"], P["b"])
        with pytest.raises(ValueError, match="nll_loss"):
            F.nll_loss(F.log_softmax(scores, 1), torch.tensor([0, 1]))
