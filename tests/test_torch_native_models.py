"""A zoo of per-instance PyTorch models, unchanged, batched: each trains inside `fb.Graph` as it
trains eagerly.

Every model is written as PyTorch users write it for batch size one (`nn.Module`s, `torch.cat`,
`F.log_softmax(dim=1)`, loss modules, recursion, `.item()` / `.topk()` control flow, `[1, n]`
rows) in float64 with no `dtype=` anywhere. Each runs eagerly, one instance at a time, and inside
`fb.Graph(strategy=s)` (`fb.map_batched` where control flow reads values) under depth, agenda
and auto: the loss and every parameter's gradient agree to 1e-9, the `state_dict` keeps its
keys, and the graph launches a fraction of the ops eager torch runs. The tests after the zoo
hold what the zoo found: state a model writes into (buffers, running statistics, preallocated
outputs) and random sampling.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

import flybatch as fb
from native import assert_same_training, check, draw, run_batched, run_eager, seeded

H = 5
pytestmark = pytest.mark.usefixtures("one_thread", "float64_default")


@pytest.fixture(scope="module")
def float64_default():
    default = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    yield
    torch.set_default_dtype(default)


F64 = torch.float64  # the zoo's data is made at import, before the float64 default


def sequences(seed: int = 11, lengths=(3, 1, 4, 2)) -> list[torch.Tensor]:
    return draw(seed, *[(n, 4) for n in lengths])


def label(k: int) -> torch.Tensor:
    return torch.tensor([k % 3])


# ---- sequence to sequence ---------------------------------------------------------------------
class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.rnn = nn.Embedding(9, H), nn.GRU(H, H, batch_first=True)

    def forward(self, ids):
        out, h = self.rnn(self.emb(ids).unsqueeze(0))
        return out[0], h


class AttnDecoder(nn.Module):
    """Dot-product attention over the encoder's outputs, a GRU cell, an output layer."""

    def __init__(self):
        super().__init__()
        self.emb, self.cell = nn.Embedding(9, H), nn.GRUCell(2 * H, H)
        self.out = nn.Linear(2 * H, 9)

    def forward(self, y, h, enc):
        weights = F.softmax(torch.mm(h, enc.t()), dim=1)           # [1, source length]
        context = torch.mm(weights, enc)                            # [1, H]
        h = self.cell(torch.cat([self.emb(y), context], dim=1), h)
        return F.log_softmax(self.out(torch.cat([h, context], 1)), dim=1), h


class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.dec = Encoder(), AttnDecoder()

    def loss(self, pair, teacher_forcing: bool):
        source, target = pair
        enc, h = self.enc(torch.tensor(source))
        h, y, loss, criterion = h[0], torch.tensor([0]), 0, nn.NLLLoss()
        for word in target:
            log_probs, h = self.dec(y, h, enc)
            loss = loss + criterion(log_probs, torch.tensor([word]))
            if teacher_forcing:
                y = torch.tensor([word])
            else:
                _, top = log_probs.topk(1)
                y = top.squeeze(0).detach()
                if y.item() == 1:  # EOS
                    break
        return loss


PAIRS = [([2, 3, 4], [5, 6, 1]), ([3], [2, 2, 2, 7, 1]), ([6, 5, 4, 3, 2], [3, 1]),
         ([4, 4], [6, 5, 4, 1])]


class Pointer(nn.Module):
    """A pointer network ordering points by their first coordinate."""

    def __init__(self):
        super().__init__()
        self.enc, self.dec = nn.LSTM(2, H), nn.LSTMCell(2, H)
        self.W1, self.W2 = nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False)
        self.v = nn.Linear(H, 1, bias=False)

    def forward(self, points, order):
        enc, (h, c) = self.enc(points.unsqueeze(1))
        enc, h, c = enc.squeeze(1), h[0], c[0]
        x, loss = torch.zeros(1, 2), 0
        for t in order:
            h, c = self.dec(x, (h, c))
            scores = self.v(torch.tanh(self.W1(enc) + self.W2(h))).squeeze(-1)
            loss = loss - F.log_softmax(scores, dim=0)[t]
            x = points[t].unsqueeze(0)
        return loss


def point_sets():
    return [(p, torch.argsort(p[:, 0]).tolist()) for p in draw(3, (3, 2), (5, 2), (2, 2), (4, 2))]


# ---- words, trees, graphs ---------------------------------------------------------------------
class Highway(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.gate, self.h = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        t = torch.sigmoid(self.gate(x))
        return t * F.relu(self.h(x)) + (1 - t) * x


class CharCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.conv = nn.Embedding(12, 4), nn.Conv1d(4, 6, 3, padding=1)
        self.highways, self.out = nn.ModuleList([Highway(6), Highway(6)]), nn.Linear(6, 3)

    def forward(self, chars):
        h = torch.tanh(self.conv(self.emb(chars).t().unsqueeze(0))).squeeze(0)  # [6, n]
        h = h.max(1)[0]
        for highway in self.highways:
            h = highway(h)
        return self.out(h).unsqueeze(0)


WORDS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11, 1, 2], [3, 3]]


