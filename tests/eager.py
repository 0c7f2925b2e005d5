"""The eager twin of flybatch's per-instance API: the same names over plain torch tensors.

Equivalence tests write the per-instance code ONCE against a backend namespace `B` and run it
with `B = flybatch` (lazy, batched) and with `B = eager` (this module: every call computes its
result at once, one instance at a time, with textbook PyTorch math). `eager.Graph` mirrors
`fb.Graph` (strategy is accepted and ignored; dtype and device say what constants are made of),
`twin(module)` gives an `fb.nn` module's eager counterpart sharing its parameters, and
`run` / `assert_same` run a workload on a backend and compare two runs.

Nothing here imports flybatch's kernels: the reference math is written out independently.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

# ---- graph stand-in ------------------------------------------------------------------------
_stack: list["Graph"] = []


class Graph:
    """`with eager.Graph(dtype=...)`: constants made inside are of that dtype and device."""

    def __init__(self, strategy: str = "eager", device: str | torch.device | None = None,
                 dtype: torch.dtype = torch.float32):
        self.strategy = strategy
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype = dtype

    def forward(self, exprs: Sequence[torch.Tensor] | None = None):
        return None if exprs is None else list(exprs)

    def __enter__(self) -> "Graph":
        _stack.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _stack.pop()


def _graph() -> Graph:
    return _stack[-1] if _stack else Graph()


def _t(x: Any) -> torch.Tensor:
    """An operand as a tensor: tensors as they are, numbers and arrays as constants."""
    if isinstance(x, torch.Tensor):
        return x
    g = _graph()
    if isinstance(x, numbers.Real):
        return torch.tensor(float(x), dtype=g.dtype, device=g.device)
    return torch.tensor(np.asarray(x, dtype=np.float64)).to(g.device, g.dtype)  # a copy


def _shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    return (int(shape),) if isinstance(shape, numbers.Integral) else tuple(shape)


# ---- leaves --------------------------------------------------------------------------------
def input(x: Any, graph: Any = None) -> torch.Tensor:  # noqa: A001 - flybatch's name
    g = _graph()
    if isinstance(x, torch.Tensor):  # the value at the call, whatever happens to x later
        return x.detach().to(g.device, g.dtype, copy=True)
    return _t(x)


def parameter(p: torch.Tensor, graph: Any = None) -> torch.Tensor:
    return p


def zeros(shape: int | Sequence[int], graph: Any = None) -> torch.Tensor:
    g = _graph()
    return torch.zeros(_shape(shape), dtype=g.dtype, device=g.device)


def ones(shape: int | Sequence[int], graph: Any = None) -> torch.Tensor:
    g = _graph()
    return torch.ones(_shape(shape), dtype=g.dtype, device=g.device)


def lookup(table: Any, index: int, sparse: bool | None = None, graph: Any = None) -> torch.Tensor:
    """Row `index` of the table; sparse=True gives the table a sparse gradient, as torch does."""
    if isinstance(table, torch.nn.Embedding):
        sparse = table.sparse if sparse is None else sparse
        table = table.weight
    if sparse:
        index_t = torch.tensor([int(index)], device=table.device)
        return F.embedding(index_t, table, sparse=True)[0]
    return table[int(index)]


# ---- elementwise ---------------------------------------------------------------------------
def tanh(x): return torch.tanh(_t(x))
def sigmoid(x): return torch.sigmoid(_t(x))
def relu(x): return torch.relu(_t(x))
def exp(x): return torch.exp(_t(x))
def log(x): return torch.log(_t(x))
def abs(x): return torch.abs(_t(x))  # noqa: A001
def sqrt(x): return torch.sqrt(_t(x))
def square(x): return _t(x) * _t(x)
def neg(x): return -_t(x)


logistic, rectify = sigmoid, relu


def add(a, b): return _t(a) + _t(b)
def sub(a, b): return _t(a) - _t(b)
def mul(a, b): return _t(a) * _t(b)
def div(a, b): return _t(a) / _t(b)


cmult, cdiv = mul, div


# ---- products ------------------------------------------------------------------------------
def matmul(a, b): return _t(a) @ _t(b)
def affine(W, x, b): return _t(W) @ _t(x) + _t(b)
def dot(a, b): return (_t(a) * _t(b)).sum()


# ---- lists ---------------------------------------------------------------------------------
def esum(xs):
    xs = [_t(x) for x in xs]
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total


def average(xs): return esum(xs) / len(xs)
def emax(xs): return torch.stack([_t(x) for x in xs]).max(0).values


def logsumexp(xs):
    x = torch.stack([_t(x) for x in xs])
    top = x.max(0).values.detach()
    return top + torch.log(torch.exp(x - top).sum(0))


def attention(keys, query, values=None):
    """softmax(K q) @ V with the keys (values) as the rows of K (V)."""
    K = torch.stack([_t(k) for k in keys])
    V = K if values is None else torch.stack([_t(v) for v in values])
    return softmax(K @ _t(query)) @ V
def concat(xs, dim: int = 0): return torch.cat([_t(x) for x in xs], dim)
def stack(xs): return torch.stack([_t(x) for x in xs])


# ---- reductions and losses -----------------------------------------------------------------
def sum_elems(x): return _t(x).sum()
def mean_elems(x): return _t(x).mean()
def squared_norm(x): return (_t(x) * _t(x)).sum()
def squared_distance(a, b): return squared_norm(_t(a) - _t(b))


def softmax(x):
    """Of a vector; of a list of scalars, the list of their softmax weights."""
    if isinstance(x, (list, tuple)):
        return list(softmax(torch.stack([_t(s) for s in x])).unbind())
    e = torch.exp(_t(x) - _t(x).max())
    return e / e.sum()


def log_softmax(x):
    if isinstance(x, (list, tuple)):
        return list(log_softmax(torch.stack([_t(s) for s in x])).unbind())
    x = _t(x)
    return x - torch.logsumexp(x, 0)


def pick(x, i: int): return _t(x)[int(i)]
def pick_neg_log_softmax(x, label: int): return -log_softmax(x)[int(label)]


# ---- shape ops -----------------------------------------------------------------------------
def slice_rows(x, start: int, stop: int): return _t(x)[start:stop]
def reshape(x, shape): return _t(x).reshape(_shape(shape))
def transpose(x): return _t(x).T


def dropout(x, p: float):
    if p != 0.0:
        # (the equivalence tests do not seed the two runs alike; seeded masks equal to eager's
        # are test_semantics' and test_torch_native's)
        raise ValueError("eager.dropout only models p=0")
    return _t(x)


# ---- nn cells: textbook equations over one instance ----------------------------------------
def lstm_cell(x, h, c, w_ih, w_hh, bias):
    """PyTorch's LSTM (gates i, f, g, o) with a single bias."""
    i, f, g, o = (w_ih @ x + w_hh @ h + bias).chunk(4)
    c = sigmoid(f) * c + sigmoid(i) * tanh(g)
    return sigmoid(o) * tanh(c), c


