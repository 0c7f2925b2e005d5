"""Random per-instance torch programs, run unchanged inside a graph, against eager PyTorch.

Each instance runs a random program of ordinary torch code over a pool of tensors: `F.linear`
and `nn` modules (Linear, LSTMCell, GRUCell, LayerNorm, Embedding), Tensor methods and
operators, `torch.cat` / `stack` / `chunk`, the batch-of-one `[1, n]` row layout, reductions,
softmaxes, losses, `torch.where`, `topk`, `masked_fill`, `cumsum`, `einsum`, an `nn.LSTM` over a
short sequence, a bidirectional `nn.GRU`, `nn.MultiheadAttention`, `nn.Bilinear`, `nn.Conv1d`,
attention over a per-instance memory, `F.pad`, `bmm`, per-instance matrices, augmented
assignments (`z += y`), indexing and slicing, `no_grad` regions, `.detach()`, value
peeks that steer branches or pick embedding rows, writes of expressions into plain tensors,
and (in a plain loop, where the order of draws is the program's) dropout. Inside `fb.Graph`
under every strategy, and under `map_batched`, it must give eager PyTorch's values and the
parameters' gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import flybatch as fb
from flybatch.graph import STRATEGIES

F64 = torch.float64
H = 4
VOCAB = 6

KINDS = ("linear", "module", "unary", "binary", "cat_chunk", "stack", "row", "softmax",
         "reduce", "index", "slice", "lstm_cell", "gru_cell", "layer_norm", "embedding",
         "branch", "no_grad", "detach", "where", "write", "loss", "dropout", "topk", "masked",
         "cumsum", "einsum", "normalize", "matrix", "sequence", "augmented", "gru_seq", "attention", "bilinear", "pad", "conv", "repeat", "mha", "var", "bmm", "softplus")
instruction = st.tuples(st.sampled_from(KINDS), st.integers(0, 50), st.integers(0, 50))
program = st.lists(instruction, min_size=1, max_size=8)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(11)
        self.W = nn.Parameter(torch.randn(H, H, generator=gen, dtype=F64) * 0.5)
        self.linear = nn.Linear(H, H, dtype=F64)
        self.lstm = nn.LSTMCell(H, H, dtype=F64)
        self.gru = nn.GRUCell(H, H, dtype=F64)
        self.norm = nn.LayerNorm(H, dtype=F64)
        self.embedding = nn.Embedding(VOCAB, H, dtype=F64)
        self.rnn = nn.LSTM(H, H, dtype=F64)
        self.gru_seq = nn.GRU(H, H, bidirectional=True, dtype=F64)
        self.bilinear = nn.Bilinear(H, H, H, dtype=F64)
        self.conv = nn.Conv1d(1, 2, 3, padding=1, dtype=F64)
        self.mha = nn.MultiheadAttention(H, 2, dtype=F64)
        with torch.no_grad():  # the same values in every copy, whatever torch's seed
            for p in list(self.parameters())[1:]:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=F64) * 0.5)


def run_program(m: Model, steps, x0: torch.Tensor, dropout: bool) -> list:
    """One instance: the program over a pool of tensors; returns every tensor it made."""
    pool = [torch.tanh(m.linear(x0))]
    for kind, a, b in steps:
        x, y = pool[a % len(pool)], pool[b % len(pool)]
        k = b % H
        if kind == "linear":
            pool.append(torch.sigmoid(F.linear(x, m.W)))
        elif kind == "module":
            pool.append(m.linear(x).relu())
        elif kind == "unary":
            f = (torch.tanh, torch.sigmoid, torch.relu, torch.sin, lambda t: t.exp().log1p(),
                 lambda t: (t * t + 1).sqrt())[a % 6]
            pool.append(f(x))
        elif kind == "binary":
            f = (torch.add, torch.mul, torch.sub, lambda p, q: p / (1 + q * q),
                 torch.maximum, lambda p, q: p * 0.5 + 2 * q)[a % 6]
            pool.append(f(x, y))
        elif kind == "cat_chunk":
            pool.append(torch.cat([x, y]).chunk(2)[a % 2] * torch.cat([y, x])[k:k + H])
        elif kind == "stack":
            s = torch.stack([x, y])
            pool.append(s.sum(0) if a % 2 else s.mean(dim=0) + s[1])
        elif kind == "row":  # the tutorials' batch-of-one layout
            row = x.view(1, -1) @ m.W
            pool.append(row.squeeze(0) + y.unsqueeze(0)[0])
        elif kind == "softmax":
            f = (F.softmax, F.log_softmax)[a % 2]
            pool.append(f(x.unsqueeze(0), dim=1).squeeze(0))
        elif kind == "reduce":
            r = (x.sum(), x.max(), x.norm(), x.mean(), torch.logsumexp(x, 0))[a % 5]
            pool.append(y * r)
        elif kind == "index":
            pool.append(y * x[k] + x[-1])
        elif kind == "slice":
            pool.append(torch.cat([x[:k], y[k:]]))
        elif kind == "lstm_cell":
            h, c = m.lstm(x.unsqueeze(0), (y.unsqueeze(0), torch.zeros(1, H, dtype=F64)))
            pool.append(h[0] + c.squeeze(0))
        elif kind == "gru_cell":
            pool.append(m.gru(x.unsqueeze(0), y.unsqueeze(0)).squeeze(0))
        elif kind == "layer_norm":
            pool.append(m.norm(x + y))
        elif kind == "embedding":  # a row picked by a value peek
            word = int(x.argmax())
            pool.append(m.embedding(torch.tensor([word]))[0] * y)
        elif kind == "branch":  # value-dependent control flow
            pool.append(torch.sigmoid(x) if x.sum().item() > 0 else torch.tanh(-y))
        elif kind == "no_grad":
            with torch.no_grad():
                target = torch.tanh(F.linear(x, m.W))
            pool.append(y - target)
        elif kind == "detach":
            pool.append(x.detach() * y)
        elif kind == "where":
            pool.append(torch.where(x > 0, x, y * 2))
        elif kind == "write":  # an expression written into a plain tensor
            buffer = torch.zeros(2, H, dtype=F64)
            buffer[a % 2] = x
            buffer[1 - a % 2, k] = y[0]
            pool.append(buffer.sum(0))
        elif kind == "loss":
            target = torch.tensor([k])
            loss = (F.cross_entropy(x.unsqueeze(0), target), F.mse_loss(x, y),
                    F.nll_loss(F.log_softmax(y, dim=0).unsqueeze(0), target))[a % 3]
            pool.append(x * loss)
        elif kind == "dropout" and dropout:
            pool.append(F.dropout(x.exp(), p=0.5, training=True))
        elif kind == "topk":
            values, indices = x.topk(2)
            pool.append(y * values.sum() + y[indices[0]])
        elif kind == "masked":
            pool.append(x.masked_fill(y < 0, 0.0) + x.clamp(min=-0.5, max=0.5))
        elif kind == "cumsum":
            pool.append(torch.cumsum(x, 0) - x.flip(0))
        elif kind == "einsum":
            pool.append(torch.einsum("ij,j->i", m.W, x) * torch.dot(x, y))
        elif kind == "normalize":
            pool.append(F.normalize(x, dim=0) + F.cosine_similarity(x, y, dim=0))
        elif kind == "matrix":  # a per-instance matrix: outer product, transpose, product
            outer = torch.outer(x, y)
            pool.append((outer.t() @ x + outer.mean(1)).expand(2, H).sum(0))
        elif kind == "augmented":  # an in-place update, seen through every reference
            z = x * 2
            alias = z
            z += y
            z *= 0.5
            pool.append(alias)
        elif kind == "gru_seq":
            out, h = m.gru_seq(torch.stack([x, y]).unsqueeze(1))
            pool.append(out[0, 0, :H] + out[1, 0, H:] + h.sum(0).view(-1))
        elif kind == "attention":  # scores over a per-instance memory of 3 rows
            memory = torch.stack([x, y, x - y])
            weights = F.softmax(memory @ x, dim=0)
            pool.append(weights @ memory)
        elif kind == "bilinear":
            pool.append(m.bilinear(x.unsqueeze(0), y.unsqueeze(0)).squeeze(0))
        elif kind == "pad":
            pool.append(F.pad(x[1:], (0, 1)) + F.pad(y[:-1], (1, 0), value=0.5))
        elif kind == "conv":
            pool.append(m.conv(x.view(1, 1, H)).sum(1).view(H))
        elif kind == "repeat":
            pool.append(x.repeat(2)[k:k + H] * y.roll(1))
        elif kind == "mha":
            seq = torch.stack([x, y]).unsqueeze(1)
            out, _ = m.mha(seq, seq, seq)
            pool.append(out[1, 0])
        elif kind == "var":
            pool.append((x - x.mean()) / (x.var() + 1) + x.std() * y)
        elif kind == "bmm":
            a = torch.stack([torch.outer(x, y), torch.outer(y, x)])
            pool.append(torch.bmm(a, a).sum((0, 1)))
        elif kind == "softplus":
            pool.append(F.softplus(x) - F.gelu(y) + F.elu(x) * F.leaky_relu(y))
        elif kind == "sequence":  # nn.LSTM over a short sequence of this instance
            out, (h, c) = m.rnn(torch.stack([x, y, x * y]).unsqueeze(1))
            pool.append(out[-1, 0] + h.view(H) * c.view(-1))
    return pool


def _inputs(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(H, generator=gen, dtype=F64) for _ in range(n)]


def _run(programs, driver: str, strategy: str | None):
    """(every value made, the loss, each parameter's gradient) of the programs, eagerly
    (`strategy` None) or inside a graph."""
    m = Model()
    xs = _inputs(len(programs))
    dropout = driver == "loop"  # under map_batched draws follow the rounds, not the loop
    torch.manual_seed(1)

    def instance(pair):
        return run_program(m, pair[0], pair[1], dropout)

    if strategy is None:
        pools = [instance(pair) for pair in zip(programs, xs)]
        values = [x for pool in pools for x in pool]
        loss = torch.stack([v.sum() for v in values]).sum()
        loss.backward()
        values, loss = [v.detach() for v in values], loss.item()
    else:
        with fb.Graph(strategy=strategy):
            if driver == "loop":
                pools = [instance(pair) for pair in zip(programs, xs)]
            else:
                pools = fb.map_batched(instance, list(zip(programs, xs)))
            values = [x for pool in pools for x in pool]
            loss = torch.stack([v.sum() for v in values]).sum()
            loss.backward()
            values, loss = [torch.tensor(v.tolist(), dtype=F64) for v in values], loss.item()
    grads = {name: p.grad for name, p in m.named_parameters()}
    return values, loss, grads


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("driver", ["loop", "map_batched"])
@given(programs=st.lists(program, min_size=1, max_size=3))
def test_random_torch_programs_inside_a_graph_match_eager(strategy, driver, programs):
    expected_values, expected_loss, expected_grads = _run(programs, driver, None)
    values, loss, grads = _run(programs, driver, strategy)
    assert loss == pytest.approx(expected_loss, rel=1e-9, abs=1e-9, nan_ok=True)
    assert len(values) == len(expected_values)
    for k, (v, e) in enumerate(zip(values, expected_values)):
        torch.testing.assert_close(v, e, rtol=1e-9, atol=1e-9, equal_nan=True,
                                   msg=lambda message, k=k: f"value {k}: {message}")
    for name, e in expected_grads.items():
        assert (grads[name] is None) == (e is None), f"gradient presence of {name} differs"
        if e is not None:
            torch.testing.assert_close(grads[name], e, rtol=1e-9, atol=1e-9, equal_nan=True,
                                       msg=lambda message, n=name: f"gradient of {n}: {message}")