class TreeGRU(nn.Module):
    """N-ary trees, a composition per arity (nn.ModuleList), recursion over children."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, H)
        self.compose = nn.ModuleList([nn.Linear(k * H, H) for k in (1, 2, 3)])
        self.gate = nn.ModuleList([nn.Linear(k * H, H) for k in (1, 2, 3)])
        self.out = nn.Linear(H, 3)

    def forward(self, tree):
        if isinstance(tree, int):
            return torch.tanh(self.emb(torch.tensor([tree])))
        hs = [self(child) for child in tree]
        x = torch.cat(hs, dim=1)
        z = torch.sigmoid(self.gate[len(hs) - 1](x))
        return z * torch.tanh(self.compose[len(hs) - 1](x)) + (1 - z) * torch.stack(hs).mean(0)


TREES = [(1, 2), (1, (2, 3, 4)), ((5,), 6, (7, 8)), 9, ((1, 2), (3, 4))]


class MessagePassing(nn.Module):
    """A GNN over one graph per instance: index_select / gather messages, sum them into a fresh
    zeros accumulator, a GRU update."""

    def __init__(self, scatter: bool):
        super().__init__()
        self.scatter = scatter
        self.inp, self.msg = nn.Linear(3, H), nn.Linear(H, H)
        self.update, self.out = nn.GRUCell(H, H), nn.Linear(H, 1)

    def forward(self, x, src, dst):
        h = self.inp(x)
        for _ in range(2):
            if self.scatter:
                index = dst.unsqueeze(1).expand(-1, H)
                agg = torch.zeros(x.size(0), H).scatter_add(0, index, self.msg(h)[src])
                degree = torch.zeros(x.size(0)).index_add_(0, dst, torch.ones(len(dst)))
                agg = agg / degree.clamp(min=1).unsqueeze(1)
            else:
                agg = torch.zeros(x.size(0), H).index_add(0, dst, self.msg(h).index_select(0, src))
            h = self.update(agg, h)
        return self.out(h).sum()


def graphs():
    edges = [[(0, 1), (1, 2)], [(0, 1), (1, 2), (2, 3), (3, 0)], [(0, 1), (1, 0)], [(2, 0), (1, 0)]]
    xs = draw(5, (3, 3), (4, 3), (2, 3), (3, 3))
    return [(x, torch.tensor([a for a, _ in e]), torch.tensor([b for _, b in e]))
            for x, e in zip(xs, edges)]


class GCN(nn.Module):
    """Kipf & Welling's GCN over one graph per instance, its normalised adjacency a sparse
    tensor (`torch.sparse.mm(adj, h)`, `adj @ h`)."""

    def __init__(self):
        super().__init__()
        self.gc1, self.gc2 = nn.Linear(3, H), nn.Linear(H, 3)

    def forward(self, x, adj):
        h = F.relu(torch.sparse.mm(adj, self.gc1(x)))
        return (adj @ self.gc2(h)).mean(0, keepdim=True)


def sparse_adjacencies():
    """Each graph of `graphs()` with its normalised adjacency D^-1/2 (A + I) D^-1/2 as a sparse
    COO tensor."""
    items = []
    for x, src, dst in graphs():
        n = x.size(0)
        a = torch.eye(n, dtype=F64).index_put((dst, src), torch.ones(len(src), dtype=F64))
        d = a.sum(1).rsqrt()
        items.append((x, (d.unsqueeze(1) * a * d).to_sparse()))
    return items


# ---- functions and losses ---------------------------------------------------------------------
class Functions(nn.Module):
    """[1, n] rows through a grab bag of torch functions."""

    def __init__(self):
        super().__init__()
        self.bilinear, self.prelu, self.lin = nn.Bilinear(4, 4, 3), nn.PReLU(), nn.Linear(4, 4)

    def forward(self, x, y):
        z = self.prelu(self.bilinear(x, y)) + F.gelu(self.lin(x))[:, :3]
        z = F.pad(F.normalize(z, dim=1), (1, 2))                       # [1, 6]
        z = torch.where(z > 0, z, 0.1 * z).masked_fill(z.abs() < 0.01, 0.0)
        w = torch.einsum("bi,bj->ij", z, z)                            # [6, 6]
        g = w.gather(1, torch.tensor([[0], [2], [1], [5], [4], [3]]))  # [6, 1]
        c = torch.cumsum(g.clamp(-0.5, 0.5), dim=0).flip(0)
        one_hot = F.one_hot(torch.tensor([2]), 6).to(x.dtype)
        return ((c.t() * one_hot).sum() + torch.bmm(z.unsqueeze(0), w.unsqueeze(0)).sum()
                + (x * y).sum(dim=1).mean()) ** 2


class Rows(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.norm, self.l2 = nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x, y):
        z = self.l2(F.elu(self.norm(self.l1(x))))
        return (torch.logsumexp(z, dim=1) - z[:, 0] + F.softplus(z).sum(1) + z.std(dim=1)
                + z.var(1, unbiased=False)).sum()


class Reductions(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x):
        z = self.lin(x)
        values, _ = z.topk(2, dim=1)
        ordered, _ = torch.sort(z, dim=1, descending=True)
        return (values.sum() + ordered[:, :3].mean() + z.amax(0).sum() + z.norm(dim=1).sum()
                + z.prod(1).sum() + torch.max(z))


class Shapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.W = nn.Parameter(torch.randn(2, 4, 3))

    def forward(self, x):
        y = torch.matmul(x.unsqueeze(0), self.W)                       # [2, n, 3]
        y = y.permute(1, 0, 2).contiguous().view(x.size(0), -1)        # [n, 6]
        z = y.repeat(1, 2)[:, ::2]
        return torch.diagonal(z @ z.t()).sum() + z.unsqueeze(-1).expand(-1, -1, 2).sum()


class Losses(nn.Module):
    def __init__(self):
        super().__init__()
        self.classify, self.regress = nn.Linear(4, 5), nn.Linear(4, 1)
        self.ce = nn.CrossEntropyLoss(weight=torch.tensor([1., 2., .5, 1., 3.]), ignore_index=-100,
                                      label_smoothing=0.1)

    def forward(self, x, gold, t):
        logits, r = self.classify(x), self.regress(x).squeeze(1)
        return (self.ce(logits, gold)
                + F.kl_div(F.log_softmax(logits, 1), t / t.sum(1, keepdim=True),
                           reduction="batchmean")
                + F.smooth_l1_loss(r, t[:, 0])
                + F.margin_ranking_loss(r, r.flip(0).detach() * 0.5, torch.tensor([1., -1., 1.]),
                                        margin=0.1)
                + F.binary_cross_entropy_with_logits(logits, (t > 0.5).to(t.dtype),
                                                     pos_weight=torch.full((5,), 2.0))
                + nn.MSELoss()(r, t[:, 1]))


def loss_items():
    gen = torch.Generator().manual_seed(8)
    return [(torch.randn(3, 4, generator=gen, dtype=F64),
             torch.tensor([k % 5, 2, -100 if k % 2 else 1]),
             torch.rand(3, 5, generator=gen, dtype=F64)) for k in range(5)]


class Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))

    def forward(self, a, p, n):
        ea, ep, en = self.enc(a), self.enc(p), self.enc(n)
        return (F.triplet_margin_loss(ea, ep, en, margin=0.5)
                + (1 - F.cosine_similarity(ea, ep)).mean() + F.pairwise_distance(ea, en).sum()
                + F.hinge_embedding_loss(torch.cdist(ea, en), -torch.ones(1, 1)))


class Reparameterized(nn.Module):
    """A VAE's loss with the noise given (its sampling: test_randn_like_draws_per_instance)."""

    def __init__(self):
        super().__init__()
        self.enc, self.dec = nn.Linear(4, 4), nn.Linear(2, 4)

    def forward(self, x, eps):
        mu, logvar = self.enc(x).chunk(2, dim=-1)
        reconstruction = torch.sigmoid(self.dec(mu + torch.exp(0.5 * logvar) * eps))
        kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
        return F.binary_cross_entropy(reconstruction, torch.sigmoid(x), reduction="sum") + kld


