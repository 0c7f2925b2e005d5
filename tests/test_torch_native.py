"""Unchanged PyTorch models, batched: torch code written for ONE instance runs inside `fb.Graph`.

Each model below is written the way PyTorch users write it for batch size one (the tutorials'
char-RNN name classifier, LSTM part-of-speech tagger and seq2seq with attention, a child-sum
Tree-LSTM in the style of treelstm.pytorch, and more), with float64 parameters. It runs eagerly,
one instance at a time, and inside `fb.Graph(strategy=s)` (or `fb.map_batched` where control flow
depends on values): the losses and every parameter's gradient must agree to 1e-9, the module's
`state_dict` must keep its keys, and the graph must launch far fewer kernels than eager torch
runs ops, close to `stats().lower_bound`. A second group holds the Tensor API on expressions
against eager torch, and the errors of what cannot be recorded.
"""

from __future__ import annotations

import re
import warnings
from contextlib import nullcontext

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import flybatch as fb
from flybatch import capture
from flybatch.graph import INDEX_INPUT
from native import (ATOL, assert_same_training, check, draw, run_batched, run_eager,
                    seeded)

F64 = torch.float64
STRATEGIES = ["depth", "agenda"]

pytestmark = pytest.mark.usefixtures("one_thread", "float64_default")


@pytest.fixture(scope="module")
def float64_default():
    """The models' own tensors (`torch.zeros(1, H)`, one-hot inputs) are float64, as a float64
    user's are: `torch.set_default_dtype`."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    yield
    torch.set_default_dtype(default)


# ---- the tutorial char-RNN name classifier ----------------------------------------------------
N_LETTERS, N_CATEGORIES = 6, 3


class CharRNN(nn.Module):
    def __init__(self, input_size, hidden_size, output_size):
        super().__init__()
        self.hidden_size = hidden_size
        self.i2h = nn.Linear(input_size + hidden_size, hidden_size)
        self.h2o = nn.Linear(hidden_size, output_size)
        self.softmax = nn.LogSoftmax(dim=1)

    def forward(self, input, hidden):
        combined = torch.cat((input, hidden), 1)
        hidden = self.i2h(combined)
        output = self.h2o(hidden)
        output = self.softmax(output)
        return output, hidden

    def initHidden(self):
        return torch.zeros(1, self.hidden_size)


def line_to_tensor(line):
    tensor = torch.zeros(len(line), 1, N_LETTERS)
    for li, letter in enumerate(line):
        tensor[li][0][letter] = 1
    return tensor


NAMES = [([0, 1, 2], 1), ([3, 4], 0), ([1, 1, 5, 2, 3], 2), ([5, 4, 3], 1), ([2], 0)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_char_rnn_name_classifier_trains_as_eagerly(strategy):
    rnn = seeded(CharRNN(N_LETTERS, 8, N_CATEGORIES))
    criterion = nn.NLLLoss()

    def loss_of(example):
        line, category = example
        line_tensor = line_to_tensor(line)
        hidden = rnn.initHidden()
        for i in range(line_tensor.size()[0]):
            output, hidden = rnn(line_tensor[i], hidden)
        return criterion(output, torch.tensor([category], dtype=torch.long))

    eager, batched = check(rnn, loss_of, NAMES, strategy)
    # One launch per step of the longest name for the recurrence (cat, i2h); the output layer,
    # the log-softmax and the loss of every step of every name run once each; the sum of the
    # losses once.
    # The agenda meets the bound; `depth` runs the output layer once per depth.
    longest = max(len(line) for line, _ in NAMES)
    assert batched.stats.lower_bound == 2 * longest + 3 + 1
    if strategy == "agenda":
        assert batched.stats.batches == batched.stats.lower_bound
    assert batched.stats.batches <= 2 * batched.stats.lower_bound
    assert batched.stats.batches * 5 < eager.ops


# ---- the tutorial LSTM part-of-speech tagger --------------------------------------------------
class LSTMTagger(nn.Module):
    def __init__(self, embedding_dim, hidden_dim, vocab_size, tagset_size):
        super().__init__()
        self.hidden_dim = hidden_dim
        self.word_embeddings = nn.Embedding(vocab_size, embedding_dim)
        self.lstm = nn.LSTM(embedding_dim, hidden_dim)
        self.hidden2tag = nn.Linear(hidden_dim, tagset_size)

    def forward(self, sentence):
        embeds = self.word_embeddings(sentence)
        lstm_out, _ = self.lstm(embeds.view(len(sentence), 1, -1))
        tag_space = self.hidden2tag(lstm_out.view(len(sentence), -1))
        tag_scores = F.log_softmax(tag_space, dim=1)
        return tag_scores


def prepare_sequence(seq, to_ix):
    idxs = [to_ix[w] for w in seq]
    return torch.tensor(idxs, dtype=torch.long)


WORD_TO_IX = {w: i for i, w in enumerate("the dog ate apple everybody read that book a".split())}
TAG_TO_IX = {"DET": 0, "NN": 1, "V": 2}
TAGGED = [
    ("the dog ate the apple".split(), ["DET", "NN", "V", "DET", "NN"]),
    ("everybody read that book".split(), ["NN", "V", "DET", "NN"]),
    ("the dog read a book".split(), ["DET", "NN", "V", "DET", "NN"]),
    ("everybody ate".split(), ["NN", "V"]),
]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lstm_pos_tagger_trains_as_eagerly(strategy):
    model = seeded(LSTMTagger(6, 5, len(WORD_TO_IX), len(TAG_TO_IX)))
    loss_function = nn.NLLLoss()

    def loss_of(example):
        sentence, tags = example
        sentence_in = prepare_sequence(sentence, WORD_TO_IX)
        targets = prepare_sequence(tags, TAG_TO_IX)
        tag_scores = model(sentence_in)
        return loss_function(tag_scores, targets)

    eager, batched = check(model, loss_of, TAGGED, strategy)
    # The LSTM runs as ONE launch for every sentence, whatever the lengths.
    layers = sum(n for sig, n in batched.stats.by_signature.items() if "packed_lstm" in sig)
    assert layers == 1
    # The agenda meets the bound; `depth` runs a sentence's output layer at its own depth.
    if strategy == "agenda":
        assert batched.stats.batches == batched.stats.lower_bound
    assert batched.stats.batches <= 1.25 * batched.stats.lower_bound
    assert batched.stats.batches * 2 < eager.ops


# ---- a child-sum Tree-LSTM for sentence similarity, in the style of treelstm.pytorch ----------
class Tree:
    def __init__(self, idx, children=()):
        self.idx = idx
        self.children = list(children)
        self.num_children = len(self.children)
        self.state = None


class ChildSumTreeLSTM(nn.Module):
    def __init__(self, in_dim, mem_dim):
        super().__init__()
        self.in_dim = in_dim
        self.mem_dim = mem_dim
        self.ioux = nn.Linear(self.in_dim, 3 * self.mem_dim)
        self.iouh = nn.Linear(self.mem_dim, 3 * self.mem_dim)
        self.fx = nn.Linear(self.in_dim, self.mem_dim)
        self.fh = nn.Linear(self.mem_dim, self.mem_dim)

    def node_forward(self, inputs, child_c, child_h):
        child_h_sum = torch.sum(child_h, dim=0, keepdim=True)
        iou = self.ioux(inputs) + self.iouh(child_h_sum)
        i, o, u = torch.split(iou, iou.size(1) // 3, dim=1)
        i, o, u = torch.sigmoid(i), torch.sigmoid(o), torch.tanh(u)
        f = torch.sigmoid(self.fh(child_h) + self.fx(inputs).repeat(len(child_h), 1))
        fc = torch.mul(f, child_c)
        c = torch.mul(i, u) + torch.sum(fc, dim=0, keepdim=True)
        h = torch.mul(o, torch.tanh(c))
        return c, h

    def forward(self, tree, inputs):
        for idx in range(tree.num_children):
            self.forward(tree.children[idx], inputs)
        if tree.num_children == 0:
            child_c = inputs[0].detach().new(1, self.mem_dim).fill_(0.).requires_grad_()
            child_h = inputs[0].detach().new(1, self.mem_dim).fill_(0.).requires_grad_()
        else:
            child_c, child_h = zip(*map(lambda x: x.state, tree.children))
            child_c, child_h = torch.cat(child_c, dim=0), torch.cat(child_h, dim=0)
        tree.state = self.node_forward(inputs[tree.idx], child_c, child_h)
        return tree.state


class Similarity(nn.Module):
    def __init__(self, mem_dim, hidden_dim, num_classes):
        super().__init__()
        self.wh = nn.Linear(2 * mem_dim, hidden_dim)
        self.wp = nn.Linear(hidden_dim, num_classes)

    def forward(self, lvec, rvec):
        mult_dist = torch.mul(lvec, rvec)
        abs_dist = torch.abs(torch.add(lvec, -rvec))
        vec_dist = torch.cat((mult_dist, abs_dist), 1)
        out = torch.sigmoid(self.wh(vec_dist))
        out = F.log_softmax(self.wp(out), dim=1)
        return out


class SimilarityTreeLSTM(nn.Module):
    def __init__(self, vocab_size, in_dim, mem_dim, hidden_dim, num_classes):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, in_dim)
        self.childsumtreelstm = ChildSumTreeLSTM(in_dim, mem_dim)
        self.similarity = Similarity(mem_dim, hidden_dim, num_classes)

    def forward(self, ltree, linputs, rtree, rinputs):
        linputs = self.emb(linputs)
        rinputs = self.emb(rinputs)
        lstate, lhidden = self.childsumtreelstm(ltree, linputs)
        rstate, rhidden = self.childsumtreelstm(rtree, rinputs)
        output = self.similarity(lstate, rstate)
        return output


def similarity_target(score, num_classes=5):
    target = torch.zeros(1, num_classes)
    ceil, floor = int(torch.tensor(score).ceil()), int(score)
    if ceil == floor:
        target[0, floor - 1] = 1
    else:
        target[0, floor - 1] = ceil - score
        target[0, ceil - 1] = score - floor
    return target


def parse(spec):
    """A tree from nested tuples `(word index, child, child...)`."""
    return Tree(spec[0], [parse(c) for c in spec[1:]])


def random_tree(gen: torch.Generator, depth: int, next_word: list) -> tuple:
    """`(word index, child, child...)`: 0 to 3 children per node, words numbered in order."""
    word = next_word[0]
    next_word[0] += 1
    arity = 0 if depth == 0 else int(torch.randint(0, 4, (), generator=gen))
    return (word,) + tuple(random_tree(gen, depth - 1, next_word) for _ in range(arity))


def sentence_pairs(n: int, vocab: int) -> list:
    """n pairs (left tree, its words, right tree, its words, similarity in [1, 5])."""
    gen = torch.Generator().manual_seed(0)
    pairs = []
    for _ in range(n):
        sides = []
        for _ in range(2):
            count = [0]
            tree = random_tree(gen, 3, count)
            sides += [tree, torch.randint(0, vocab, (count[0],), generator=gen).tolist()]
        pairs.append((*sides, 1 + 4 * float(torch.rand((), generator=gen))))
    return pairs


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_child_sum_tree_lstm_trains_as_eagerly(strategy):
    model = seeded(SimilarityTreeLSTM(12, 4, 5, 6, 5))
    criterion = nn.KLDivLoss(reduction="batchmean")

    def loss_of(pair):
        ltree, lwords, rtree, rwords, score = pair
        output = model(parse(ltree), torch.tensor(lwords), parse(rtree), torch.tensor(rwords))
        return criterion(output, similarity_target(score))

    eager, batched = check(model, loss_of, sentence_pairs(8, 12), strategy)
    # Nodes with 0, 1, 2 or 3 children differ in shape from `torch.cat` of the children on, so
    # their signatures interleave along the trees and no schedule meets the bound; launches
    # stay about as many as one tree's nodes times its ops, whatever the number of pairs. The
    # agenda's heuristic, greedy on interleaved signatures, does worse here than `depth`. (The
    # embedding of every tree's words, whatever their number, is one launch, and its rows are
    # length-led: the bound and the launches both count them once; the excess is the
    # interleaving's.)
    excess = {"depth": 70, "agenda": 173}[strategy]  # as today: no more launches than these
    assert batched.stats.batches - batched.stats.lower_bound <= excess
    assert batched.stats.batches * 8 < eager.ops


# ---- the tutorial seq2seq: GRU encoder, attention decoder, greedy decoding ---------------------
SOS_token, EOS_token, MAX_LENGTH = 0, 1, 6


class EncoderRNN(nn.Module):
    def __init__(self, input_size, hidden_size):
        super().__init__()
        self.hidden_size = hidden_size
        self.embedding = nn.Embedding(input_size, hidden_size)
        self.gru = nn.GRU(hidden_size, hidden_size)

    def forward(self, input, hidden):
        embedded = self.embedding(input).view(1, 1, -1)
        output = embedded
        output, hidden = self.gru(output, hidden)
        return output, hidden

    def initHidden(self):
        return torch.zeros(1, 1, self.hidden_size)


class AttnDecoderRNN(nn.Module):
    def __init__(self, hidden_size, output_size, dropout_p=0.1, max_length=MAX_LENGTH):
        super().__init__()
        self.hidden_size = hidden_size
        self.output_size = output_size
        self.dropout_p = dropout_p
        self.max_length = max_length
        self.embedding = nn.Embedding(self.output_size, self.hidden_size)
        self.attn = nn.Linear(self.hidden_size * 2, self.max_length)
        self.attn_combine = nn.Linear(self.hidden_size * 2, self.hidden_size)
        self.dropout = nn.Dropout(self.dropout_p)
        self.gru = nn.GRU(self.hidden_size, self.hidden_size)
        self.out = nn.Linear(self.hidden_size, self.output_size)

    def forward(self, input, hidden, encoder_outputs):
        embedded = self.embedding(input).view(1, 1, -1)
        embedded = self.dropout(embedded)
        attn_weights = F.softmax(self.attn(torch.cat((embedded[0], hidden[0]), 1)), dim=1)
        attn_applied = torch.bmm(attn_weights.unsqueeze(0), encoder_outputs.unsqueeze(0))
        output = torch.cat((embedded[0], attn_applied[0]), 1)
        output = self.attn_combine(output).unsqueeze(0)
        output = F.relu(output)
        output, hidden = self.gru(output, hidden)
        output = F.log_softmax(self.out(output[0]), dim=1)
        return output, hidden, attn_weights


class Seq2Seq(nn.Module):
    def __init__(self, input_size, output_size, hidden_size):
        super().__init__()
        self.encoder = EncoderRNN(input_size, hidden_size)
        self.decoder = AttnDecoderRNN(hidden_size, output_size)


def tensor_from_ids(ids):
    return torch.tensor(ids + [EOS_token], dtype=torch.long).view(-1, 1)


TRANSLATIONS = [([2, 3, 4], [5, 6]), ([3], [2, 2, 2, 7]), ([6, 5, 4, 3, 2], [3]),
                ([4, 4], [6, 5, 4])]


def seq2seq_loss(model, pair, teacher_forcing, steps=None):
    """The tutorial's `train` without the optimizer: the loss of one sentence pair."""
    encoder, decoder, criterion = model.encoder, model.decoder, nn.NLLLoss()
    input_tensor, target_tensor = (tensor_from_ids(ids) for ids in pair)
    encoder_hidden = encoder.initHidden()
    input_length = input_tensor.size(0)
    target_length = target_tensor.size(0)
    encoder_outputs = torch.zeros(MAX_LENGTH, encoder.hidden_size)
    loss = 0
    for ei in range(input_length):
        encoder_output, encoder_hidden = encoder(input_tensor[ei], encoder_hidden)
        encoder_outputs[ei] = encoder_output[0, 0]
    decoder_input = torch.tensor([[SOS_token]])
    decoder_hidden = encoder_hidden
    for di in range(target_length):
        decoder_output, decoder_hidden, decoder_attention = decoder(
            decoder_input, decoder_hidden, encoder_outputs)
        loss += criterion(decoder_output, target_tensor[di])
        if teacher_forcing:
            decoder_input = target_tensor[di]
        else:
            topv, topi = decoder_output.topk(1)
            decoder_input = topi.squeeze().detach()
            if decoder_input.item() == EOS_token:
                break
    if steps is not None:
        steps.append(di + 1)
    return loss / target_length


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_seq2seq_with_teacher_forcing_trains_as_eagerly(strategy):
    model = seeded(Seq2Seq(7, 8, 5)).eval()  # eval: the decoder's dropout is the identity
    eager, batched = check(model, lambda p: seq2seq_loss(model, p, True), TRANSLATIONS, strategy)
    # The decoder starts at the depth where each encoder ends: `depth` batches its steps only
    # between sentences of equal input length, the agenda across all of them. (The bound counts
    # each pair's `loss +=` chain as one esum launch, which the agenda meets and depth, whose
    # partial sums lie at the depths of their last terms, cannot: 322 launches, bound 105.)
    ratio = {"depth": 3.1, "agenda": 1.4}[strategy]
    assert batched.stats.batches <= ratio * batched.stats.lower_bound
    assert batched.stats.batches * 4 < eager.ops


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_seq2seq_greedy_decoding_under_map_batched_trains_as_eagerly(strategy):
    model = seeded(Seq2Seq(7, 8, 5), seed=3).eval()
    steps = {"eager": [0] * len(TRANSLATIONS), "batched": [0] * len(TRANSLATIONS)}
    mode = "eager"

    def loss_of(item):
        k, pair = item
        decoded = []
        loss = seq2seq_loss(model, pair, False, decoded)
        steps[mode][k] = decoded[0]
        return loss

    eager = run_eager(model, loss_of, enumerate(TRANSLATIONS))
    mode = "batched"
    batched = run_batched(model, loss_of, list(enumerate(TRANSLATIONS)), strategy, mapped=True)
    assert_same_training(eager, batched)
    # The same greedy decisions (`.item()` of a batched `topk`), so the same decoding lengths,
    # and one forward per decoding step of the longest, not of all of them.
    assert steps["batched"] == steps["eager"]
    assert max(steps["eager"]) >= 3
    assert batched.stats.batches * 3 < eager.ops