def gru_cell(x, h, w_ih, w_hh, b_ih, b_hh):
    """PyTorch's GRU (gates r, z, n)."""
    rx, zx, nx = (w_ih @ x + b_ih).chunk(3)
    rh, zh, nh = (w_hh @ h + b_hh).chunk(3)
    r, z = sigmoid(rx + rh), sigmoid(zx + zh)
    n = tanh(nx + r * nh)
    return (1 - z) * n + z * h


def _tree_output(i, o, u, c_children):
    c = sigmoid(i) * tanh(u) + c_children
    return State(h=sigmoid(o) * tanh(c), c=c)


class State:
    """`fb.nn.State`'s twin: a cell's output `h` and memory cell `c`, read by name."""

    __slots__ = ("h", "c")

    def __init__(self, *, h: torch.Tensor, c: torch.Tensor):
        self.h, self.c = h, c


class _Twin:
    def __init__(self, module: torch.nn.Module):
        self.m = module


class _Linear(_Twin):
    def __call__(self, x):
        y = self.m.weight @ x
        return y if self.m.bias is None else y + self.m.bias


class _Embedding(_Twin):
    def __call__(self, index):
        return lookup(self.m.weight, index, sparse=self.m.sparse)


class _MLP(_Twin):
    def __call__(self, x):
        activation = globals()[self.m.activation.__name__]
        layers = [twin(layer) for layer in self.m.layers]
        for k, layer in enumerate(layers):
            x = layer(x)
            if k + 1 < len(layers):
                x = activation(x)
        return x


class _LSTMCell(_Twin):
    def __call__(self, x, state=None):
        m = self.m
        if state is None:
            state = State(h=zeros(m.hidden_size), c=zeros(m.hidden_size))
        elif isinstance(state, tuple):  # (h, c), as torch.nn.LSTMCell
            state = State(h=state[0], c=state[1])
        h, c = lstm_cell(x, state.h, state.c, m.weight_ih, m.weight_hh, m.bias)
        return State(h=h, c=c)


class _GRUCell(_Twin):
    def __call__(self, x, h=None):
        m = self.m
        if h is None:
            h = zeros(m.hidden_size)
        return gru_cell(x, h, m.weight_ih, m.weight_hh, m.bias_ih, m.bias_hh)