# ---- structured prediction with value-dependent control flow ------------------------------------
class CRF(nn.Module):
    def __init__(self):
        super().__init__()
        self.emit, self.trans = nn.Linear(4, 3), nn.Parameter(torch.randn(3, 3))

    def forward(self, x, tags):
        """The negative log-likelihood of `tags`: the forward algorithm, logsumexp over
        transitions."""
        e = self.emit(x)
        alpha = e[0]
        for t in range(1, x.size(0)):
            alpha = torch.logsumexp(alpha.unsqueeze(1) + self.trans, dim=0) + e[t]
        gold = e[torch.arange(len(tags)), tags].sum() + self.trans[tags[:-1], tags[1:]].sum()
        return torch.logsumexp(alpha, 0) - gold

    def viterbi_loss(self, x, tags):
        """Viterbi decoding, the path read back with `.item()`: a structured hinge loss."""
        e = self.emit(x)
        score, pointers = e[0], []
        for t in range(1, x.size(0)):
            best, where = (score.unsqueeze(1) + self.trans).max(0)
            pointers.append(where)
            score = best + e[t]
        tag = score.argmax().item()
        path = [tag]
        for where in reversed(pointers):
            tag = where[tag].item()
            path.append(tag)
        path.reverse()
        return score.max() - e[torch.arange(len(path)), torch.tensor(path)].sum() * 0.5


def tagged():
    gen = torch.Generator().manual_seed(14)
    return [(torch.randn(n, 4, generator=gen, dtype=F64), torch.randint(0, 3, (n,), generator=gen))
            for n in (3, 1, 4, 2, 3)]


class EasyFirst(nn.Module):
    """Merges the best-scoring adjacent pair first (argmax), until one node is left."""

    def __init__(self):
        super().__init__()
        self.emb, self.compose = nn.Embedding(10, H), nn.Linear(2 * H, H)
        self.score = nn.Linear(2 * H, 1)

    def forward(self, words):
        nodes, total = [self.emb(torch.tensor([w])) for w in words], 0
        while len(nodes) > 1:
            scores = torch.cat([self.score(torch.cat([a, b], 1))
                                for a, b in zip(nodes, nodes[1:])], 0).squeeze(1)
            k = int(scores.argmax())
            total = total + F.log_softmax(scores, 0)[k]
            merged = torch.tanh(self.compose(torch.cat([nodes[k], nodes[k + 1]], 1)))
            nodes = nodes[:k] + [merged] + nodes[k + 2:]
        return -total + nodes[0].pow(2).sum()


class DecodeThenTrain(nn.Module):
    """Greedy decoding under torch.no_grad() picks how many steps to train on."""

    def __init__(self):
        super().__init__()
        self.emb, self.cell, self.out = nn.Embedding(3, 3), nn.GRUCell(3, 4), nn.Linear(4, 3)

    def forward(self, h):
        with torch.no_grad():
            y, steps, state = torch.tensor([0]), 0, h
            while steps < 5:
                state = self.cell(self.emb(y), state)
                y, steps = self.out(state).argmax(dim=1), steps + 1
                if y.item() == 2:
                    break
        loss, y = 0, torch.tensor([0])
        for t in range(steps):
            h = self.cell(self.emb(y), h)
            loss = loss + F.cross_entropy(self.out(h), label(t))
        return loss


class TutorialSeq2Seq(nn.Module):
    """The PyTorch tutorial's training step: the encoder run token by token into a
    preallocated `encoder_outputs`, teacher forcing decided by `random.random()`, `loss +=
    criterion(...)` with `NLLLoss(reduction='sum', ignore_index=...)`, plus a label-smoothed
    term, greedy decoding with `topk` and an EOS break."""

    def __init__(self, max_length=6):
        super().__init__()
        self.enc_emb, self.enc = nn.Embedding(9, H), nn.GRU(H, H)
        self.emb, self.attn = nn.Embedding(9, H), nn.Linear(2 * H, max_length)
        self.combine, self.dec, self.out = nn.Linear(2 * H, H), nn.GRU(H, H), nn.Linear(H, 9)
        self.criterion, self.max_length = nn.NLLLoss(reduction="sum", ignore_index=7), max_length

    def forward(self, item):
        seed, (source, target) = item
        teacher_forcing = random.Random(seed).random() < 0.5
        hidden, outputs = torch.zeros(1, 1, H), torch.zeros(self.max_length, H)
        for i, word in enumerate(source):
            output, hidden = self.enc(self.enc_emb(torch.tensor([word])).view(1, 1, -1), hidden)
            outputs[i] = output[0, 0]
        y, loss = torch.tensor([[0]]), 0
        for word in target:
            embedded = self.emb(y).view(1, 1, -1)
            weights = F.softmax(self.attn(torch.cat((embedded[0], hidden[0]), 1)), dim=1)
            applied = torch.bmm(weights.unsqueeze(0), outputs.unsqueeze(0))
            x = F.relu(self.combine(torch.cat((embedded[0], applied[0]), 1)).unsqueeze(0))
            output, hidden = self.dec(x, hidden)
            log_probs = F.log_softmax(self.out(output[0]), dim=1)
            loss += self.criterion(log_probs, torch.tensor([word]))
            loss = loss + 0.1 * F.cross_entropy(log_probs, torch.tensor([word]),
                                                label_smoothing=0.1)
            if teacher_forcing:
                y = torch.tensor([word])
            else:
                y = log_probs.topk(1)[1].squeeze().detach()
                if y.item() == 1:
                    break
        return loss


class PointerBeam(nn.Module):
    """A pointer network decoding by beam search: Python lists of (score, state) hypotheses,
    visited points masked with `masked_fill(mask, -inf)`, `topk` of each hypothesis."""

    def __init__(self):
        super().__init__()
        self.enc, self.cell = nn.GRU(2, H), nn.GRUCell(2, H)
        self.Wq, self.Wk, self.v = nn.Linear(H, H), nn.Linear(H, H, bias=False), nn.Linear(H, 1)

    def log_probs(self, enc, h, visited):
        mask = torch.zeros(enc.size(0), dtype=torch.bool)
        mask[visited] = True
        scores = self.v(torch.tanh(self.Wk(enc) + self.Wq(h))).squeeze(-1)
        return F.log_softmax(scores.masked_fill(mask, float("-inf")), dim=-1)

    def forward(self, points, beam=2):
        enc, h = self.enc(points.unsqueeze(1))
        hypotheses = [(0.0, torch.zeros(1, 2), h[0], [], 0)]
        for _ in range(points.size(0)):
            extended = []
            for score, x, h, visited, log_likelihood in hypotheses:
                h = self.cell(x, h)
                log_probs = self.log_probs(enc.squeeze(1), h, visited)
                values, indices = log_probs.topk(min(beam, points.size(0) - len(visited)))
                for v, i in zip(values.tolist(), indices.tolist()):
                    extended.append((score + v, points[i:i + 1], h, visited + [i],
                                     log_likelihood + log_probs[i]))
            hypotheses = sorted(extended, key=lambda hypothesis: -hypothesis[0])[:beam]
        return -hypotheses[0][4]