# ---- more models ------------------------------------------------------------------------------
IN, H, CLASSES = 4, 5, 3
LENGTHS = [3, 1, 4, 2, 4, 5]


def sequences(lengths=LENGTHS, seed=1):
    """Per instance: `length` input rows of shape [1, IN] (the batch of one) and a class."""
    gen = torch.Generator().manual_seed(seed)
    return [([torch.randn(1, IN, generator=gen) for _ in range(n)], k % CLASSES)
            for k, n in enumerate(lengths)]


class CellClassifier(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.cell = cell
        self.out = nn.Linear(H, CLASSES)

    def forward(self, xs):
        h = torch.zeros(1, H)
        c = torch.zeros(1, H)
        for x in xs:
            if isinstance(self.cell, nn.LSTMCell):
                h, c = self.cell(x, (h, c))
            else:
                h = self.cell(x, h)
        return self.out(h)


CELLS = {"GRUCell": lambda: nn.GRUCell(IN, H), "LSTMCell": lambda: nn.LSTMCell(IN, H),
         "RNNCell": lambda: nn.RNNCell(IN, H),
         "RNNCell-relu": lambda: nn.RNNCell(IN, H, nonlinearity="relu")}


@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_recurrent_cell_classifier_trains_as_eagerly(strategy, cell):
    model = seeded(CellClassifier(CELLS[cell]()))

    def loss_of(example):
        xs, label = example
        return F.cross_entropy(model(xs), torch.tensor([label]))

    eager, batched = check(model, loss_of, sequences(), strategy)
    # The cell runs once per step of the longest sequence: one fused node per step.
    cells = sum(n for sig, n in batched.stats.by_signature.items() if "_cell" in sig)
    assert cells == max(LENGTHS)
    if strategy == "agenda":
        assert batched.stats.batches == batched.stats.lower_bound
    assert batched.stats.batches * 5 < eager.ops


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(IN, 8), nn.LayerNorm(8), nn.ReLU(), nn.Dropout(0.5),
                                 nn.Linear(8, 8), nn.Tanh())
        self.classify = nn.Linear(8, CLASSES)
        self.regress = nn.Linear(8, 2)
        self.flag = nn.Linear(8, 1)

    def forward(self, x):
        z = self.mlp(x)
        return self.classify(z), self.regress(z), self.flag(z)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sequential_mlp_with_three_losses_trains_as_eagerly(strategy):
    model = seeded(FeedForward()).eval()  # eval: its dropout is the identity
    gen = torch.Generator().manual_seed(4)
    items = [(torch.randn(IN, generator=gen), k % CLASSES, torch.randn(2, generator=gen),
              float(k % 2)) for k in range(7)]

    def loss_of(item):
        x, label, target, flag = item
        logits, value, logit = model(x)
        return (F.cross_entropy(logits.unsqueeze(0), torch.tensor([label]))
                + F.mse_loss(value, target)
                + F.binary_cross_entropy_with_logits(logit, torch.tensor([flag])))

    eager, batched = check(model, loss_of, items, strategy)
    # No step depends on another instance: every op of the model runs once for all of them.
    assert batched.stats.batches == batched.stats.lower_bound
    assert batched.stats.batches * 6 < eager.ops


class BiLSTMTagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(IN, H, num_layers=2, bidirectional=True)
        self.tag = nn.Linear(2 * H, CLASSES)
        self.summary = nn.Linear(4 * H, CLASSES)

    def forward(self, xs):
        out, (h_n, c_n) = self.lstm(torch.stack(xs))  # [length, 1, 2H], [4, 1, H]
        final = torch.cat([h_n[-2], h_n[-1]], dim=1)  # the last layer, both directions
        return self.tag(out.squeeze(1)), self.summary(torch.cat([final, c_n[-1] * 0, c_n[0] * 0],
                                                                dim=1))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bidirectional_two_layer_lstm_trains_as_eagerly(strategy):
    model = seeded(BiLSTMTagger())

    def loss_of(example):
        xs, label = example
        tags, summary = model(xs)
        gold = torch.tensor([(label + t) % CLASSES for t in range(len(xs))])
        return F.cross_entropy(tags, gold, reduction="sum") + F.cross_entropy(
            summary, torch.tensor([label]))

    eager, batched = check(model, loss_of, sequences(), strategy)
    # One launch per layer (both directions) for every sequence, whatever the lengths.
    layers = sum(n for sig, n in batched.stats.by_signature.items() if "packed_lstm" in sig)
    assert layers == 2
    if strategy == "agenda":
        assert batched.stats.batches == batched.stats.lower_bound
    assert batched.stats.batches <= 2 * batched.stats.lower_bound
    assert batched.stats.batches * 2 < eager.ops


class BagOfWords(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, IN, padding_idx=0)
        self.out = nn.Linear(IN, CLASSES)

    def forward(self, words):
        return self.out(self.embedding(words).mean(dim=0, keepdim=True))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_embedding_padding_row_gets_no_gradient(strategy):
    model = seeded(BagOfWords())
    with torch.no_grad():
        model.embedding.weight[0] = 0  # what nn.Embedding does with padding_idx at init
    items = [([3, 0, 0], 1), ([5, 2, 0, 7], 0), ([0, 9], 2), ([4, 4, 1, 0], 1)]

    def loss_of(item):
        words, label = item
        return F.cross_entropy(model(torch.tensor(words)), torch.tensor([label]))

    eager, batched = check(model, loss_of, items, strategy)
    grad = batched.grads["embedding.weight"]
    assert torch.equal(grad[0], torch.zeros(IN))
    assert grad[1:].abs().sum() > 0


class Reshaper(nn.Module):
    """A model made of views, indexing and reductions: [n, 2, IN] inputs."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(IN, 6)
        self.score = nn.Linear(3, 1)

    def forward(self, x):
        y = self.proj(x)                                    # [n, 2, 6]
        a, b = y.chunk(2, dim=-1)                           # [n, 2, 3] each
        z = (a * b.sigmoid()).transpose(0, 1)               # [2, n, 3]
        best, where = z.max(dim=1)                          # [2, 3]
        first = z[:, 0, :]                                  # [2, 3]
        last = z[-1, -1]                                    # [3]
        m = torch.stack([best, first, last.unsqueeze(0).expand(2, 3)], dim=0)  # [3, 2, 3]
        flat = m.view(6, 3).t().contiguous().view(-1)       # [18]
        return self.score(flat.view(6, 3)).squeeze(-1).sum() + x[..., 1:].mean()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_views_indexing_and_reductions_train_as_eagerly(strategy):
    model = seeded(Reshaper())
    gen = torch.Generator().manual_seed(5)
    items = [torch.randn(n, 2, IN, generator=gen) for n in (2, 3, 2, 4, 3)]
    eager, batched = check(model, lambda x: model(x) ** 2, items, strategy)
    assert batched.stats.batches * 3 < eager.ops


# Sentence encoders over a whole instance at once: a sentence is [length, IN] word vectors.
SENTENCE_LENGTHS = [3, 5, 2, 5, 3, 2, 2, 3, 5, 3, 5, 2]


def sentences(lengths=SENTENCE_LENGTHS, seed=6):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, IN, generator=gen), k % CLASSES) for k, n in enumerate(lengths)]


class ConvClassifier(nn.Module):
    """Kim-style CNN: a convolution over time, max over time, a linear classifier."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(IN, 6, kernel_size=3, padding=1)
        self.out = nn.Linear(6, CLASSES)

    def forward(self, words):                      # [length, IN]
        x = words.t().unsqueeze(0)                 # [1, IN, length]: conv1d's batch of one
        h = torch.relu(self.conv(x))               # [1, 6, length]
        return self.out(torch.max(h, dim=2)[0])    # [1, CLASSES]


class SelfAttentionClassifier(nn.Module):
    """One scaled dot-product self-attention layer written by hand, residual and LayerNorm."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(IN, IN), nn.Linear(IN, IN), nn.Linear(IN, IN)
        self.norm = nn.LayerNorm(IN)
        self.out = nn.Linear(IN, CLASSES)

    def forward(self, words):                      # [length, IN]
        scores = self.q(words) @ self.k(words).transpose(-1, -2) / IN ** 0.5
        h = self.norm(words + torch.softmax(scores, dim=-1) @ self.v(words))
        return self.out(h.mean(0)).unsqueeze(0)


class TorchAttentionClassifier(nn.Module):
    """torch.nn's own attention modules, fed the [length, 1, IN] batch-of-one layout."""

    def __init__(self, layer: bool):
        super().__init__()
        self.encode = nn.TransformerEncoderLayer(IN, 2, 8, dropout=0.0) if layer else \
            nn.MultiheadAttention(IN, 2)
        self.layer = layer
        self.out = nn.Linear(IN, CLASSES)

    def forward(self, words):
        x = words.unsqueeze(1)
        h = self.encode(x) if self.layer else self.encode(x, x, x)[0]
        return self.out(h.squeeze(1).sum(0)).unsqueeze(0)


ENCODERS = {"conv": ConvClassifier, "self-attention": SelfAttentionClassifier,
            "multihead-attention": lambda: TorchAttentionClassifier(layer=False),
            "transformer-layer": lambda: TorchAttentionClassifier(layer=True)}