class _LSTM(_Twin):
    @staticmethod
    def _run(cell, xs):
        state, out = None, []
        for x in xs:
            state = cell(x, state)
            out.append(state.h)
        return out

    def __call__(self, xs):
        xs = list(xs)
        m = self.m
        for layer, cell in enumerate(m.forward_cells):
            fwd = self._run(twin(cell), xs)
            if not m.bidirectional:
                xs = fwd
                continue
            bwd = self._run(twin(m.backward_cells[layer]), xs[::-1])[::-1]
            xs = [torch.cat([f, b]) for f, b in zip(fwd, bwd)]
        return xs


class _TreeLSTMCell(_Twin):
    """Tai et al. (2015): N-ary (ordered children) and child-sum Tree-LSTMs."""

    def leaf(self, x):
        m = self.m
        if m.child_sum:
            return self([], x)
        i, o, u = (m.W_iou @ x + m.b_iou).chunk(3)
        return _tree_output(i, o, u, 0)

    def __call__(self, children, x=None):
        m = self.m
        hs = [child.h for child in children]
        cs = [child.c for child in children]
        H = m.hidden_size
        if m.child_sum:
            h_sum = esum(hs) if hs else zeros(H)
            i, o, u = (m.W_iou @ x + m.U_iou @ h_sum + m.b_iou).chunk(3)
            fs = [sigmoid(m.W_f @ x + m.U_f @ h + m.b_f) for h in hs]
        else:
            pre = m.U_iou @ torch.cat(hs) + m.b_iou
            if x is not None:
                pre = pre + m.W_iou @ x
            i, o, u = pre.chunk(3)
            fs = [sigmoid(m.U_f[k] @ h + m.b_f) for k, h in enumerate(hs)]
        c_children = esum([f * c for f, c in zip(fs, cs)]) if cs else 0
        return _tree_output(i, o, u, c_children)


def twin(module: Any) -> Any:
    """The eager counterpart of an `fb.nn` module, sharing its parameters (others: as is)."""
    for twin_cls in (_Linear, _Embedding, _MLP, _LSTMCell, _GRUCell, _LSTM, _TreeLSTMCell):
        if type(module).__name__ == twin_cls.__name__[1:]:
            return twin_cls(module)
    return module


# ---- running a workload on a backend and comparing two runs ------------------------------------
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def run(B: Any, strategy: str, dtype: torch.dtype, build: Callable[[Any], list],
        params: Sequence[torch.Tensor], device: str | None = None):
    """Build every instance's outputs with `build(B)` in one graph, forward, and backprop.

    The loss is a fixed random weighting of every output, so each output's gradient matters.
    Returns (values of the outputs, gradients of `params` (None where unused), loss value).
    """
    for p in params:
        p.grad = None
    with B.Graph(strategy=strategy, dtype=dtype, device=device) as g:
        outs = build(B)
        values = [v.detach().clone() for v in g.forward(outs)]
        gen = torch.Generator().manual_seed(1234)
        weights = [torch.randn(tuple(o.shape), generator=gen, dtype=dtype).to(device or "cpu")
                   for o in outs]
        loss = B.esum([B.sum_elems(B.cmult(o, w)) for o, w in zip(outs, weights)])
        loss.backward()
        loss_value = float(g.forward([loss])[0].detach())
    grads = [None if p.grad is None else p.grad.detach().to_dense().clone() for p in params]
    return values, grads, loss_value


def assert_same(actual, expected, dtype: torch.dtype, tol: float | None = None) -> None:
    """Two `run` results agree: values, gradients and loss, to the dtype's tolerance (or a
    tighter `tol`)."""
    tol = TOLERANCE[dtype] if tol is None else tol
    values, grads, loss = actual
    ref_values, ref_grads, ref_loss = expected
    assert len(values) == len(ref_values)
    for k, (v, r) in enumerate(zip(values, ref_values)):
        assert v.dtype == dtype, f"output {k} has dtype {v.dtype}"
        torch.testing.assert_close(v.cpu(), r.cpu(), rtol=tol, atol=tol,
                                   msg=lambda m, k=k: f"value of output {k}: {m}")
    for k, (gr, r) in enumerate(zip(grads, ref_grads)):
        assert (gr is None) == (r is None), f"parameter {k}: gradient presence differs"
        if r is not None:
            torch.testing.assert_close(gr.cpu(), r.cpu(), rtol=tol, atol=tol,
                                       msg=lambda m, k=k: f"gradient of parameter {k}: {m}")
    assert abs(loss - ref_loss) <= tol * (1 + abs(ref_loss))