class PlanarFlow(nn.Module):
    """A per-instance linear map and a planar flow: `torch.linalg.slogdet`, `solve`, `inv`,
    a Normal's `log_prob`."""

    def __init__(self):
        super().__init__()
        self.A, self.u, self.w = nn.Linear(3, 9), nn.Parameter(torch.randn(3)), nn.Linear(3, 1)

    def forward(self, context, z):
        M = self.A(context).view(3, 3) + 3 * torch.eye(3)
        _, log_det = torch.linalg.slogdet(M)
        z = M @ z
        a = torch.tanh(self.w(z))
        z = z + self.u * a
        psi = (1 - a ** 2) * self.w.weight[0]
        log_det = log_det + torch.log(torch.abs(1 + torch.dot(self.u, psi)))
        prior = torch.distributions.Normal(torch.zeros(3), torch.ones(3))
        return -(prior.log_prob(z).sum() + log_det) + torch.linalg.solve(M, z).pow(2).sum() \
            + torch.linalg.inv(M).sum()


class GraphLayers(nn.Module):
    """A GNN of residual layers (`nn.ModuleList`, GELU, LayerNorm) summing messages into fresh
    zeros in place, `index_add_` and `scatter_add_`."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(3, H), nn.Linear(H, 3)
        self.msgs = nn.ModuleList([nn.Linear(H, H) for _ in range(2)])
        self.norms = nn.ModuleList([nn.LayerNorm(H) for _ in range(2)])

    def forward(self, x, src, dst):
        h = self.inp(x)
        for k, (msg, norm) in enumerate(zip(self.msgs, self.norms)):
            agg = torch.zeros(x.size(0), H)
            if k == 0:
                agg.index_add_(0, dst, msg(h)[src])
            else:
                agg.scatter_add_(0, dst.unsqueeze(-1).expand(-1, H), msg(h).index_select(0, src))
            h = norm(h + F.gelu(agg))
        return self.out(h.mean(0, keepdim=True))


# ---- recurrent and attention layers -----------------------------------------------------------
class BiGRU(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(4, H, num_layers=2, bidirectional=True, batch_first=True)
        self.h0, self.out = nn.Parameter(torch.zeros(4, 1, H)), nn.Linear(2 * H, 3)

    def forward(self, x):
        out, _ = self.rnn(x.unsqueeze(0), self.h0)
        return self.out(out[:, -1, :])


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.dec = nn.Embedding(10, H), nn.LSTM(H, H), nn.Linear(H, 10)
        self.dec.weight = self.emb.weight

    def forward(self, ids):
        out, _ = self.rnn(self.emb(ids[:-1]).unsqueeze(1))
        return F.cross_entropy(self.dec(out.squeeze(1)), ids[1:])


class RowByRow(nn.Module):
    """Iterates a sentence's LSTM states as a tensor iterates (`for h_t in out:`): the mean of
    the rows classified, plus the sum of a score of each row."""

    def __init__(self):
        super().__init__()
        self.rnn, self.score, self.out = nn.LSTM(4, H), nn.Linear(H, 1), nn.Linear(H, 3)

    def forward(self, x):
        out, _ = self.rnn(x.unsqueeze(1))
        scored = [self.score(h_t[0]) for h_t in out]
        return self.out(torch.stack([h_t[0] for h_t in out]).mean(0, keepdim=True)) + \
            torch.stack(scored).sum()


class PackedGRU(nn.Module):
    """nn.utils.rnn's packing, on a batch of one sequence, around a two-layer bidirectional
    GRU."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(10, 4), nn.Linear(2 * H, 3)
        self.rnn = nn.GRU(4, H, num_layers=2, bidirectional=True, batch_first=True)

    def forward(self, ids):
        packed = nn.utils.rnn.pack_sequence([self.emb(ids)])
        out, h = self.rnn(packed)
        padded, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=6)
        return self.out(padded.sum(1)) + self.out(torch.cat([h[-2], h[-1]], 1))


class CausalDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer, self.out = nn.TransformerDecoderLayer(4, 2, 8, dropout=0.0), nn.Linear(4, 3)

    def forward(self, target, memory):
        mask = nn.Transformer.generate_square_subsequent_mask(target.size(0))
        return self.out(self.layer(target.unsqueeze(1), memory.unsqueeze(1),
                                   tgt_mask=mask).squeeze(1))


class MaskedAttention(nn.Module):
    """Attention over a sentence zero-padded to 6 positions, the padding masked with -inf."""

    def __init__(self):
        super().__init__()
        self.q, self.out = nn.Parameter(torch.randn(4)), nn.Linear(4, 3)

    def forward(self, x):
        padded = F.pad(x, (0, 0, 0, 6 - x.size(0)))
        mask = torch.arange(6).unsqueeze(0) >= x.size(0)
        weights = (padded @ self.q).unsqueeze(0).masked_fill(mask, float("-inf")).softmax(-1)
        return self.out(weights @ padded)


class TinyCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3)
        self.out = nn.Linear(12, 3)

    def forward(self, image):
        x = F.max_pool2d(F.relu(self.norm(self.conv(image.unsqueeze(0).unsqueeze(0)))), 2)
        return self.out(torch.flatten(F.adaptive_avg_pool2d(x, 2), 1))


class BagOfChars(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, mode="mean")
        self.norm_capped = nn.Embedding(10, 4, max_norm=1.0)
        self.out = nn.Linear(4, 3)

    def forward(self, ids):
        return self.out(self.bag(ids.unsqueeze(0)) + self.norm_capped(ids).sum(0, keepdim=True))