@pytest.mark.parametrize("encoder", ENCODERS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sentence_encoders_over_whole_sentences_train_as_eagerly(strategy, encoder):
    model = seeded(ENCODERS[encoder]())

    def loss_of(item):
        words, label = item
        return F.cross_entropy(model(words), torch.tensor([label]))

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no call may fall back to running on values
        eager, batched = check(model, loss_of, sentences(), strategy)
    # Ops over whole sentences batch sentences of one length (three lengths here): the
    # bound, and far fewer launches than eager's ops.
    if strategy == "agenda":
        assert batched.stats.batches == batched.stats.lower_bound
    assert batched.stats.batches * 3 < eager.ops


def test_an_expression_describes_its_storage_as_a_dense_tensor_would():
    with fb.Graph():
        x = fb.input(torch.randn(2, 3)) * 1.0
        assert not x.is_nested and not x.is_sparse and not x.is_quantized and not x.is_meta
        assert x.is_cpu and not x.is_cuda


class NoisyModel(nn.Module):
    """Randomness of every kind a per-instance model uses: dropout layers at two depths, a
    functional dropout, samples drawn from computed values, and plain draws in between."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(5, 5), nn.Linear(5, 3), nn.Dropout(0.4)

    def forward(self, x):
        h = self.drop(torch.tanh(self.a(x)))
        h = h * torch.bernoulli(torch.sigmoid(h)) + torch.normal(h, 0.1)
        h = F.rrelu(h, training=True) + 0.1 * torch.randn(5)
        h = F.dropout(torch.tanh(self.a(h)), 0.2) + F.alpha_dropout(h, 0.3, True)
        d = torch.distributions.Categorical(logits=self.b(self.drop(h)))
        return -d.log_prob(d.sample())


@pytest.mark.parametrize("mapped", [False, True], ids=["loop", "map_batched"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_seeded_model_draws_what_eager_draws(strategy, mapped):
    """Dropout masks are drawn when a call is recorded, functions that draw from values run on
    the values at the call: both in program order, as eagerly, whatever the batching. Under
    map_batched the instances' draws interleave by rounds, so only the loop equals eager's
    stream; map_batched equals itself under every strategy."""
    model = seeded(NoisyModel())
    items = draw(3, *[(5,)] * 4)
    torch.manual_seed(11)
    expected = run_eager(model, model, items) if not mapped else None
    torch.manual_seed(11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "runs on the values (a forward per call)"
        batched = run_batched(model, model, items, strategy, mapped=mapped)
        if mapped:
            torch.manual_seed(11)
            expected = run_batched(model, model, items, "none", mapped=True)
    assert_same_training(expected, batched)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lstm_dropout_between_layers_draws_what_eager_draws(strategy):
    model = seeded(nn.LSTM(3, 4, num_layers=3, dropout=0.5, bidirectional=True))

    def loss_of(x):
        out, (h, c) = model(x)
        return out.sum() + h.sum() + c.sum()

    items = draw(5, (4, 3), (2, 3), (5, 3))
    torch.manual_seed(3)
    expected = run_eager(model, loss_of, items)
    torch.manual_seed(3)
    assert_same_training(expected, run_batched(model, loss_of, items, strategy))


def test_a_call_on_values_under_map_batched_leaves_the_other_instances_captured():
    """`torch.nonzero(y > 0)` needs values: its instance waits for a round inside the capture
    mode's handler, where torch has taken the mode off its (per-thread) stack. The instances
    that run meanwhile are still recorded, and the waiting one resumes captured."""
    linear = seeded(nn.Linear(4, 3))

    def instance(x):
        y = linear(x)
        kept = torch.nonzero(y > 0).shape[0]
        return (torch.tanh(y) * kept).sum()

    items = draw(2, *[(1, 4)] * 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "runs on the values (a forward per call)"
        batched = run_batched(linear, instance, items, "agenda", mapped=True)
    assert_same_training(run_eager(linear, instance, items), batched)
    assert max(batched.stats.by_signature.values()) == 1  # each op: one launch for all three


def test_dropout_in_eval_mode_is_the_identity():
    drop = nn.Dropout(0.5)
    drop.eval()
    x0 = torch.randn(3, 4)
    with fb.Graph() as g:
        x = fb.input(x0) * 1.0
        y = drop(x)
        z = drop.train()(x)
        assert torch.equal(y.value(), x0)
        kept = z.value() != 0
        assert not kept.all()
        torch.testing.assert_close(z.value()[kept], 2 * x0[kept])
        assert g.stats().nodes == 5  # input, scalar 1.0, the product, train-mode dropout and its mask


def test_a_float64_model_needs_no_graph_dtype():
    torch.set_default_dtype(torch.float32)
    try:
        model = seeded(nn.Linear(IN, 2))
        x = torch.randn(1, IN, dtype=F64)
        with fb.Graph() as g:
            y = model(x)
            assert g.dtype == F64 and y.dtype == F64
            value = y.value().detach()
        torch.testing.assert_close(value, model(x).detach(), rtol=0, atol=ATOL)
    finally:
        torch.set_default_dtype(F64)


# ---- the Tensor API on expressions, against eager torch ----------------------------------------
ROW = torch.tensor([0.5, -1.0, 2.0], dtype=F64)
PROBES = {
    "sum with a negative dim and keepdim": lambda x: x.sum(dim=-1, keepdim=True),
    "sum of everything": lambda x: x.sum(),
    "mean over dim 0": lambda x: x.mean(0),
    "mean keeping a negative dim": lambda x: x.mean(-2, keepdim=True),
    ".t()": lambda x: x.t(),
    ".T": lambda x: x.T,
    "transpose(0, 1)": lambda x: x.transpose(0, 1),
    "transpose(-1, -2)": lambda x: x.transpose(-1, -2),
    "permute": lambda x: x.permute(1, 0),
    "view(-1)": lambda x: x.view(-1),
    "reshape": lambda x: x.reshape(3, 2),
    "flatten": lambda x: x.flatten(),
    "unsqueeze(-1)": lambda x: x.unsqueeze(-1),
    "squeeze()": lambda x: x.view(1, 2, 1, 3).squeeze(),
    "squeeze(0) of unsqueeze(0)": lambda x: x.unsqueeze(0).squeeze(0),
    "chunk": lambda x: torch.stack(x.chunk(3, dim=1)),
    "split into sizes": lambda x: torch.cat(torch.split(x, [1, 2], dim=-1), -1),
    "expand": lambda x: x[:1].expand(4, 3),
    "repeat": lambda x: x.repeat(2, 1),
    "x[1, -1]": lambda x: x[1, -1],
    "x[:, 1:]": lambda x: x[:, 1:],
    "x[..., None]": lambda x: x[..., None],
    "x[:, ::2]": lambda x: x[:, ::2],
    "x[tensor of indices]": lambda x: x[torch.tensor([1, 0, 1])],
    "x[0-d tensor]": lambda x: x[torch.tensor(1)],
    "x[list]": lambda x: x[[1, 0]],
    "narrow": lambda x: x.narrow(1, 1, 2),
    "select(-1, 0)": lambda x: x.select(-1, 0),
    "unbind": lambda x: x.unbind(0)[1],
    "broadcast a row": lambda x: x + ROW,
    "broadcast a column": lambda x: x * x[:, :1],
    "reflected operators": lambda x: 1 - 2 / (x * x + 1),
    "powers": lambda x: x ** 2 + 2 ** x,
    "abs of negation": lambda x: abs(-x),
    "softmax(dim=-1)": lambda x: torch.softmax(x, dim=-1),
    "log_softmax(dim=0)": lambda x: F.log_softmax(x, dim=0),
    "logsumexp": lambda x: x.logsumexp(-1),
    "cumsum": lambda x: x.cumsum(-1),
    "max(dim).values": lambda x: x.max(1).values,
    "max(dim)[0]": lambda x: x.max(dim=1)[0],
    "max of everything": lambda x: x.max(),
    "min keeping dim": lambda x: torch.min(x, -1, keepdim=True).values,
    "amax": lambda x: x.amax(-1),
    "topk values": lambda x: x.topk(2).values,
    "topk along dim 0": lambda x: x.topk(1, dim=0)[0],
    "norm": lambda x: x.norm(dim=-1),
    "var and std": lambda x: x.var(dim=1).sum() + x.std(),
    "prod": lambda x: x.prod(1),
    "clamp": lambda x: x.clamp(min=-0.5, max=0.5),
    "where with torch.gt": lambda x: torch.where(torch.gt(x, 0), x, x * 0.1),
    "masked_fill": lambda x: x.masked_fill(torch.tensor([[True, False, True], [False] * 3]), 0.),
    "gather": lambda x: x.gather(1, torch.tensor([[0], [2]])),
    "index_select": lambda x: x.index_select(1, torch.tensor([2, 0])),
    "tanh, sigmoid, relu methods": lambda x: x.tanh().sigmoid().relu(),
    "exp and log": lambda x: torch.log(torch.exp(x)),
    "matmul with a tensor": lambda x: x @ ROW,
    "mm": lambda x: torch.mm(x, x.t()),
    "bmm": lambda x: torch.bmm(x.unsqueeze(0), x.t().unsqueeze(0)),
    "einsum": lambda x: torch.einsum("ij,kj->ik", x, x),
    "outer": lambda x: torch.outer(x[0], x[1]),
    "dot": lambda x: torch.dot(x[0], x[1]),
    "cat(dim=-1)": lambda x: torch.cat([x, x], dim=-1),
    "cat of a tuple, dim by position": lambda x: torch.cat((x, x * 2, x), 1),
    "cat along the first dim": lambda x: torch.cat([x, x.tanh()]) + torch.cat([x, x], dim=-2),
    "concat and concatenate": lambda x: torch.concat([x, x], -1) + torch.concatenate([x, x], 1),
    "cat of an expression and a tensor": lambda x: torch.cat([x, torch.ones(2, 1)], 1),
    "cat of a float64 and a float32 expression": lambda x: torch.cat([x.float(), x], 0),
    "stack(dim=-1)": lambda x: torch.stack([x, x], dim=-1),
    "zeros_like and new_zeros": lambda x: x + torch.zeros_like(x) + x.new_zeros(2, 3),
    "cosine_similarity": lambda x: F.cosine_similarity(x[0], x[1], dim=0),
    "layer_norm": lambda x: F.layer_norm(x, (3,)),
    "mse_loss": lambda x: F.mse_loss(x, torch.ones(2, 3)),
    "binary_cross_entropy_with_logits": lambda x: F.binary_cross_entropy_with_logits(
        x, torch.ones(2, 3)),
    "binary_cross_entropy": lambda x: F.binary_cross_entropy(x.sigmoid(), torch.ones(2, 3)),
    "cross_entropy summed": lambda x: F.cross_entropy(x, torch.tensor([2, 0]), reduction="sum"),
    "nll_loss": lambda x: F.nll_loss(F.log_softmax(x, 1), torch.tensor([1, 1])),
    "float().double()": lambda x: x.float().double(),
    "sum() of expressions": lambda x: sum([x, x]),
}


@pytest.mark.parametrize("probe", PROBES)
def test_tensor_api_on_an_expression_matches_torch(probe):
    fn = PROBES[probe]
    x0 = torch.randn(2, 3, generator=torch.Generator().manual_seed(1))
    eager_x = x0.clone().requires_grad_()
    want = fn(eager_x)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(2))
    (want * weights).sum().backward()
    p = nn.Parameter(x0.clone())
    with fb.Graph(strategy="agenda"):
        x = p * 1.0
        got = fn(x)
        assert isinstance(got, fb.Expression)
        assert (got.shape, got.dtype) == (want.shape, want.dtype)
        (got * weights).sum().backward()
        value = got.value().detach()
    torch.testing.assert_close(value, want.detach(), rtol=0, atol=ATOL)
    torch.testing.assert_close(p.grad, eager_x.grad, rtol=0, atol=ATOL)


def test_the_pieces_of_a_chunk_batch_across_instances():
    """chunk / split / unbind give one slice node per piece, and each piece batches over
    every instance (in this graph and, by the same recipe, in the next one)."""
    p = nn.Parameter(torch.randn(4, 6))
    want = [(a * b + c) for a, b, c in (p[i].chunk(3) for i in range(4))]
    want += [(a * b + c) for a, b, c in (p[i].split(2) for i in range(4))]
    want += [p[i].view(3, 2).unbind(1)[1] for i in range(4)]
    for _ in range(2):
        with fb.Graph(strategy="agenda") as g:
            xs = [p[i] * 1.0 for i in range(4)]
            got = [(a * b + c) for a, b, c in (x.chunk(3) for x in xs)]
            got += [(a * b + c) for a, b, c in (torch.split(x, 2) for x in xs)]
            got += [x.view(3, 2).unbind(1)[1] for x in xs]
            values = g.forward(got)
            stats = g.stats()
        for value, expected in zip(values, want):
            torch.testing.assert_close(value.detach(), expected.detach(), rtol=0, atol=ATOL)
        # the rows of p, x; the 3 pieces of chunk and split (the same slices: one launch each),
        # a * b, + c; the view, unbind's 2 pieces
        assert stats.batches == 2 + 3 + 2 + 3, stats.by_signature


@pytest.mark.parametrize("index_of", [lambda z: z.argmax(1), lambda z: torch.argmax(z, dim=1),
                                      lambda z: z.argmin(-1)])
def test_the_indices_of_maxima_along_a_dim_batch_across_instances(index_of):
    """`z.argmax(1)` (the accuracy of a tagger, a target network's action) is one launch for
    every instance, as `amax` is."""
    lin, xs = seeded(nn.Linear(4, 3)), draw(2, *[(5, 4)] * 4)
    with fb.Graph(strategy="agenda") as g:
        got = [index_of(lin(x)) for x in xs]
        values = g.forward(got)
        stats = g.stats()
    for value, x in zip(values, xs):
        assert value.tolist() == index_of(lin(x)).tolist()
    assert stats.batches == 2, stats.by_signature  # the linear, the indices


def test_a_reshape_keeps_its_dtype_and_batches_only_with_its_own():
    """Views of one shape in several dtypes: each keeps its dtype, views of one dtype share a
    launch and views of different dtypes never do; a view to the same shape is the input."""
    p = nn.Parameter(torch.randn(2, 3))
    want = [p.view(-1), (p > 0).long().view(-1), p.float().view(-1), (p * 2).view(-1)]
    with fb.Graph(strategy="agenda") as g:
        x = p * 1.0
        assert x.view(2, 3) is x and x.contiguous() is x
        views = [x.view(-1), (x > 0).long().view(-1), x.float().view(-1), (x * 2).view(-1)]
        got = g.forward(views)
        launches = g.stats().batches
    for value, expected in zip(got, want):
        assert value.dtype == expected.dtype
        torch.testing.assert_close(value.detach(), expected.detach(), rtol=0, atol=0)
    # x, x > 0, long, float, x * 2; the views: one per dtype
    assert launches == 5 + 3


def test_expression_describes_itself_like_a_tensor():
    w = nn.Parameter(torch.randn(2, 3))
    with fb.Graph():
        x = w * 2
        assert x.shape == (2, 3) and x.size() == torch.Size([2, 3])
        assert x.size(-1) == 3 and x.size(0) == 2
        assert x.dim() == x.ndim == 2 and len(x) == 2 and x.numel() == 6
        assert x.dtype == F64 and x.device == torch.device("cpu")
        assert x.requires_grad and x.detach().requires_grad is False
        assert x.is_floating_point()
        with torch.no_grad():
            assert not (w * 2).requires_grad


def test_a_row_stays_a_row():
    linear = seeded(nn.Linear(6, 4))
    with fb.Graph():
        row = fb.input(torch.randn(2, 3)).view(1, -1)
        assert row.shape == (1, 6)
        assert linear(row).shape == (1, 4)
        assert torch.cat((row, row), 1).shape == (1, 12)
        assert F.log_softmax(linear(row), dim=1).shape == (1, 4)
        assert linear(row.view(-1)).shape == (4,)


def test_peeks_return_python_values_and_backward_fills_grads():
    w = nn.Parameter(torch.tensor([[1.0, 5.0, 3.0], [4.0, 2.0, 6.0]]))
    with fb.Graph():
        x = w * 1.0
        assert x.tolist() == [[1.0, 5.0, 3.0], [4.0, 2.0, 6.0]]
        assert x[0, 1].item() == 5.0
        values, indices = x.topk(1)
        assert indices.dtype == torch.long and indices.tolist() == [[1], [2]]
        best = x.max(dim=1)
        assert best.values.tolist() == [5.0, 6.0] and best.indices.tolist() == [1, 2]
        assert x.argmax() == 5
        detached = x.detach().value()
        (values.sum() * 2).backward()
    assert torch.equal(detached, w.detach()) and not detached.requires_grad
    assert w.grad.tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, 2.0]]


def test_unary_functions_map_floating_expressions_onto_fb_ops_and_keep_integer_ones():
    with fb.Graph() as g:
        y = fb.input(torch.tensor([-2.0, 3.0]))
        for out in (torch.sigmoid(y), y.tanh(), F.relu(y), torch.abs(y)):
            assert g.op_of(out.id).name in ("sigmoid", "tanh", "relu", "abs")  # fb ops
        assert F.relu(y, inplace=False).tolist() == [0.0, 3.0]
        x = fb.input(torch.tensor([-2, 3]))
        assert torch.abs(x).dtype == torch.int64 and torch.abs(x).tolist() == [2, 3]


PROMOTING = {  # an operand not of the graph's floating dtype: torch's type promotion decides
    "mask.long() + 1": lambda h: (h > 0).long() + 1,
    "2 * mask.long()": lambda h: 2 * (h > 0).long(),
    "1 - mask.int()": lambda h: 1 - (h > 0).int(),
    "-mask.long()": lambda h: -(h > 0).long(),
    "mask.long() / 2": lambda h: (h > 0).long() / 2,
    "h.float() * 3": lambda h: h.float() * 3,
    "h.float() + h.float()": lambda h: h.float() + h.float(),
    "torch.sigmoid(h.float())": lambda h: torch.sigmoid(h.float()),
    "h.float().tanh() - 1": lambda h: h.float().tanh() - 1,
    "h + mask.long()": lambda h: h + (h > 0).long(),
}


@pytest.mark.parametrize("expression", PROMOTING)
def test_operators_on_expressions_of_another_dtype_promote_as_torch_does(expression):
    x = torch.tensor([-1.5, 0.25, 2.0], dtype=F64)
    w = nn.Parameter(torch.tensor([1.0, -3.0, 0.5], dtype=F64))
    expected = PROMOTING[expression](w * x)
    with fb.Graph():
        got = PROMOTING[expression](w * x)
        assert got.dtype == expected.dtype
        assert torch.equal(got.value().detach(), expected.detach())


def test_an_integer_expression_computed_per_instance_indexes_an_embedding():
    emb = seeded(nn.Embedding(4, 3))
    w = nn.Parameter(torch.tensor([1.0, -3.0, 0.5], dtype=F64))
    expected = emb((w > 0).long() + 1).sum()
    with fb.Graph():
        got = emb((w * 1.0 > 0).long() + 1).sum()  # a float index: F.embedding would refuse it
        torch.testing.assert_close(got.value(), expected, rtol=0, atol=ATOL)


def test_calls_on_plain_tensors_run_eagerly():
    with fb.Graph() as g:
        h = torch.zeros(1, 3)
        ids = torch.tensor([1, 2])
        assert type(h) is torch.Tensor and type(ids) is torch.Tensor
        assert type(h + 1) is torch.Tensor
        assert g.n_nodes == 0


def test_under_no_grad_a_recorded_call_carries_no_gradient():
    linear = seeded(nn.Linear(3, 2))
    with fb.Graph():
        x = fb.input(torch.randn(3))
        with torch.no_grad():
            frozen = linear(x)
        live = linear(x)
        assert not frozen.requires_grad and live.requires_grad
        (frozen.sum() + live.sum()).backward()
    torch.testing.assert_close(linear.bias.grad, torch.ones(2))


IN_PLACE = {
    "Tensor.add_": lambda x: x.add_(1),
    "Tensor.mul_": lambda x: x.mul_(2),
    "Tensor.zero_": lambda x: x.zero_(),
    "Tensor.fill_": lambda x: x.fill_(0.0),
    "Tensor.copy_": lambda x: x.copy_(torch.ones(2, 3)),
    "Tensor.clamp_": lambda x: x.clamp_(0, 1),
    "Tensor.sigmoid_": lambda x: x.sigmoid_(),
    "torch.relu_": lambda x: torch.relu_(x),
    "F.relu(inplace=True)": lambda x: F.relu(x, inplace=True),
    "F.dropout(inplace=True)": lambda x: F.dropout(x, 0.5, True, inplace=True),
    "nn.ReLU(inplace=True)": lambda x: nn.ReLU(inplace=True)(x),
}


@pytest.mark.parametrize("op", IN_PLACE)
def test_in_place_ops_on_expressions_raise_naming_the_function(op):
    with fb.Graph():
        x = fb.input(torch.randn(2, 3)) * 1.0
        name = op.split("(")[0] if "(inplace" in op else op
        if name == "nn.ReLU":
            name = "F.relu"
        with pytest.raises(TypeError, match=name.replace(".", r"\.") + r"\b.*in place"):
            IN_PLACE[op](x)


def test_item_assignment_into_an_expression_raises():
    with fb.Graph():
        x = fb.input(torch.randn(2, 3)) * 1.0
        with pytest.raises(TypeError, match=r"item assignment .*x\[0\] = \.\.\. on shape "
                                            r"\(2, 3\).* out of place"):
            x[0] = 1.0


def _eager_and_batched(fn):
    """`fn()`'s value computed eagerly and inside a graph."""
    with torch.enable_grad():
        eager = fn()
    with fb.Graph():
        return eager.item(), fn().item()


def test_an_augmented_assignment_to_an_expression_is_seen_through_every_reference():
    """`h += 1` writes h in place eagerly: a name or a list bound to the same tensor sees it."""
    linear, x = seeded(nn.Linear(3, 3)), torch.randn(3, dtype=torch.float64)

    def aliased():
        h = linear(x)
        alias, kept = h, [h]
        alias += 1
        kept[0] *= 2
        h -= 0.5
        return h.sum() + alias.sum() + kept[0].sum()

    eager, batched = _eager_and_batched(aliased)
    assert batched == pytest.approx(eager, abs=1e-12)


def test_an_augmented_assignment_under_no_grad_changes_values_not_the_gradients_path():
    linear, x = seeded(nn.Linear(3, 3)), torch.randn(3, dtype=torch.float64)
    runs = []
    for context in (torch.enable_grad(), fb.Graph()):
        linear.zero_grad()
        with context:
            h = linear(x) * 1.0
            with torch.no_grad():
                h += 1
                h *= 2
            loss = (h * h).sum()
            loss.backward()
            runs.append((loss.item(), linear.weight.grad.clone()))
    assert runs[1][0] == pytest.approx(runs[0][0], abs=1e-12)
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=0, atol=1e-12)


def test_a_scalar_loss_accumulated_with_plus_equals_is_one_sum():
    linear, xs = seeded(nn.Linear(3, 1)), draw(0, *[(3,)] * 6)
    with fb.Graph() as g:
        loss = 0
        for x in xs:
            loss += linear(x).sum()
        loss.backward()
    assert g.stats().batches <= 4  # linear, sum, 0 + the first term, ONE sum of the rest


@pytest.mark.parametrize("peek", [False, True])
def test_a_scalar_written_with_plus_equals_then_added_to_is_its_new_value(peek):
    """The tutorials' seq2seq: `loss += criterion(...)` on a loss that is not a pending sum
    (a loss function's result, or a sum a value request computed), then `loss + more`: the
    later sum adds the new value's terms, which is no stale read of the value written."""
    linear, xs = seeded(nn.Linear(3, 2)), draw(1, *[(3,)] * 3)

    def accumulated():
        loss = F.cross_entropy(linear(xs[0]).unsqueeze(0), torch.tensor([1]))
        for x in xs[1:]:
            loss += linear(x).logsumexp(0)
            if peek:
                loss.item()
            loss = loss + 0.1 * linear(x).sum()
        return loss

    eager, batched = _eager_and_batched(accumulated)
    assert batched == pytest.approx(eager, abs=1e-12)


@pytest.mark.parametrize("write, error", [
    (lambda h: h.__iadd__(torch.ones(2, 3)), r"__iadd__: a result of shape \(2, 3\) cannot"),
    (lambda h: (h > 0).long().__iadd__(1.5), "can't be cast")])
def test_an_augmented_assignment_eager_torch_refuses_raises_at_the_call(write, error):
    linear = seeded(nn.Linear(3, 3))
    with fb.Graph(), pytest.raises(RuntimeError, match=error):
        write(linear(torch.randn(3, dtype=torch.float64)))


VIEWS_THEN_WRITE = {
    "a slice taken before the write": lambda h: (h[0:2], h.__iadd__(1))[0],
    "a row taken before the write": lambda h: (h[0], h.__iadd__(1))[0],
    "a reshape taken before the write": lambda h: (h.view(1, 3), h.__iadd__(1))[0],
    "the tensor a detached view wrote into": lambda h: (h, h.detach().__imul__(0))[0],
}


@pytest.mark.parametrize("case", VIEWS_THEN_WRITE)
def test_what_shares_storage_with_an_expression_written_in_place_raises_when_read_after(case):
    """Eagerly a view (or the tensor viewed) shows the write; batched it would hold the old
    values, so reading it after the write raises instead of answering differently."""
    linear = seeded(nn.Linear(3, 3))
    with fb.Graph():
        stale = VIEWS_THEN_WRITE[case](linear(torch.randn(3, dtype=torch.float64)) * 1.0)
        with pytest.raises(RuntimeError, match=r"shares storage, eagerly, with an expression "
                                               r"later written in place by Tensor\.__i"):
            (stale * 2).sum().item()


def test_a_view_used_before_the_write_keeps_its_value():
    linear, x = seeded(nn.Linear(3, 3)), torch.randn(3, dtype=torch.float64)

    def used_before():
        h = linear(x).view(1, 3)  # a write through a view of a result nobody else holds
        partial = h[0].sum()
        h += 1
        return partial + h.sum()

    eager, batched = _eager_and_batched(used_before)
    assert batched == pytest.approx(eager, abs=1e-12)


def test_the_matmul_operator_of_expressions_beyond_matrices_is_torchs_batched_product():
    """Attention heads: `q @ k.transpose(-2, -1)` on [heads, n, d] (and a 3-D tensor operand)."""
    linear, x = seeded(nn.Linear(4, 8)), torch.randn(3, 4, dtype=torch.float64)
    w = torch.randn(2, 3, 5, dtype=torch.float64)

    def heads():
        q = linear(x).view(3, 2, 4).transpose(0, 1)
        return ((q @ q.transpose(-2, -1)) @ q).sum() + (q.transpose(-2, -1)[:, :2] @ w).sum()

    eager, batched = _eager_and_batched(heads)
    assert batched == pytest.approx(eager, abs=1e-12)


TENSOR_SURFACE = {
    "unary +": lambda h: (+h).sum(),
    "x.mH and x.H": lambda h: (h.unsqueeze(0).mH @ h.unsqueeze(0)).sum() + h.view(3, 1).H.sum(),
    "^ of masks": lambda h: (h * ((h > 0) ^ (h > 0.2))).sum(),
    "reversed()": lambda h: torch.stack(list(reversed(h.view(3, 1)))).view(3)[0] * 2,
    "grad_fn": lambda h: h.sum() * (2.0 if h.grad_fn is not None else 1.0)
    + h.detach().sum() * (2.0 if h.detach().grad_fn is None else 1.0),
}


@pytest.mark.parametrize("case", TENSOR_SURFACE)
def test_expressions_answer_the_tensor_surface_as_tensors_do(case):
    linear, x = seeded(nn.Linear(3, 3)), torch.randn(3, dtype=torch.float64)
    eager, batched = _eager_and_batched(lambda: TENSOR_SURFACE[case](linear(x)))
    assert batched == pytest.approx(eager, abs=1e-12)


def test_torch_tensor_of_expressions_is_a_new_tensor_of_their_values():
    """`torch.tensor([a, b])` of scalar scores (nested too): their values, without gradient
    history, as eagerly; `torch.as_tensor(x)` is x itself; `np.array(x)` its values."""
    linear, x = seeded(nn.Linear(3, 3)), torch.randn(3, dtype=torch.float64)
    with torch.no_grad():
        want = linear(x)
    with fb.Graph():
        h = linear(x)
        flat, nested = torch.tensor([h[0], h[2]]), torch.tensor([[h[0], 1.0], [h[1], h[2]]])
        assert type(flat) is torch.Tensor and not flat.requires_grad
        torch.testing.assert_close(flat, want[[0, 2]], rtol=0, atol=0)
        torch.testing.assert_close(nested, torch.stack([torch.stack([want[0], torch.tensor(
            1.0, dtype=torch.float64)]), want[1:]]), rtol=0, atol=0)
        assert torch.as_tensor(h) is h
        np.testing.assert_array_equal(np.array(h), want.numpy())


def test_a_one_argument_where_of_an_expression_runs_on_its_values():
    linear, x = seeded(nn.Linear(3, 3)), torch.randn(3, dtype=torch.float64)

    def positives():
        h = linear(x)
        return h[torch.where(h > 0)[0]].sum() + h.sum()

    with pytest.warns(UserWarning, match="torch.where .*depends on their values"):
        eager, batched = _eager_and_batched(positives)
    assert batched == pytest.approx(eager, abs=1e-12)


def test_making_an_expression_a_leaf_that_requires_grad_raises_naming_it():
    with fb.Graph():
        x = fb.input(torch.randn(3)) * 2.0
        assert x.detach().requires_grad_(False).shape == (3,)
        with pytest.raises(TypeError, match=r"Tensor\.requires_grad_\(True\) on a flybatch "
                                            r"expression of shape \(3,\)"):
            x.detach().requires_grad_()


def test_out_of_a_recorded_call_is_written_as_eagerly():
    """`F.normalize(..., out=buf)` writes buf (which then reads as its new value) and returns
    it; `out=` an expression, which has no storage, raises naming the function."""
    linear, x = seeded(nn.Linear(3, 3)), torch.randn(3, dtype=torch.float64)

    def into_buffer():
        buf = torch.zeros(3, dtype=torch.float64)
        with torch.no_grad():
            returned = F.normalize(linear(x), dim=0, out=buf)
            assert returned is buf
            torch.add(linear(x), 1.0, out=buf)
        return linear(x).sum() * buf.sum()

    eager, batched = _eager_and_batched(into_buffer)
    assert batched == pytest.approx(eager, abs=1e-12)
    with fb.Graph():
        h = linear(x)
        with pytest.raises(TypeError, match=r"torch\.add\(out=\.\.\.\) into a flybatch "
                                            r"expression"):
            torch.add(linear(x), 1.0, out=h)


def test_a_plain_tensor_the_graph_wrote_into_reads_its_new_values():
    # `outputs[t] = h`, the tutorials' way of collecting encoder states: the tensor's own
    # storage does not hold the expressions written into it, so every value read of it (print,
    # tolist, item, detach, iteration) must see what the graph computed, as eager torch does.
    proj = seeded(nn.Linear(3, 3))
    x0 = torch.randn(3)

    def fill():
        h = torch.zeros(2, 3)
        h[0] = proj(x0)
        h[1, :2] = proj(x0)[1:] * 2
        return h

    want = fill().detach()
    with fb.Graph():
        h = fill()
        assert h.tolist() == want.tolist()
        assert h[1, 1].item() == want[1, 1].item()
        assert h.detach().tolist() == want.tolist()
        assert [row.tolist() for row in h] == want.tolist()
        assert f"{want[0, 0].item():.4f}" in repr(h)
        assert h.size() == (2, 3) and h.dim() == 2  # what describes it runs as it is
        # and the properties the write changed: its data, and that it now requires grad
        assert h.data.tolist() == want.tolist()
        assert h.requires_grad and not h.is_leaf
    with fb.Graph(), torch.no_grad():
        h = fill()
        assert not h.requires_grad and h.is_leaf  # as eagerly: nothing of it needs a gradient


def test_a_class_index_out_of_range_raises_at_the_loss_call():
    logits = seeded(nn.Linear(IN, CLASSES))
    with fb.Graph():
        scores = logits(torch.randn(1, IN))
        with pytest.raises(IndexError,
                           match=r"F.cross_entropy: target 3 is out of bounds.*\(1, 3\)"):
            F.cross_entropy(scores, torch.tensor([CLASSES]))
        with pytest.raises(IndexError, match="F.nll_loss: target -2"):
            F.nll_loss(F.log_softmax(scores, 1), torch.tensor([-2]))
        # ignore_index is not a class, and is not out of range
        loss = F.cross_entropy(scores.expand(2, CLASSES), torch.tensor([1, -100]))
        assert loss.item() == pytest.approx(
            F.cross_entropy(scores.value().detach(), torch.tensor([1])).item(), abs=ATOL)


def test_autograd_grad_with_respect_to_an_expression_raises_a_clear_error():
    w = nn.Parameter(torch.randn(3))
    with fb.Graph():
        h = w * 2.0
        with pytest.raises(TypeError, match=r"respect to a flybatch expression \(shape \(3,\)\)"):
            torch.autograd.grad(h.sum(), h)


OUT_OF_RANGE = {
    "Tensor.gather": lambda h: h.gather(0, torch.tensor([7])),
    "Tensor.index_select": lambda h: h.index_select(0, torch.tensor([3])),
    "Tensor.__getitem__": lambda h: h[torch.tensor([0, 9])],
    "torch.take": lambda h: torch.take(h, torch.tensor([-4])),
    "Tensor.scatter": lambda h: h.scatter(0, torch.tensor([5]), torch.ones(1)),
    "Tensor.index_add": lambda h: h.index_add(0, torch.tensor([3]), torch.ones(1)),
}


@pytest.mark.parametrize("call", OUT_OF_RANGE)
def test_an_index_tensor_out_of_range_raises_at_the_call_naming_function_and_shapes(call):
    w = nn.Parameter(torch.randn(3))
    with pytest.raises((IndexError, RuntimeError)):
        OUT_OF_RANGE[call](w * 2.0)  # eagerly
    with fb.Graph():
        with pytest.raises((IndexError, RuntimeError),
                           match=rf"{re.escape(call)} on flybatch expressions of per-instance "
                                 r"shapes \[\(3,\)"):
            OUT_OF_RANGE[call](w * 2.0)


def test_a_product_of_operands_of_two_dtypes_raises_at_the_call_as_eagerly():
    w = nn.Parameter(torch.randn(3))
    counts = torch.ones(3, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.matmul(w * 2.0, counts)  # eagerly
    with fb.Graph():
        with pytest.raises(RuntimeError, match=r"torch\.matmul on flybatch expressions of "
                                               r"per-instance shapes \[\(3,\), \(3, 2\)\].*dtype"):
            torch.matmul(w * 2.0, counts)


@pytest.mark.parametrize("hook", ["register_hook", "retain_grad"])
def test_gradient_hooks_on_an_expression_raise_a_clear_error(hook):
    w = nn.Parameter(torch.randn(3))
    with fb.Graph():
        y = w * 2.0
        with pytest.raises(TypeError, match=rf"Tensor\.{hook} of a flybatch expression"):
            getattr(y, hook)(*([print] if hook == "register_hook" else []))


@pytest.mark.filterwarnings("ignore:Using a non-full backward hook")
@pytest.mark.parametrize("register", ["register_full_backward_hook",
                                      "register_full_backward_pre_hook", "register_backward_hook"])
def test_a_module_with_backward_hooks_is_refused_in_a_graph_not_silently_unhooked(register):
    linear = seeded(nn.Linear(3, 2))
    getattr(linear, register)(lambda *args: None)
    with fb.Graph():
        with pytest.raises(TypeError, match="Linear has backward hooks"):
            linear(fb.input(torch.randn(3)))
    assert linear(torch.randn(3)).shape == (2,)  # outside a graph block, as ever


def test_detach_stops_the_gradient():
    w = nn.Parameter(torch.tensor([1.0, 2.0]))
    with fb.Graph():
        x = w * 1.0
        (x.detach() * x).sum().backward()
    assert w.grad.tolist() == [1.0, 2.0]


def test_a_buffer_the_graph_wrote_into_keeps_its_gradient_history_after_the_block():
    w = nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    xs = torch.randn(4, 3)
    expected = torch.zeros(4, 3)
    for i, x in enumerate(xs):
        expected[i] = torch.tanh(w * x)
    (grad,) = torch.autograd.grad((expected ** 2).sum(), w)
    out = torch.zeros(4, 3)
    with fb.Graph():
        for i, x in enumerate(xs):
            out[i] = torch.tanh(w * x)
    assert out.requires_grad and not out.is_leaf
    (out ** 2).sum().backward()  # after the block, as an eager buffer would
    torch.testing.assert_close(out.detach(), expected.detach(), rtol=0, atol=ATOL)
    torch.testing.assert_close(w.grad, grad, rtol=0, atol=ATOL)


def test_a_block_that_raises_leaves_the_buffers_it_wrote_as_eagerly():
    w = nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    out = torch.zeros(3)
    with pytest.raises(KeyError):
        with fb.Graph():
            out.copy_(torch.tanh(w * 2.0))
            raise KeyError("the user's own error, after the write")
    torch.testing.assert_close(out.detach(), torch.tanh(w * 2.0).detach(), rtol=0, atol=ATOL)


def test_one_element_integer_tensors_are_read_at_the_call():
    """A label or a row number in a one-element tensor (`torch.tensor([label])`) is an input of
    the value it holds at the call, of its own dtype, as eagerly: a buffer written again
    afterwards changes nothing."""
    weights = nn.Parameter(torch.randn(4, 5))
    table = nn.Parameter(torch.randn(6, 5))
    label, row = torch.tensor([0]), torch.tensor([0], dtype=torch.int32)

    def losses(copy):
        out = []
        for i in range(4):
            label[0], row[0] = i % 3, 5 - i  # one buffer each, rewritten per instance
            logits = F.embedding(copy(row), table)[0] * weights[i]
            out.append(F.cross_entropy(logits.unsqueeze(0), copy(label), reduction="sum"))
        return out

    # (eager autograd keeps the target for its backward: it needs a copy per instance)
    eager = torch.stack(losses(torch.clone)).sum()
    eager.backward()
    want = (weights.grad.clone(), table.grad.clone())
    weights.grad = table.grad = None
    with fb.Graph(strategy="agenda") as g:
        total = torch.stack(losses(lambda buffer: buffer)).sum()
        assert total.item() == pytest.approx(eager.item(), abs=ATOL, rel=0)
        total.backward()
        # embedding, [0], weights[i], *, cross_entropy, stack, sum: each one launch (the
        # unsqueeze is a view, the label a constant of the loss node)
        assert g.stats().batches == 7
    torch.testing.assert_close((weights.grad, table.grad), want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("user_mode", [False, True])
def test_fresh_one_element_indices_and_targets_keep_their_own_values_and_dtypes(user_mode):
    """Made afresh at each call, under another mode of the user's too (then flybatch reads
    them with every mode off)."""
    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    scores = torch.tensor([0.5, -1.0, 2.0, 0.0])
    with (Passing() if user_mode else nullcontext()), fb.Graph() as g:
        x = fb.input(scores)
        picked = [torch.index_select(x, 0, torch.tensor([i], dtype=dtype))
                  for i, dtype in ((3, torch.int64), (1, torch.int32), (2, torch.int64))]
        losses = [F.cross_entropy(x, torch.tensor(y)) for y in (0, 2)]  # 0-d targets
        assert [p.tolist() for p in picked] == [[0.0], [-1.0], [2.0]]
        assert [loss.item() for loss in losses] == \
            pytest.approx([F.cross_entropy(scores, torch.tensor(y)).item() for y in (0, 2)])
        assert sorted(str(g.dtype_of(n)) for n in range(g.n_nodes)
                      if g.op_of(n) is INDEX_INPUT) == ["torch.int32"] + ["torch.int64"] * 4


@pytest.mark.parametrize("make", [
    lambda: torch.tensor([3]), lambda: torch.tensor([-7], device="cpu"),
    lambda: torch.tensor([2**62], dtype=torch.int64), lambda: torch.tensor([5], dtype=torch.int32),
    lambda: torch.tensor([True]), lambda: torch.tensor([3], dtype=torch.float64),
    lambda: torch.tensor([3, 4]), lambda: torch.tensor([3], requires_grad=False)],
    ids=["int", "device", "int64", "int32", "bool", "float", "two", "requires_grad"])
def test_a_one_element_tensor_made_in_a_graph_block_is_the_tensor_made_eagerly(make):
    """`torch.tensor([i])` inside a graph block (made there by a shorter path) has the value,
    dtype, shape, device and flags it has eagerly, and is a tensor of its own each time."""
    want = make()
    with fb.Graph():
        got, again = make(), make()
    assert type(got) is torch.Tensor and got is not again
    assert (got.dtype, got.shape, got.device, got.requires_grad, got.is_leaf, got.tolist()) == \
        (want.dtype, want.shape, want.device, want.requires_grad, want.is_leaf, want.tolist())
    assert got.untyped_storage().data_ptr() != again.untyped_storage().data_ptr()


def test_a_one_element_tensor_of_an_int_too_large_raises_as_eagerly():
    with pytest.raises(Exception) as eager:
        torch.tensor([2**64])
    with fb.Graph(), pytest.raises(type(eager.value), match=re.escape(str(eager.value))):
        torch.tensor([2**64])


class _RepeatedForms(nn.Module):
    """Calls repeated in one graph block with the same form and with forms differing in one
    thing each: the weight (two of one shape, parts of a stacked one), an int constant, a
    shape, an operand's dtype. Each call must get its own form's plan."""

    def __init__(self):
        super().__init__()
        self.U = nn.Parameter(torch.randn(2, 4, 4))  # stacked: U[0], U[1] are parameter parts
        self.A, self.B = nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(6, 4))
        self.b = nn.Parameter(torch.randn(6))

    def forward(self, x):
        total = x.new_zeros(())
        for k in range(3):
            h = torch.tanh(F.linear(x, self.U[k % 2]))  # parts of U, again and again
            a, b_ = F.linear(h, self.A, self.b).chunk(2, -1)  # same form, twice...
            c, d = F.linear(h, self.B, self.b).chunk(3 - k % 2, 0)[:2]  # ...another weight, int
            rows = F.linear(h, self.A).view(2, 3) if k else F.linear(h, self.A).view(3, 2)
            wide = h.float().view(2, 2).double()  # a view of an operand of its own dtype
            total = total + (a * b_).sum() + (c * d).sum() + rows.sum(0).pow(2).sum() \
                + wide.sum()
        return total


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_calls_repeated_with_one_form_or_forms_differing_in_one_thing_train_as_eagerly(strategy):
    """The graph keeps the plan of each form of a planned call (F.linear, chunk, view) and of
    each part of a parameter (`U[0]`) it met: repeated calls, and calls differing in a weight,
    an int, a shape or an operand's dtype, give eager values and gradients."""
    model = seeded(_RepeatedForms())
    check(model, model, draw(1, *[(4,)] * 5), strategy)



class _RepeatedLosses(nn.Module):
    """Class losses of each instance's scores against `torch.tensor([label])` targets, in
    every keyword form (repeated, so that the graph's plan of each form is met again): the
    reduction, ignore_index (the target itself, or another), label_smoothing, class weights,
    nll_loss of log-probabilities, a 1-D score vector."""

    def __init__(self):
        super().__init__()
        self.W = nn.Parameter(torch.randn(CLASSES, IN))
        self.register_buffer("weight", torch.rand(CLASSES, dtype=torch.float64) + 0.5)

    def forward(self, x):
        scores = F.linear(x, self.W)
        rows = scores.unsqueeze(0)
        total = x.new_zeros(())
        for label in (0, CLASSES - 1, 1):
            target = torch.tensor([label])
            total = total + F.cross_entropy(rows, target, reduction="sum") \
                + F.cross_entropy(rows, torch.tensor([label])) \
                + F.cross_entropy(rows, target, ignore_index=label, reduction="sum") \
                + F.cross_entropy(rows, target, ignore_index=CLASSES + 5, reduction="mean") \
                + F.cross_entropy(rows, target, label_smoothing=0.25) \
                + F.cross_entropy(rows, target, weight=self.weight) \
                + F.nll_loss(F.log_softmax(rows, 1), target, reduction="sum") \
                + F.cross_entropy(scores, torch.tensor(label))
        return total


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_class_losses_repeated_in_every_keyword_form_train_as_eagerly(strategy):
    """The graph keeps the plan of each keyword form of F.cross_entropy / F.nll_loss with a
    `torch.tensor([label])` target: repeated calls give eager values and gradients, and the
    nodes the generic path (the handler) gives."""
    model = seeded(_RepeatedLosses())
    items = draw(2, *[(IN,)] * 4)
    _, fast = check(model, model, items, strategy)
    planned = {f: capture._PLANNED.pop(f) for f in (F.cross_entropy, F.nll_loss)}
    try:
        generic = run_batched(model, model, items, strategy)
    finally:
        capture._PLANNED.update(planned)
    assert fast.stats.nodes == generic.stats.nodes
    assert_same_training(generic, fast)


def test_a_target_out_of_range_raises_in_a_form_met_before():
    """The target of a form whose plan the graph keeps is checked at every call."""
    W = nn.Parameter(torch.randn(CLASSES, IN))
    with fb.Graph():
        rows = F.linear(torch.randn(IN), W).unsqueeze(0)
        for label in (0, 1):
            F.cross_entropy(rows, torch.tensor([label]), reduction="sum")
        with pytest.raises(IndexError, match=r"F.cross_entropy: target 3 is out of bounds"):
            F.cross_entropy(rows, torch.tensor([CLASSES]), reduction="sum")
        with pytest.raises(IndexError, match=r"F.cross_entropy: target -1 is out of bounds"):
            F.cross_entropy(rows, torch.tensor([-1]), reduction="sum", ignore_index=CLASSES)
        F.cross_entropy(rows, torch.tensor([CLASSES]), reduction="sum", ignore_index=CLASSES)

def test_a_parameter_part_read_again_after_requires_grad_is_switched_off_runs_eagerly():
    """`U[0]` is one node per graph while U requires grad; once U's requires_grad is switched
    off in the block, `U[0]` is the plain tensor eager torch gives."""
    U = nn.Parameter(torch.randn(2, 3, 3))
    with fb.Graph():
        first, again = U[0], U[0]
        assert isinstance(first, fb.Expression) and again.id == first.id
        U.requires_grad_(False)
        plain = U[0]
        U.requires_grad_(True)
    assert type(plain) is torch.Tensor
    torch.testing.assert_close(plain, U.detach()[0], rtol=0, atol=0)


@pytest.mark.parametrize("sparse", [False, True])
def test_an_embedding_of_a_one_element_index_is_a_row_lookup(sparse):
    """`F.embedding(torch.tensor([word]), E)` (or of a 0-d index) reads its row as `fb.lookup`
    does: the rows of every instance in one launch, with the gradient eager torch gives; under
    no_grad none, and a row outside the table raises as eagerly."""
    table = nn.Parameter(torch.randn(6, 5))
    words = [3, 0, 5, 3]

    def loss_of(word):
        row = F.embedding(torch.tensor([word]), table, sparse=sparse)
        with torch.no_grad():
            frozen = F.embedding(torch.tensor([(word + 1) % 6]), table, sparse=sparse)
        scalar = F.embedding(torch.tensor(word), table, sparse=sparse)
        return (row[0].tanh() * frozen[0]).sum() + scalar.sum()

    eager = torch.stack([loss_of(w) for w in words]).sum()
    eager.backward()
    want, table.grad = table.grad, None
    with fb.Graph(strategy="agenda") as g:
        row = F.embedding(torch.tensor([1]), table, sparse=sparse)
        assert row.shape == (1, 5) and row.requires_grad
        with pytest.raises(IndexError, match="out of range"):
            F.embedding(torch.tensor([6]), table, sparse=sparse)
        total = torch.stack([loss_of(w) for w in words]).sum()
        assert total.item() == pytest.approx(eager.item(), abs=ATOL, rel=0)
        total.backward()
        # the [1]-shaped rows, the frozen ones and the 0-d ones (one launch each: signatures
        # of their own); [0] of both kinds in one, tanh, *, sum, +; stack, sum
        assert g.stats().batches == 3 + 5 + 2
    assert table.grad.is_sparse == sparse
    torch.testing.assert_close(table.grad.to_dense(), want.to_dense(), rtol=0, atol=ATOL)


def test_an_embedding_of_a_table_that_stops_requiring_grad_is_eager_again():
    table = nn.Parameter(torch.randn(6, 5))
    with fb.Graph():
        first = F.embedding(torch.tensor([2]), table)
        assert isinstance(first, fb.Expression)
        table.requires_grad_(False)
        plain = F.embedding(torch.tensor([2]), table)
        table.requires_grad_(True)
        again = F.embedding(torch.tensor([2]), table)
    assert type(plain) is torch.Tensor
    torch.testing.assert_close(plain, table.detach()[2:3], rtol=0, atol=0)
    assert isinstance(again, fb.Expression)


def test_a_row_lookup_is_one_kind_of_node_whichever_path_records_it():
    """The compiled core takes `F.embedding(torch.tensor([word]), E)` itself, the handler takes
    it while the graph writes into a tensor: the same lookup node, so their rows batch."""
    table = nn.Parameter(torch.randn(6, 5))
    with fb.Graph() as g:
        first = F.embedding(torch.tensor([1]), table)
        written = torch.zeros(2)
        written[0] = first[0, 0]  # the graph writes into `written` (Graph.shadows)
        second = F.embedding(torch.tensor([4]), table)
        g.forward([first, second])
        lookups = [n for s, n in g.launches if "lookup" in fb.signatures.describe(s, g)]
        assert lookups == [2]
        torch.testing.assert_close(second.value(), table.detach()[[4]], rtol=0, atol=0)


def test_a_sparse_embedding_gets_the_sparse_gradient_eager_torch_gives():
    embedding = seeded(nn.Embedding(10, IN, sparse=True))
    sentences = [[1, 2, 2], [7], [3, 1]]

    def loss_of(words):
        return embedding(torch.tensor(words)).tanh().sum()

    eager = run_eager(embedding, loss_of, sentences)
    batched = run_batched(embedding, loss_of, sentences, "agenda")
    assert batched.grads["weight"].is_sparse
    torch.testing.assert_close(batched.grads["weight"].to_dense(),
                               eager.grads["weight"].to_dense(), rtol=0, atol=ATOL)


def test_the_capture_modes_torch_function_is_called_as_a_python_method_would_be():
    # `_Capture.__torch_function__` is C (capture.cpp): by position as torch calls it, by name,
    # with the defaults, and a wrong call a TypeError, as with the Python method it replaced.
    from flybatch import capture

    mode, E = capture._Capture(), nn.Parameter(torch.randn(4, 3))
    one = torch.ones(3)
    assert torch.equal(mode.__torch_function__(torch.add, (), (one, one)), one * 2)
    assert torch.equal(capture._Capture.__torch_function__(mode, torch.add, (), (one,),
                                                           {"other": one}), one * 2)
    assert torch.equal(mode.__torch_function__(func=torch.ones, types=(), args=(3,)), one)
    with fb.Graph():  # a parameter among the arguments: recorded, by name too
        row = mode.__torch_function__(torch.Tensor.__getitem__, types=(), args=(E, 1))
        assert isinstance(row, fb.Expression)
        value = row.value()
    assert torch.equal(value, E[1].detach())
    for bad in (lambda: mode.__torch_function__(torch.add),
                lambda: mode.__torch_function__(torch.add, (), x=1),
                lambda: mode.__torch_function__(torch.add, (), (), None, 5),
                lambda: mode.__torch_function__(torch.add, (), (), func=torch.add),
                lambda: mode.__torch_function__(torch.add, (), (), [])):
        with pytest.raises(TypeError):
            bad()


def test_a_generic_call_whose_vmap_rule_is_wrong_runs_per_instance():
    # torch.vmap's rule for index_select with a 0-d index returns the whole row: the output
    # shape, not that of the call (known from meta tensors), says not to trust it.
    rows = [torch.arange(5.0) * k for k in range(1, 4)]
    with fb.Graph():
        picked = [torch.index_select(fb.input(r) * 1.0, 0, torch.tensor(k)) for k, r in
                  enumerate(rows)]
        got = [p.value() for p in picked]
    for k, (r, p) in enumerate(zip(rows, got)):
        assert torch.equal(p, torch.index_select(r, 0, torch.tensor(k)))


def test_a_view_taken_before_the_graph_wrote_into_its_tensor_raises_instead_of_reading_stale():
    # `row = out[1]` shares out's storage, which does not hold what the graph writes into out
    # afterwards: eagerly `row` would show the write, so any use of it is refused.
    proj = seeded(nn.Linear(3, 3))
    with fb.Graph():
        out = torch.zeros(2, 3)
        row = out[1]
        out[1] = proj(torch.ones(3))
        for use in (lambda: torch.tanh(row), lambda: row.tolist(), lambda: row * 2,
                    lambda: proj(row)):
            with pytest.raises(RuntimeError, match=r"view of shape \(3,\).*before the graph"):
                use()
        assert out[1].tolist() == proj(torch.ones(3)).tolist()  # taken after: the new values


def _indexed_by_computed_indices(W, x):
    values, indices = (x * W[0]).topk(2)  # indices: a 0-d int64 expression each
    first, second = indices[0], indices[1]
    return (values * x[first]).sum() + W[first].sum() + W[:, second].sum() + W[1, first] \
        + x[-second - 1] + W[torch.tensor(3)].sum()


@pytest.mark.parametrize("strategy", ["depth", "auto"])
def test_an_index_computed_per_instance_selects_as_eagerly_batched_without_value_requests(
        strategy):
    W = torch.nn.Parameter(torch.randn(5, 4, dtype=torch.float64))
    xs = [torch.randn(4, dtype=torch.float64) for _ in range(4)]
    expected = [_indexed_by_computed_indices(W, x) for x in xs]
    sum(expected).backward()
    grad, W.grad = W.grad.clone(), None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "runs on the values" fallback
        with fb.Graph(strategy=strategy) as g:
            got = [_indexed_by_computed_indices(W, x) for x in xs]
            sum(got).backward()
            assert [t.item() for t in got] == pytest.approx([t.item() for t in expected],
                                                             rel=1e-12)
            assert g.forwards == 1
    torch.testing.assert_close(W.grad, grad)