class Recurrences(nn.Module):
    """`acc += ...` into fresh zeros, truncated backpropagation (`.detach()`), `.new_zeros`,
    a branch on `.requires_grad`, a preallocated output written step by step."""

    def __init__(self):
        super().__init__()
        self.lin, self.cell, self.out = nn.Linear(4, H), nn.RNNCell(4, H), nn.Linear(H, 1)

    def forward(self, x):
        acc, h = torch.zeros(1, H), torch.zeros(1, H)
        outputs = torch.zeros(x.size(0), H)
        for t in range(x.size(0)):
            acc += torch.tanh(self.lin(x[t:t + 1]))
            if t == 2:
                h = h.detach()
            h = self.cell(x[t:t + 1], h)
            outputs[t] = h[0]
        z = acc.new_zeros(1, H) + acc
        if z.requires_grad:
            z = z * 2
        return z.sum() + self.out(outputs).sum() + outputs.sum()


class ConvNorms(nn.Module):
    """A convolution over a [1, 4, n] sentence, GroupNorm and InstanceNorm, two poolings."""

    def __init__(self):
        super().__init__()
        self.conv, self.out = nn.Conv1d(4, 6, 2), nn.Linear(12, 3)
        self.group, self.instance = nn.GroupNorm(2, 6), nn.InstanceNorm1d(6, affine=True)

    def forward(self, x):
        h = self.conv(F.pad(x.t().unsqueeze(0), (1, 1)))
        h = self.instance(self.group(F.leaky_relu(h)))
        pooled = [F.adaptive_max_pool1d(h, 1), F.avg_pool1d(h, h.size(-1))]
        return self.out(torch.cat(pooled, 1).squeeze(-1))


class ComputedIndices(nn.Module):
    """Indexing by indices the model computed (`argmax(dim=1)`), accuracy read with `.item()`."""

    def __init__(self):
        super().__init__()
        self.lin, self.rnn = nn.Linear(4, 3), nn.RNN(4, H, num_layers=2)

    def forward(self, x, gold):
        z = self.lin(x)
        predicted = z.argmax(dim=1)
        correct = (predicted == gold).sum().item()
        picked = z[torch.arange(x.size(0)), predicted].sum() + z.t()[predicted].sum()
        _, h = self.rnn(x.unsqueeze(1))
        return F.cross_entropy(z, gold) * (1 + correct) + picked + h[-1].sum()


class GaussianPolicy(nn.Module):
    """torch.distributions on expressions: a Normal's rsample, log_prob and KL to a prior."""

    def __init__(self):
        super().__init__()
        self.mu, self.log_sigma = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        d = torch.distributions.Normal(self.mu(x), self.log_sigma(x).exp())
        z = d.rsample()
        prior = torch.distributions.Normal(torch.zeros(1, 2), torch.ones(1, 2))
        return (-d.log_prob(z.detach()).sum() + z.pow(2).sum()
                + torch.distributions.kl_divergence(d, prior).sum())


def reseeded(loss_of):
    """Each instance's eager draws (a Normal's noise) from its own seed, in both runs."""
    def seeded_loss(model, item):
        k, x = item
        torch.manual_seed(k)
        return loss_of(model, x)
    return seeded_loss


class Distillation(nn.Module):
    def __init__(self):
        super().__init__()
        self.teacher, self.student = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x):
        with torch.no_grad():
            soft = F.softmax(self.teacher(x) / 2.0, dim=-1)
        return (F.cross_entropy(self.student(x), soft)
                + F.kl_div(F.log_softmax(self.student(x), -1), soft, reduction="batchmean"))


class EncoderLayer(nn.Module):
    """A transformer encoder layer over one sentence, written by hand: multi-head attention as
    `softmax(q @ k.transpose(-2, -1) / sqrt(d))` on [heads, n, d] tensors, LayerNorm, GELU,
    residuals."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.heads, self.qkv, self.o = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff1, self.ff2, self.out = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.Linear(d, 3)

    def forward(self, x):
        n, d = x.shape
        q, k, v = (t.view(n, self.heads, -1).transpose(0, 1) for t in self.qkv(x).chunk(3, -1))
        attention = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d // self.heads), dim=-1)
        x = self.norm1(x + self.o((attention @ v).transpose(0, 1).reshape(n, d)))
        x = self.norm2(x + self.ff2(F.gelu(self.ff1(x))))
        return self.out(x.mean(0, keepdim=True))


class Orthogonal(nn.Module):
    """A linear layer under torch's orthogonal parametrization (its weight computed from
    `X - X.mH` by a matrix exponential at each read)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.utils.parametrizations.orthogonal(nn.Linear(4, 4))
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(torch.relu(self.lin(x))).sum(0, keepdim=True)


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.scale * grad, None


class RoundThrough(torch.autograd.Function):
    """Rounding with a straight-through gradient."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class DomainAdversarial(nn.Module):
    """Custom autograd.Functions, whose own backward must run (a gradient reversal layer into
    a domain classifier, straight-through rounding), and a reentrant checkpoint."""

    def __init__(self):
        super().__init__()
        self.enc, self.label, self.domain = nn.Linear(4, 5), nn.Linear(5, 3), nn.Linear(5, 2)

    def forward(self, x):
        h = torch.tanh(self.enc(x)).mean(0, keepdim=True)
        rounded = RoundThrough.apply(h * 4) / 4
        scores = torch.utils.checkpoint.checkpoint(self.label, rounded, use_reentrant=True)
        return scores + self.domain(GradReverse.apply(h, 0.3)).logsumexp(-1).sum()


def xy_rows():
    return [tuple(draw(seed, (1, 4), (1, 4))) for seed in range(5)]


def entry(make, loss_of, items, mapped=False, fewer=3):
    """A zoo entry: `make()` builds the model, `loss_of(model, item)` is one instance's loss;
    batched, the graph launches at most 1/`fewer` of eager's ops."""
    return make, loss_of, items, mapped, fewer


def classify(model, item):
    k, x = item
    return F.cross_entropy(model(x), label(k))


ZOO = {
    "seq2seq-teacher-forcing": entry(Seq2Seq, lambda m, p: m.loss(p, True), PAIRS),
    "seq2seq-greedy-topk": entry(Seq2Seq, lambda m, p: m.loss(p, False), PAIRS, mapped=True),
    "pointer-network": entry(Pointer, lambda m, it: m(*it), point_sets()),
    "char-cnn-highway": entry(CharCNN, lambda m, it: classify(m, (it[0], torch.tensor(it[1]))),
                              list(enumerate(WORDS))),
    "tree-gru-per-arity": entry(TreeGRU, lambda m, it: F.cross_entropy(m.out(m(it[1])),
                                                                       label(it[0])),
                                list(enumerate(TREES))),
    "gnn-index-add": entry(lambda: MessagePassing(False), lambda m, it: m(*it) ** 2, graphs()),
    "gnn-scatter-add": entry(lambda: MessagePassing(True), lambda m, it: m(*it) ** 2, graphs()),
    "gcn-sparse-adjacency": entry(GCN, lambda m, it: F.cross_entropy(m(*it[1]), label(it[0])),
                                  list(enumerate(sparse_adjacencies()))),
    "torch-functions": entry(Functions, lambda m, it: m(*it), xy_rows()),
    "rows-1xn": entry(Rows, lambda m, it: m(*it), xy_rows()),
    "reductions": entry(Reductions, lambda m, x: m(x), sequences(), fewer=1.5),
    "shape-ops": entry(Shapes, lambda m, x: m(x), sequences(), fewer=1.5),
    "loss-functions": entry(Losses, lambda m, it: m(*it), loss_items()),
    "siamese-triplet": entry(Siamese, lambda m, it: m(*it), [tuple(draw(s, *[(1, 4)] * 3))
                                                             for s in range(5)]),
    "vae-given-noise": entry(Reparameterized, lambda m, it: m(*it),
                             [tuple(draw(s, (1, 4), (1, 2))) for s in range(5)]),
    "crf-forward-algorithm": entry(CRF, lambda m, it: m(*it), tagged(), fewer=2),
    "crf-viterbi-item": entry(CRF, lambda m, it: m.viterbi_loss(*it), tagged(), mapped=True,
                              fewer=2),
    "tutorial-seq2seq-random-teacher-forcing": entry(
        TutorialSeq2Seq, lambda m, it: m(it),
        list(enumerate(PAIRS + [([2, 5, 6, 8], [7, 3, 1])])), mapped=True),
    "pointer-beam-search": entry(PointerBeam, lambda m, p: m(p),
                                 draw(3, (3, 2), (5, 2), (2, 2), (4, 2), (1, 2)), mapped=True),
    "planar-flow-slogdet-solve": entry(PlanarFlow, lambda m, it: m(it[0], it[1][0]),
                                       list(zip(draw(3, *[(1, 3)] * 5), draw(4, *[(1, 3)] * 5)))),
    "gnn-in-place-residual-layers": entry(GraphLayers,
                                          lambda m, it: F.cross_entropy(m(*it[1]), label(it[0])),
                                          list(enumerate(graphs())), fewer=2),
    "easy-first-argmax": entry(EasyFirst, lambda m, ws: m(ws),
                               [[1, 2, 3], [4, 5], [6, 7, 8, 9], [1], [2, 3, 4, 5, 6]],
                               mapped=True),
    "no-grad-decode-then-train": entry(DecodeThenTrain, lambda m, h: m(h),
                                       draw(1, *[(1, 4)] * 5), mapped=True),
    "bigru-learned-h0": entry(BiGRU, classify, list(enumerate(sequences()))),
    "tied-lstm-lm": entry(TiedLM, lambda m, ids: m(torch.tensor(ids)),
                          [[1, 2, 3], [4, 5, 6, 7, 8], [9, 1], [2, 3, 4, 5]]),
    "lstm-rows-iterated": entry(RowByRow, classify, list(enumerate(sequences())), fewer=2),
    "packed-sequence-bigru": entry(PackedGRU, lambda m, it: classify(m, (it[0],
                                                                      torch.tensor(it[1]))),
                                   list(enumerate([[1, 2, 3], [4, 5], [6, 7, 8, 9, 1], [2]]))),
    "transformer-decoder-causal": entry(
        CausalDecoder, lambda m, it: F.cross_entropy(m(it[0], it[1]), it[2]),
        [(t, mem, torch.arange(t.size(0)) % 3) for t, mem in
         zip(sequences(10, (2, 3, 2, 3)), sequences(12, (3, 2, 2, 3)))]),
    "masked-attention": entry(MaskedAttention, classify, list(enumerate(sequences()))),
    "cnn2d-batchnorm-eval": entry(lambda: TinyCNN().eval(), classify,
                                  list(enumerate(draw(15, *[(4, 4)] * 5)))),
    "embedding-bag-max-norm": entry(BagOfChars, lambda m, it: classify(m, (it[0],
                                                                          torch.tensor(it[1]))),
                                    list(enumerate([[1, 2, 3], [4, 5], [6, 7, 8, 9], [3]]))),
    "conv-group-instance-norm": entry(ConvNorms, classify, list(enumerate(sequences()))),
    "computed-indices-accuracy": entry(ComputedIndices,
                                       lambda m, x: m(x, torch.arange(x.size(0)) % 3),
                                       sequences(), mapped=True, fewer=1.5),
    "normal-rsample-log-prob-kl": entry(GaussianPolicy, reseeded(lambda m, x: m(x)),
                                        list(enumerate(draw(2, *[(1, 4)] * 5)))),
    "distillation-soft-targets": entry(Distillation, lambda m, x: m(x), draw(3, *[(1, 4)] * 5)),
    "recurrences-and-writes": entry(Recurrences, lambda m, x: m(x), sequences()),
    "hand-written-multi-head-attention": entry(
        EncoderLayer, classify, list(enumerate(draw(3, (3, 8), (5, 8), (2, 8), (4, 8), (3, 8)))),
        fewer=2),
    "custom-autograd-functions": entry(DomainAdversarial, classify, list(enumerate(sequences()))),
    "orthogonal-parametrization": entry(Orthogonal, classify, list(enumerate(sequences())),
                                        fewer=2),
}


@pytest.mark.parametrize("strategy", ["depth", "agenda", "auto"])
@pytest.mark.parametrize("name", ZOO)
def test_the_zoo_trains_as_eagerly(name, strategy):
    make, loss_of, items, mapped, fewer = ZOO[name]
    model = seeded(make())
    eager, batched = check(model, lambda item: loss_of(model, item), items, strategy, mapped)
    assert batched.stats.batches * fewer <= eager.ops


# ---- what the zoo found --------------------------------------------------------------------------
class RunningMean(nn.Module):
    """A buffer updated in place under torch.no_grad() in forward, read back by the loss."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        y = self.lin(x)
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * y.mean(0))
            self.count += 1
        return ((y - self.mean) ** 2).sum() + y.detach().max()


class BatchNormed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(4, 3), nn.BatchNorm1d(3)

    def forward(self, x):
        return self.norm(self.lin(x)).pow(2).sum()


class CarriedState(nn.Module):
    """A recurrent state carried from one instance to the next in a buffer (`copy_`), and a
    counter reset with `zero_` / `fill_`."""

    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(4, 4)
        self.register_buffer("h", torch.zeros(1, 4))
        self.register_buffer("steps", torch.zeros(1))

    def forward(self, x):
        h = self.h.clone()  # (eagerly, copy_ into self.h would break the backward)
        for t in range(x.size(0)):
            h = self.cell(x[t:t + 1], h)
        with torch.no_grad():
            self.h.copy_(h)
            self.steps.zero_() if x.size(0) > 3 else self.steps.fill_(h.sum())
        return h.pow(2).sum() * self.steps.sum()


class MovingAverage(nn.Module):
    """A buffer assigned a new value out of place in forward (an exponential moving average),
    read back by the loss."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("average", torch.zeros(4))

    def forward(self, x):
        y = self.lin(x).mean(0)
        self.average = 0.9 * self.average + 0.1 * y.detach()
        return ((y - self.average) ** 2).sum()


class SpectralNormed(nn.Module):
    """Spectral normalisation, torch's old hook and its parametrization: each call runs a
    power iteration written into the module's buffers with `normalize(..., out=u)`."""

    def __init__(self, parametrization: bool):
        super().__init__()
        torch.manual_seed(0)  # (the buffers' random start, which `seeded` does not redraw)
        norm = nn.utils.parametrizations.spectral_norm if parametrization else \
            nn.utils.spectral_norm
        self.lin, self.out = norm(nn.Linear(4, 4)), nn.Linear(4, 1)

    def forward(self, x):
        return self.out(torch.relu(self.lin(x))).pow(2).sum()


@pytest.mark.parametrize("make", [RunningMean, BatchNormed, CarriedState, MovingAverage,
                                  lambda: SpectralNormed(False), lambda: SpectralNormed(True)])
def test_state_a_model_updates_in_forward_is_eagers_during_and_after_the_graph(make):
    """Each instance reads the buffers as the instances before it left them (every op, `-`
    and `@` too), and after the graph the buffers hold their last values, as eagerly."""
    items = sequences(lengths=(3, 2, 4, 2))
    eager_model, batched_model = seeded(make()), seeded(make())
    eager = run_eager(eager_model, eager_model, items)
    batched = run_batched(batched_model, batched_model, items, "agenda")
    assert_same_training(eager, batched)
    for name, value in eager_model.state_dict().items():
        torch.testing.assert_close(batched_model.state_dict()[name], value, rtol=0, atol=1e-12,
                                   msg=name)


def test_a_tensor_written_with_an_expression_is_its_new_value_to_every_op():
    W = nn.Parameter(torch.randn(3))
    x = torch.randn(3)
    reads = [lambda y, m: y - m, lambda y, m: m * y, lambda y, m: m @ y,
             lambda y, m: torch.cat([y, m]), lambda y, m: torch.stack([y, m]),
             lambda y, m: y + m[0], lambda y, m: F.linear(m, y.unsqueeze(0))]
    for read in reads:
        results = []
        for context in (torch.enable_grad(), fb.Graph()):
            mean = torch.zeros(3)
            with context:
                y = W * x
                mean.add_(y)
                results.append(read(y, mean).sum().item())
        assert results[1] == pytest.approx(results[0], abs=1e-12)


@pytest.mark.parametrize("target, write, error", [
    (lambda: torch.zeros(3), lambda y: y.unsqueeze(0).expand(2, 3), r"shape \(2, 3\)"),
    (lambda: torch.zeros(3, dtype=torch.long), lambda y: y, "can't be cast")])
def test_an_in_place_write_that_eager_torch_refuses_raises_at_the_call(target, write, error):
    W = nn.Parameter(torch.randn(3))
    with fb.Graph():
        buffer = target()
        with pytest.raises(RuntimeError, match="Tensor.add_: .*" + error):
            buffer.add_(write(W * 2))


PARAMETER_WRITES = {  # under torch.no_grad(), operands computed from parameters
    "W.copy_(W * 2)": lambda W, V: W.copy_(W * 2),
    "W.div_(norms)": lambda W, V: W.div_(W.norm(dim=1, keepdim=True)),
    "moving average V.mul_(0.9).add_(0.1 * W)": lambda W, V: V.mul_(0.9).add_(0.1 * W),
    "W[0].fill_(0.5)": lambda W, V: W[0].fill_(0.5),
    "W[1:].mul_(W[0])": lambda W, V: W[1:].mul_(W[0]),
    "nn.init.zeros_(W[:, 1])": lambda W, V: nn.init.zeros_(W[:, 1]),
    "W[0] = V[1] * 2": lambda W, V: W.__setitem__(0, V[1] * 2),
}


@pytest.mark.parametrize("name", PARAMETER_WRITES)
def test_an_in_place_write_into_a_parameter_is_seen_by_the_calls_after_it(name):
    """A max-norm constraint, a target network's moving average, a padding row reset: the
    write reaches the parameter at the call, as eagerly; calls before it see the old values,
    calls after it the new ones (and so does the parameter after the graph)."""
    x = torch.randn(4)
    runs = []
    for context in (torch.enable_grad(), fb.Graph()):
        torch.manual_seed(0)
        W, V = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(3, 4))
        with context:
            before = (W @ x).sum() + (V @ x).sum()
            with torch.no_grad():
                PARAMETER_WRITES[name](W, V)
            after = (W @ x).sum() + (V @ x).sum()
            runs.append((before.item(), after.item(), W.detach().clone(), V.detach().clone()))
    for got, want in zip(runs[1], runs[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_write_through_a_parameters_data_before_its_first_use_is_seen_by_that_use():
    """`W.data.copy_(h)` (another tensor object, the same storage) before the graph reads W:
    the calls that read W afterwards see the values written, as eagerly."""
    x = torch.randn(3)
    runs = []
    for context in (torch.enable_grad(), fb.Graph()):
        torch.manual_seed(0)
        W, V = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))
        with context:
            with torch.no_grad():
                W.data.copy_(V * 2)
            runs.append(((W * x).sum().item(), W.detach().clone()))
    assert runs[1][0] == pytest.approx(runs[0][0], abs=1e-12)
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=0, atol=1e-12)


def test_an_in_place_write_of_an_expression_into_a_view_raises():
    """Eagerly the write reaches the tensor viewed (and its other views); batched it would not,
    so it is refused, naming the call and the way that works."""
    W = nn.Parameter(torch.randn(3))
    with fb.Graph():
        out = torch.zeros(2, 3)
        with pytest.raises(TypeError, match=r"Tensor.add_ .* view of a tensor \(shape \(3,\)\)"
                                            r".*`out\[t\] = h`"):
            out[0].add_(W * 2)


class Policy(nn.Module):
    """REINFORCE: actions sampled from `Categorical(logits=...)`, a reward read with `.item()`."""

    def __init__(self):
        super().__init__()
        self.policy, self.cell = nn.Linear(4, 3), nn.GRUCell(3, 4)

    def forward(self, h, steps, forced=None):
        log_probs, actions, reward = [], [], 0.0
        for t in range(steps):
            d = torch.distributions.Categorical(logits=self.policy(h))
            a = d.sample() if forced is None else torch.tensor([forced[t]])
            log_probs.append(d.log_prob(a))
            actions.append(a.item())
            reward += float(a.item() == t % 3)
            h = self.cell(F.one_hot(a, 3).to(h.dtype), h)
        return -torch.stack(log_probs).sum() * reward, actions


def test_reinforce_samples_per_instance_and_gets_eagers_gradient_for_its_samples():
    """Sampling follows the graph's order, not eager's, so eager equality means: the loss and
    gradients eager torch computes for the actions the batched run sampled."""
    model = seeded(Policy())
    items = [(h, n) for h, n in zip(draw(9, *[(1, 4)] * 4), (2, 3, 1, 4))]
    sampled = {}

    def sample(item):
        loss, actions = model(*item)
        sampled[item[1]] = actions
        return loss

    torch.manual_seed(0)
    batched = run_batched(model, sample, items, "agenda", mapped=True)
    eager = run_eager(model, lambda item: model(*item, forced=sampled[item[1]])[0], items)
    assert_same_training(eager, batched)
    assert len({tuple(a) for a in sampled.values()}) > 1


def test_distribution_checks_are_off_inside_a_graph_only():
    default = torch.distributions.Distribution._validate_args
    with fb.Graph():
        assert torch.distributions.Distribution._validate_args is False
    assert torch.distributions.Distribution._validate_args is default


NOISE_OF_A_SHAPE = {  # functions whose draws need the operand's shape, not its values
    "gumbel_softmax": lambda z: F.gumbel_softmax(z, tau=0.5),
    "gumbel_softmax-hard": lambda z: F.gumbel_softmax(z, hard=True),
    "dropout1d": lambda z: F.dropout1d(z.t(), 0.4).t(),
    "dropout2d": lambda z: nn.Dropout2d(0.4)(z.view(1, -1, 2, 2)).view(z.shape),
    "dropout3d": lambda z: F.dropout3d(z.view(2, 2, 2, -1), 0.4).view(z.shape),
    "alpha_dropout": lambda z: nn.AlphaDropout(0.3)(z),
    "feature_alpha_dropout": lambda z: F.feature_alpha_dropout(z.unsqueeze(0), 0.3, True)[0],
}


@pytest.mark.parametrize("name", NOISE_OF_A_SHAPE)
def test_noise_that_needs_no_values_is_drawn_at_the_call_as_eagerly(name):
    """Channel dropout, alpha dropout and Gumbel noise draw from the stream as eager torch
    does, at the call, without a forward per instance: the launches do not grow with the
    instances."""
    lin, noisy = seeded(nn.Linear(4, 4)), NOISE_OF_A_SHAPE[name]

    def loss_of(x):
        return (noisy(lin(x)) * torch.arange(1.0, 5.0)).pow(2).sum()

    launches = []
    for n in (3, 6):
        items = draw(n, *[(2, 4)] * n)
        torch.manual_seed(1)
        eager = run_eager(lin, loss_of, items)
        torch.manual_seed(1)
        batched = run_batched(lin, loss_of, items, "agenda")
        assert_same_training(eager, batched)
        launches.append(batched.stats.batches)
    assert launches[0] == launches[1]


@pytest.mark.parametrize("make", [lambda W: torch.empty_like(W).exponential_(),
                                  lambda W: torch.zeros_like(W).fill_(2.0),
                                  lambda W: W.new_zeros(W.shape).add_(1.0),
                                  lambda W: torch.rand_like(W).bernoulli_(0.5)])
def test_a_tensor_made_like_a_parameter_is_a_plain_tensor_as_eagerly(make):
    """`torch.empty_like(W).exponential_()` (noise of a parameter's shape): what is made
    like a parameter holds none of its values, so it is a fresh tensor that takes in-place
    writes, as eagerly."""
    W = nn.Parameter(torch.randn(2, 3))
    results = []
    for context in (torch.enable_grad(), fb.Graph()):
        torch.manual_seed(0)
        W.grad = None
        with context:
            loss = (make(W) * W).sum()
            loss.backward()
            results.append((loss.item(), W.grad.clone()))
    assert results[1][0] == pytest.approx(results[0][0], abs=1e-12)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=1e-12)


def test_randn_like_draws_per_instance_and_its_gradient_is_the_noise():
    mu = nn.Parameter(torch.zeros(1, 3))
    with fb.Graph():
        zs = [mu + torch.randn_like(mu + 0 * i) for i in range(4)]
        torch.stack(zs).sum().backward()
        noise = [(z - mu).value() for z in zs]
    assert len({tuple(n.flatten().tolist()) for n in noise}) == 4
    torch.testing.assert_close(mu.grad, torch.full((1, 3), 4.0))


def test_a_boolean_mask_of_an_expression_indexes_on_the_values_with_eagers_gradient():
    lin = seeded(nn.Linear(4, 3))

    def loss_of(x):
        z = lin(x)
        return z[z < 0].pow(2).sum() + z.masked_select(z > 0).sum()

    items = sequences()
    eager = run_eager(lin, loss_of, items)
    lin.zero_grad(set_to_none=True)
    with pytest.warns(UserWarning, match="depends on their values"), fb.Graph():
        total = sum(fb.map_batched(loss_of, items))
        total.backward()
        assert total.item() == pytest.approx(eager.loss, abs=1e-12)
    for p, want in zip(lin.parameters(), eager.grads.values()):
        torch.testing.assert_close(p.grad, want, rtol=0, atol=1e-12)


def test_packing_several_sequences_in_one_instance_raises_naming_the_function():
    gru = seeded(nn.GRU(4, H))
    with fb.Graph():
        x = fb.input(torch.randn(3, 2, 4)) * 1.0
        with pytest.raises(ValueError, match="_pack_padded_sequence.*one sequence per instance"):
            gru(nn.utils.rnn.pack_padded_sequence(x, torch.tensor([3, 2])))
