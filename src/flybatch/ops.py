"""The ops: for each, its shape rule, its signature rule and its batched kernel, side by side.

Every user-facing function creates one node and does no torch work. Shapes are per instance
(the batch dimension never appears here); kernels see the batch in dim 0. Each row of the op
table is an `Op`: its name, its batched kernel, its flags and, for most ops, the `rule` family of
the compiled core (csrc/rules.cpp) that checks shapes and interns signatures: `_core.Rule(op)` is
the user-facing function, one C call per node (so are the operators `+ - * / @`, unary `-` and
`x[i]`, `x[a:b]`). The families: unary elementwise ("unary"; "vector" for ops of vectors,
"reduce" for reductions to a scalar), binary elementwise with NumPy broadcasting of per-instance
shapes ("binary"), products with a shared parameter ("matmul", "affine", "lookup"), lists
("list", "stack", "concat"), "pick", "pick_nls" and "slice". The few ops without a family
(reshape, transpose, dropout) are Python functions that call `Graph.add` with their own key.
The ops written in Python are wrapped by `_core.own_time`, so that their calls count as
flybatch's part of a build, as the compiled rules do (the bench reports the rest, the user's own
per-instance Python, as `build_user`).

Signature rules (the paper's heuristic): elementwise ops by op and shapes; dimension-sensitive
ops by op and input shapes; `W @ x`, `affine` and `lookup` also by the parameter node, so that
every `W @ h_i` of a batch becomes ONE `H @ W.T`.

Ragged ops batch nodes that differ only in the length of a list: `esum`, `average`, `emax`,
`logsumexp`, `attention`, `stack` and the fused child-sum Tree-LSTM cell (fb.nn) over any number
of children. Their signature leaves the length out; the executor gathers every item of every node
of a batch as ONE flat argument and gives the kernel each node's length, and the kernel reduces
each node's segment (a segment sum, or a padded `[B, longest, ...]` view with a fill that the
reduction ignores).

Padded ops batch nodes whose first argument differs only in its leading dim, a length:
`softmax`, `log_softmax` and `pick_neg_log_softmax` of vectors, and `matmul` of an instance
matrix of n_i rows with a vector (`M_i @ q`) or of a vector with it (`weights_i @ M_i`), unless
a parameter fixes the length. Their signature writes the length as n (`softmax(n,)`,
`matmul(n, 64)(64,)`). The executor pads each argument to the longest of its batch with zeros
and gives the kernel each node's length; the kernel masks what the padding would change (-inf
before a softmax). A result whose length varies (these, `stack`) is stored padded as ONE
`[B, longest, ...]` tensor with zeros in the padding, each node keeping its own shape: a read
narrows the rows to the reader's width (an op that batches equal shapes only, such as
`slice_rows` or `concat`, reads exactly its shape), and `value()` is the node's own.
Such a result is *length-led* (its leading dim is a length, written n in its signature), and
the ops of it batch across lengths in turn: unary elementwise ops (`exp(scores)`), binary ones
whose other operand is as long, a broadcast row or a scalar (`K_i @ Wa + s @ Ua`, `scores *
0.5`), reductions (`sum_elems`, `mean_elems`, `squared_norm`) and `x[i]`. Their kernels leave
zeros in the padding (zeroing it again where f(0) != 0, as for `exp` or `K_i + row`, so that a
broadcast row's gradient sums over real rows only). An input that is not length-led keeps its
exact signature: a parameter's rows or a lookup's are no length (csrc/rules.cpp decides, per
rule family). Attention over a variable number of source positions is thus one launch per op
and step, additive (`tanh(K Wa + s Ua) @ va`) or by products, written over a matrix
(`softmax(K @ q) @ K` with `K = stack(keys)`) or over lists:
`attention(keys, query)` is one node giving the context, and scores as a list of scalars go
through one `logsumexp` in `softmax`, `log_softmax` and `pick_neg_log_softmax` of a list.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from . import _core, kernels
from .errors import ShapeError
from .graph import Expression, Graph, Op, Shape, current_graph

Operand = Any  # an Expression, a torch.Tensor, an ndarray or a Python number


# ---- operands ------------------------------------------------------------------------------
def graph_of(*operands: Operand) -> Graph:
    """The graph of the first expression among `operands`, else the current graph."""
    for x in operands:
        if isinstance(x, Expression):
            return x.graph
        if isinstance(x, (list, tuple)):
            for y in x:
                if isinstance(y, Expression):
                    return y.graph
    return current_graph()


def node(g: Graph, x: Operand) -> int:
    """The node id of an operand, wrapping tensors and numbers as leaves of `g`."""
    return g.node_of(x) if isinstance(x, Expression) else g._operand(x)


def unary_operand(x: Operand) -> tuple[Graph, int]:
    """(graph, node) of a single operand (for the ops written in Python)."""
    if isinstance(x, Expression):
        return x.graph, x.id
    g = graph_of(x)
    return g, node(g, x)


# ---- leaves ------------------------------------------------------------------------------
@_core.own_time
def input(x: Any, graph: Graph | None = None) -> Expression:  # noqa: A001 - DyNet's name
    """A constant input (tensor, ndarray, list or float); no gradient flows into it."""
    g = graph or current_graph()
    if isinstance(x, torch.Tensor):
        return Expression(g, g.input_node(x))
    return Expression(g, g.input_node(torch.tensor(np.asarray(x, dtype=np.float64)), owned=True))


@_core.own_time
def parameter(p: torch.Tensor, graph: Graph | None = None) -> Expression:
    """The graph's single node for tensor `p`; gradients accumulate into `p.grad`."""
    g = graph or current_graph()
    return Expression(g, g.parameter_node(p))


@_core.own_time
def zeros(shape: int | Sequence[int], graph: Graph | None = None) -> Expression:
    g = graph or current_graph()
    return Expression(g, g.constant_node("zeros", _as_shape("zeros", shape)))


@_core.own_time
def ones(shape: int | Sequence[int], graph: Graph | None = None) -> Expression:
    g = graph or current_graph()
    return Expression(g, g.constant_node("ones", _as_shape("ones", shape)))


def _as_shape(op: str, shape: int | Sequence[int], inferred: int = 0) -> Shape:
    """`shape` as a tuple of sizes, checked at the call (a negative size would fail only inside
    the kernel); up to `inferred` sizes may be -1, which the op infers (reshape, as torch)."""
    dims = (int(shape),) if isinstance(shape, numbers.Integral) else tuple(int(d) for d in shape)
    if any(d < -1 for d in dims) or dims.count(-1) > inferred:
        allowed = " (one -1 is inferred)" if inferred else ""
        raise ShapeError(f"{op}: sizes must be non-negative{allowed}, got shape {dims}")
    return dims


def _lookup_kernel(xs, attr, shape):
    (table, sparse, options), rows = attr
    out = F.embedding(_index(rows, table), table, sparse=sparse, **dict(options))
    # A row is (columns,); captured `F.embedding(torch.tensor([w]), E)` rows are (1, columns).
    return out if len(shape) == 1 else out.view(len(rows), *shape)


LOOKUP = Op("lookup", _lookup_kernel, per_node_attrs=True, cheap=True, rule="lookup")
lookup = _core.Rule(LOOKUP, doc="""lookup(table, index, sparse=None, graph=None)

Row `index` of an embedding matrix (or `torch.nn.Embedding`).

All lookups into one table batch into one `embedding` call. With `sparse=True` (the default
for an `nn.Embedding(sparse=True)`), the table's gradient is sparse: only the rows used.
An `nn.Embedding`'s `padding_idx` (that row gets no gradient) and `max_norm` (the rows looked
up are renormalised in place at forward time) act as in its own forward.""")


def _embedding_args(table: torch.nn.Embedding, sparse: bool | None
                    ) -> tuple[torch.Tensor, bool, tuple[tuple[str, Any], ...]]:
    """(weight, sparse, F.embedding's keyword options by name) of an `nn.Embedding` (the lookup
    rule calls this for a table that is not a tensor)."""
    if not isinstance(table, torch.nn.Embedding):
        raise TypeError(f"lookup: the table must be a tensor or an nn.Embedding, "
                        f"got {type(table).__name__}")
    if table.scale_grad_by_freq:
        raise ValueError(
            "lookup: nn.Embedding(scale_grad_by_freq=True) is not supported: it scales the "
            "gradient by how often a word occurs in ONE embedding call, and batching, not "
            "the per-instance code, decides which lookups share a call")
    options: tuple[tuple[str, Any], ...] = ()
    if table.padding_idx is not None:
        options += (("padding_idx", table.padding_idx),)
    if table.max_norm is not None:
        options += (("max_norm", table.max_norm), ("norm_type", table.norm_type))
    return table.weight, bool(table.sparse if sparse is None else sparse), options


def _index(index: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """The per-node ints of a batch as an index tensor on `like`'s device."""
    return torch.from_numpy(index).to(like.device)


# ---- unary elementwise ---------------------------------------------------------------------
def _unary(name: str, fn: Callable[[torch.Tensor], torch.Tensor], padding: float | None = None):
    """An elementwise op. Padded: of a length-led input (a softmax's weights, a stack of rows)
    it batches across lengths, and leaves zeros in its result's padding: `padding` is None
    when f(0) = 0 (tanh, relu...), else the value the input's padding takes before f (0, or 1
    where f or its gradient is infinite at 0: log, sqrt), whose result is then zeroed, so that
    no padding value (or gradient) reaches a real one."""
    def kernel(xs, attr, shape, lengths=None):
        x = xs[0]
        if lengths is None or padding is None:
            return fn(x)
        mask = _padding(lengths, x)
        return fn(x.masked_fill(mask, padding) if padding else x).masked_fill(mask, 0.0)

    op = Op(name, kernel, cheap=True, padded=True, rule="unary")
    return _core.Rule(op, doc=f"{name}(x): elementwise {name}.")


tanh = _unary("tanh", torch.tanh)
sigmoid = logistic = _unary("sigmoid", torch.sigmoid, padding=0.0)
relu = rectify = _unary("relu", torch.relu)
exp = _unary("exp", torch.exp, padding=0.0)
log = _unary("log", torch.log, padding=1.0)
abs = _unary("abs", torch.abs)  # noqa: A001 - the math name
sqrt = _unary("sqrt", torch.sqrt, padding=1.0)
square = _unary("square", torch.square)
neg = _unary("neg", torch.neg)


# ---- binary elementwise, with NumPy broadcasting of per-instance shapes ----------------------
def _align(x: torch.Tensor, ndim: int) -> torch.Tensor:
    """Insert the per-instance leading 1s that broadcasting needs, after the batch dim."""
    missing = ndim - (x.dim() - 1)
    return x.reshape(x.shape[0], *([1] * missing), *x.shape[1:]) if missing > 0 else x


BOTH = 3  # the attr of a binary op across lengths: its operands as long as the result, as bits


def _binary(name: str, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
            keeps_zeros: Callable[[int], bool], b_padding: float = 0.0):
    """An elementwise op, with NumPy broadcasting. Padded: when an operand as long as the
    result is length-led, it batches across lengths; its attr says which operands are that long
    (1: a, 2: b; the other is a broadcast row or a scalar), and `keeps_zeros(aligned)` whether
    the padding of the result is zeros already (0 + 0, 0 * b) or must be zeroed (0 + b, whose
    gradient would otherwise sum b's over padded rows). `b_padding`: the value b's padding
    takes when b is that long (1 for a denominator: 0 / 0 is no zero)."""
    def kernel(xs, aligned, shape, lengths=None):
        a, b = _align(xs[0], len(shape)), _align(xs[1], len(shape))
        if lengths is None:
            return fn(a, b)
        mask = _padding(lengths, a if aligned & 1 else b)
        if b_padding and aligned & 2:
            b = b.masked_fill(mask, b_padding)
        out = fn(a, b)
        return out if keeps_zeros(aligned) else out.masked_fill(mask, 0.0)

    op = Op(name, kernel, cheap=True, padded=True, result_length=True, rule="binary")
    return _core.Rule(op, doc=f"{name}(a, b): elementwise, NumPy broadcasting of the shapes.")


add = _binary("add", torch.add, keeps_zeros=lambda aligned: aligned == BOTH)
sub = _binary("sub", torch.sub, keeps_zeros=lambda aligned: aligned == BOTH)
cmult = mul = _binary("mul", torch.mul, keeps_zeros=lambda aligned: True)
cdiv = div = _binary("div", torch.div, keeps_zeros=lambda aligned: bool(aligned & 1),
                     b_padding=1.0)


# ---- products ----------------------------------------------------------------------------
def _matmul_kernel(xs, attr, shape, lengths):
    # Padded rows of a (or a padded contracted dim) are zeros: the padding of the product is
    # zeros too, and adds nothing to a contraction. (They are multiplied, and counted as FLOPs.)
    a, b = xs
    a_vec, b_vec = attr
    if a_vec and b_vec:  # dot product of two vectors
        out = (a * b).sum(-1)
    elif b_vec:  # matrix @ vector: a shared W gives ONE [B, n] x [n, m] product
        if a.shape[0] == 1:
            return kernels.linear(b, a.squeeze(0))  # counts its own FLOPs
        out = (a @ b.unsqueeze(-1)).squeeze(-1)
    elif a_vec:  # vector @ matrix
        out = a @ b.squeeze(0) if b.shape[0] == 1 else (a.unsqueeze(1) @ b).squeeze(1)
    else:  # matrix @ matrix, batched (bmm), broadcasting a shared operand
        out = torch.matmul(a, b)
    kernels.flops.add(out.numel(), a.shape[-1], a, b)  # each output: a dot over a's last axis
    return out


# Signature ("matmul", tag of a if a parameter, shape of a, shape of b); attr (a is a vector,
# b is a vector). Padded unless a parameter fixes the length: the leading dim of an expression
# matrix a (`M_i @ q`, M_i of n_i rows) and the length of a vector a times an expression b
# (`weights_i @ M_i`) are left out of the signature.
MATMUL = Op("matmul", _matmul_kernel, padded=True, rule="matmul")
matmul = _core.Rule(MATMUL, doc="matmul(a, b): `a @ b` for vectors and matrices (per instance), "
                                "as `torch.matmul`.")


def _affine_kernel(xs, attr, shape):
    w, x, b = xs
    if w.shape[0] == 1 and b.shape[0] == 1:
        return kernels.linear(x, w.squeeze(0), b.squeeze(0))
    out = (w @ x.unsqueeze(-1)).squeeze(-1)
    kernels.flops.add(out.numel(), x.shape[-1], w, x)
    return out + b


# Signature ("affine", tag of W, tag of b, shape of W, shape of x).
AFFINE = Op("affine", _affine_kernel, rule="affine")
affine = _core.Rule(AFFINE, doc="affine(W, x, b): `W @ x + b` as one node (one `addmm` per batch).")


# ---- lists ---------------------------------------------------------------------------------
def _segments(x: torch.Tensor, lengths: np.ndarray) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The flat `[sum of arities, ...]` argument of a ragged batch, and the row of each element
    (None when every node has the same arity: then `x` is reshaped to `[B, k, ...]`)."""
    total = int(lengths.sum())
    x = x.expand(total, *x.shape[1:])  # one shared node read once for all
    if (lengths == lengths[0]).all():
        return x.reshape(len(lengths), int(lengths[0]), *x.shape[1:]), None
    rows = torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths)).to(x.device)
    return x, rows


def _esum_kernel(xs, lengths, shape):
    x, rows = _segments(xs[0], lengths)
    if rows is None:
        return x.sum(1)
    return x.new_zeros(len(lengths), *shape).index_add_(0, rows, x)


def _average_kernel(xs, lengths, shape):
    count = torch.as_tensor(lengths, dtype=xs[0].dtype, device=xs[0].device)
    return _esum_kernel(xs, lengths, shape) / count.reshape(-1, *([1] * len(shape)))


def _per_node(x: torch.Tensor, lengths: np.ndarray, fill: float) -> torch.Tensor:
    """The flat argument of a ragged batch as `[B, longest, ...]`: a reshape when every node has
    the same arity, else one gather that pads each node's items with `fill` (a value the
    reduction ignores: -inf for a max, 0 for a weighted sum)."""
    total, longest = int(lengths.sum()), int(lengths.max())
    x = x.expand(total, *x.shape[1:])  # one shared node read once for all
    if (lengths == longest).all():
        return x.reshape(len(lengths), longest, *x.shape[1:])
    slots = np.arange(longest)
    rows = (np.cumsum(lengths) - lengths)[:, None] + slots
    rows[slots >= lengths[:, None]] = total  # the fill row
    padded = torch.cat([x, x.new_full((1, *x.shape[1:]), fill)])
    return padded.index_select(0, _index(rows.reshape(-1), x)).reshape(
        len(lengths), longest, *x.shape[1:])


def _attention_kernel(stride: int):
    """Dot-product attention of each node's query (its first item) over its keys (and values,
    interleaved after it when `stride` is 2): a masked softmax over the padded keys."""
    def kernel(xs, lengths, shape):
        items = _per_node(xs[0], lengths, 0.0)
        query, keys = items[:, 0], items[:, 1::stride]
        values = items[:, 2::2] if stride == 2 else keys
        scores = (keys @ query.unsqueeze(-1)).squeeze(-1)
        count = (lengths - 1) // stride
        # Two products (scores, weighted sum) of one dot per real key each; padding is not
        # the model's work.
        kernels.flops.add(2 * int(count.sum()), query.shape[-1], items)
        if (count < count.max()).any():
            padding = np.arange(int(count.max())) >= count[:, None]
            scores = scores.masked_fill(torch.from_numpy(padding).to(scores.device), -math.inf)
        return (torch.softmax(scores, 1).unsqueeze(1) @ values).squeeze(1)
    return kernel


@dataclass(frozen=True, eq=False)
class RaggedOp(Op):
    """A ragged op whose first `fixed` arguments are not part of its list: the executor reads
    them as a plain op's, one argument each (a child-sum cell's input and parameters), and
    gives the kernel the flat list after them (nothing when every list of the batch is empty)."""

    ragged: bool = True
    fixed: int = 0


# Ragged (see the module docstring): kernels get the flat items and each node's list length.
# Signature (name, item shape). Attention's items are the query, then the keys (interleaved
# with the values when given).
ESUM = Op("esum", _esum_kernel, ragged=True, rule="list")
AVERAGE = Op("average", _average_kernel, ragged=True, rule="list")
EMAX = Op("emax", lambda xs, lengths, shape: _per_node(xs[0], lengths, -math.inf).max(1).values,
          ragged=True, rule="list")
LOGSUMEXP = Op("logsumexp", lambda xs, lengths, shape: torch.logsumexp(
    _per_node(xs[0], lengths, -math.inf), 1), ragged=True, rule="list")
ATTENTION = Op("attention", _attention_kernel(1), ragged=True, rule="list")
ATTENTION_KV = Op("attention_kv", _attention_kernel(2), ragged=True, rule="list")
esum = _core.Rule(ESUM, doc="esum(xs): the sum of a list of expressions of equal shape (one "
                            "stacked gather, one sum).")
average = _core.Rule(AVERAGE, doc="average(xs): the mean of a list of expressions of equal shape.")
emax = _core.Rule(EMAX, doc="emax(xs): elementwise maximum of a list of expressions.")
logsumexp = _core.Rule(LOGSUMEXP, doc="logsumexp(xs): elementwise `log(sum(exp(x)))` over a list "
                                      "of expressions of equal shape, computed stably.")
_attention = _core.Rule(ATTENTION)
_attention_kv = _core.Rule(ATTENTION_KV)


@_core.own_time
def attention(keys: Sequence[Operand], query: Operand,
              values: Sequence[Operand] | None = None) -> Expression:
    """Dot-product attention: `sum_j softmax_j(k_j . q) v_j` over a list of key vectors (the
    values are the keys unless given), one node; any number of keys batch as one kernel."""
    keys = list(keys)
    if not keys:
        raise ValueError("attention: needs at least one key")
    g = graph_of(query, keys)
    q = node(g, query)
    if len(g.shape_of(q)) != 1:
        raise ShapeError(f"attention: the query must be a vector, got shape {g.shape_of(q)}")
    if values is None:
        return _attention([Expression(g, q), *keys])
    values = list(values)
    if len(values) != len(keys):
        raise ValueError(f"attention: {len(keys)} keys but {len(values)} values")
    return _attention_kv([Expression(g, q), *(x for pair in zip(keys, values) for x in pair)])


# Signature ("stack", (n, *item shape)): any number of items, stored padded with zeros.
STACK = Op("stack", lambda xs, lengths, shape: _per_node(xs[0], lengths, 0.0), ragged=True,
           cheap=True, rule="stack")
stack = _core.Rule(STACK, doc="""stack(xs): the expressions of `xs` (of equal shape) as the rows of
one tensor of shape (len(xs), *shape), as `torch.stack`: a matrix of vectors, the keys of an
attention. Stacks of any number of rows batch as one kernel.""")


def _concat_kernel(xs, dim, shape):
    if len(xs) == 1 and xs[0].dim() == len(shape) + 2:  # stacked [B, k, n, ...] along dim 0
        x = xs[0]
        return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])
    size = max(x.shape[0] for x in xs)
    return torch.cat([x.expand(size, *x.shape[1:]) for x in xs], dim + 1)


# Signature ("concat", input shapes, dim); attr dim. Equal shapes along dim 0 are gathered as
# one stacked tensor and reshaped (CONCAT), others are read one argument each.
CONCAT = Op("concat", _concat_kernel, stack_from=8, cheap=True, rule="concat")
_CONCAT_POSITIONAL = Op("concat", _concat_kernel, cheap=True, rule="concat")
concat = _core.Rule(CONCAT, positional=_CONCAT_POSITIONAL,
                    doc="concat(xs, dim=0): concatenate along `dim` (per-instance dims; 0 for "
                        "vectors).")


# ---- reductions and losses -------------------------------------------------------------------
def _reduction(name: str, fn: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]):
    """A scalar of each node's elements, `fn(x flat, count)`. Padded: of a length-led input it
    batches across lengths; the padding is zeros, which add nothing, and `count` is each
    node's own number of elements (None when they are equal)."""
    def kernel(xs, attr, shape, lengths=None):
        x = xs[0].reshape(xs[0].shape[0], -1)
        if lengths is None:
            return fn(x, None)
        row = math.prod(xs[0].shape[2:])
        return fn(x, torch.as_tensor(lengths * row, dtype=x.dtype, device=x.device))

    op = Op(name, kernel, padded=True, rule="reduce")
    return _core.Rule(op, doc=f"{name}(x): a scalar per instance.")


sum_elems = _reduction("sum_elems", lambda x, count: x.sum(1))
mean_elems = _reduction("mean_elems",
                        lambda x, count: x.mean(1) if count is None else x.sum(1) / count)
squared_norm = _reduction("squared_norm", lambda x, count: (x * x).sum(1))


@_core.own_time
def dot(a: Operand, b: Operand) -> Expression:
    """The dot product of two vectors of equal length, as `torch.dot`."""
    g = graph_of(a, b)
    na, nb = node(g, a), node(g, b)
    sa, sb = g.shape_of(na), g.shape_of(nb)
    if len(sa) != 1 or sa != sb:
        raise ShapeError(f"dot: needs two vectors of equal length, got shapes {sa} and {sb}")
    return matmul(Expression(g, na), Expression(g, nb))


@_core.own_time
def squared_distance(a: Operand, b: Operand) -> Expression:
    return squared_norm(sub(a, b))


def _padding(lengths: np.ndarray, x: torch.Tensor) -> torch.Tensor:
    """`[B, longest, 1, ...]` (as many dims as `x`): True where a node's rows of `x` (its
    vector's elements, its matrix's rows) are padding."""
    mask = torch.from_numpy(np.arange(x.shape[1]) >= lengths[:, None]).to(x.device)
    return mask.view(*mask.shape, *([1] * (x.dim() - 2)))


def _softmax(name: str, fn: Callable[[torch.Tensor, int], torch.Tensor]):
    def kernel(xs, attr, shape, lengths):
        if lengths is None:
            return fn(xs[0], -1)
        # -inf: the padding gets no weight; then zeros in the result's padding.
        padding = _padding(lengths, xs[0])
        return fn(xs[0].masked_fill(padding, -math.inf), -1).masked_fill(padding, 0.0)

    return _core.Rule(Op(name, kernel, padded=True, rule="vector"))


# Padded: vectors of any length in one batch. Signature (name, (n,)).
_softmax_vector = _softmax("softmax", torch.softmax)
_log_softmax_vector = _softmax("log_softmax", torch.log_softmax)


@_core.own_time
def log_softmax(x: Operand | Sequence[Operand]) -> Expression | list[Expression]:
    """log_softmax(x) of a vector; of a list of scalars (any number: a softmax over source
    positions or candidates), the list `x_j - logsumexp(x)`."""
    if isinstance(x, (list, tuple)):
        total = logsumexp(x)
        return [sub(s, total) for s in x]
    return _log_softmax_vector(x)


@_core.own_time
def softmax(x: Operand | Sequence[Operand]) -> Expression | list[Expression]:
    """softmax(x) of a vector; of a list of scalars, the list `exp(x_j - logsumexp(x))`."""
    if isinstance(x, (list, tuple)):
        return [exp(s) for s in log_softmax(x)]
    return _softmax_vector(x)


def _pick_kernel(xs, attr, shape, lengths=None):
    x, (_, index) = xs[0], attr
    rows = torch.arange(len(index), device=x.device)
    return x.expand(len(index), *x.shape[1:])[rows, _index(index, x)]


def _pnls_kernel(xs, attr, shape, lengths):
    _, label = attr
    x = xs[0].expand(len(label), *xs[0].shape[1:])
    if lengths is not None:
        x = x.masked_fill(_padding(lengths, x), -math.inf)
    # One call for log_softmax and the pick: the same values and gradients, bit for bit, as
    # `-log_softmax(x).gather(label)`, with 1 autograd node instead of 4 (per-forward cost).
    return F.cross_entropy(x, _index(label, x), reduction="none")


# Signature (name, shape of x); attr the index, checked and made non-negative at the call.
# pick_neg_log_softmax is padded: (name, (n,)) for vectors of any length.
# A pick runs as ONE index of the result its inputs are rows of (`picks_from_input`,
# execution._run_picked), not as a gather of the inputs and then the kernel's index: the parser's
# hinge losses pick from rows of the previous step's scores, 23 -> 16 us a launch (one per
# forward; its gradient is the same sum into zeros, in the same order).
PICK = Op("pick", _pick_kernel, per_node_attrs=True, cheap=True, padded=True, rule="pick",
          picks_from_input=True)
PICK_NLS = Op("pick_neg_log_softmax", _pnls_kernel, per_node_attrs=True, padded=True,
              rule="pick_nls")
pick = _core.Rule(PICK, doc="pick(x, i): element (or row) `i` of `x`: `x[i]` along the first "
                            "per-instance dim.")


def _pick_nls_of_list(x: Sequence[Operand], label: int) -> Expression:
    label = _integer("pick_neg_log_softmax", label)
    # Checked before any node is added, and named: Python's own error for the list would be a
    # bare "list index out of range" from inside flybatch.
    if not -len(x) <= label < len(x):
        raise IndexError(f"pick_neg_log_softmax: index {label} out of range for a list of "
                         f"{len(x)} scores")
    return sub(logsumexp(x), x[label])


# A C rule (a loss per tree node is a call per node), whose list case is the function above.
pick_neg_log_softmax = _core.Rule(PICK_NLS, lists=_pick_nls_of_list, doc="""\
pick_neg_log_softmax(x, label): `-log(softmax(x)[label])`, the cross-entropy loss of one
instance: one fused kernel for a vector; for a list of scalars (a variable number of
candidates), `logsumexp(x) - x[label]`.""")


def _integer(name: str, index: Any) -> int:
    """An index as an int; a float or bool index is a bug at the caller, not a row number (the
    rules call this for an index that is not a plain int)."""
    if isinstance(index, torch.Tensor) and index.numel() == 1 and not index.is_floating_point() \
            and index.dtype != torch.bool:
        return int(index)
    if isinstance(index, (numbers.Integral, np.integer)) and not isinstance(index, (bool, np.bool_)):
        return int(index)
    raise TypeError(f"{name}: the index must be an integer, got {index!r}")


# ---- shape ops ---------------------------------------------------------------------------------
# Signature ("slice", shape of x, begin, end); attr (begin, end), as `slice.indices` makes them.
SLICE = Op("slice", lambda xs, bounds, shape: xs[0][:, bounds[0]:bounds[1]], cheap=True,
           rule="slice")
slice_rows = _core.Rule(SLICE, doc="slice_rows(x, start, stop): `x[start:stop]` along the first "
                                   "per-instance dim (a view, no copy).")


@_core.own_time
def reshape(x: Operand, shape: int | Sequence[int]) -> Expression:
    """`x`'s elements in a new shape; one size may be -1, inferred from the others as in torch."""
    g, n = unary_operand(x)
    old, asked = g.shape_of(n), _as_shape("reshape", shape, inferred=1)
    size, known = math.prod(old), math.prod(d for d in asked if d != -1)
    # With no other elements (known == 0) a -1 could be any size: it stays, and is an error.
    new = tuple(size // known if d == -1 else d for d in asked) if known else asked
    if -1 in new or math.prod(new) != size:
        raise ShapeError(f"reshape: cannot reshape {old} into {asked}")
    return g.add(RESHAPE, (n,), new, ("reshape", old, new))


RESHAPE = Op("reshape", lambda xs, attr, shape: xs[0].reshape(xs[0].shape[0], *shape), cheap=True)
TRANSPOSE = Op("transpose", lambda xs, attr, shape: xs[0].transpose(1, 2), cheap=True)


@_core.own_time
def transpose(x: Operand) -> Expression:
    """The transpose of a matrix."""
    g, n = unary_operand(x)
    shape = g.shape_of(n)
    if len(shape) != 2:
        raise ShapeError(f"transpose: needs a matrix, got shape {shape}")
    return g.add(TRANSPOSE, (n,), (shape[1], shape[0]), ("transpose", shape))


# Dropout draws its mask when the node is written, with the very call eager PyTorch makes
# (`torch.dropout` of a tensor of the instance's shape, dtype and device): the same seed gives
# the same masks as eagerly, in program order, whatever the strategy and however the nodes
# batch (a mask drawn by the kernel for a whole batch would take the random stream in batch
# order). The node multiplies by the scaled mask, `x * noise`, as eager's dropout does.
DROPOUT = Op("dropout", lambda xs, attr, shape: xs[0] * xs[1])


@_core.own_time
def dropout(x: Operand, p: float, training: bool = True,
            noise: torch.Tensor | None = None) -> Expression:
    """Zero each element with probability `p` and scale the rest by 1/(1-p), as `F.dropout`.

    Every dropout node draws its own mask, when it is written (so a seeded program draws the
    masks eager PyTorch draws), unless given its `noise` (the scaled mask, drawn by
    `dropout_noise` for more than this node: `nn.LSTM` draws one for a layer's whole output).
    With `training=False` or `p=0` it is the identity (returns `x` itself, as `F.dropout`
    returns its input).
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout: p must be in [0, 1), got {p}")
    g, n = unary_operand(x)
    shape = g.shape_of(n)
    if not training or p == 0.0 or math.prod(shape) == 0:  # eager returns its input: no draw
        return x if isinstance(x, Expression) else Expression(g, n)
    if noise is None:
        noise = dropout_noise(shape, p, g.dtype_of(n), g.device)
    elif tuple(noise.shape) != shape:
        raise ShapeError(f"dropout: a mask of shape {tuple(noise.shape)} for shape {shape}")
    return g.add(DROPOUT, (n, g.input_node(noise, owned=True)), shape, ("dropout", shape))


def dropout_noise(shape: Shape, p: float, dtype: torch.dtype,
                  device: torch.device | str | None) -> torch.Tensor:
    """The scaled mask eager `F.dropout` draws for a tensor of `shape`, by the same calls, so
    that it takes the same numbers from the same generator: on the CPU, aten's dropout draws
    `empty_like(x).bernoulli_(1 - p).div_(1 - p)`; elsewhere its fused kernel, here run on
    ones."""
    device = torch.device(device or "cpu")
    with torch._C.DisableTorchFunction():
        if device.type == "cpu":
            return torch.empty(shape, dtype=dtype).bernoulli_(1 - p).div_(1 - p)
        return torch.dropout(torch.ones(shape, dtype=dtype, device=device), p, True)


# ---- operators on expressions -------------------------------------------------------------------
# `+ - * / @`, unary `-`, `x[i]` (pick) and `x[a:b]` (slice_rows) are C slots of the Expression
# type calling these rules (either side may be a number, tensor or ndarray).
_core.set_operators(add, sub, mul, div, matmul, neg, pick, slice_rows)
_INDEX_TYPES = (numbers.Integral, np.integer, np.bool_)  # what `x[i]` picks by


def _rows(x: Expression):
    """Iterating an expression yields its rows `x[0], x[1]...`, as iterating a tensor does
    (`for h_t in lstm_out:`); a scalar is not iterable, as in torch. (Without `__iter__`,
    Python would iterate through `__getitem__` until an IndexError.)"""
    if not x.shape:
        raise TypeError("iteration over a 0-d expression")
    return (x[i] for i in range(x.shape[0]))


Expression.__iter__ = _rows
# Without it NumPy takes an Expression for a scalar object and applies `ndarray + x` element by
# element (an object array of expressions); None makes NumPy defer to `x.__radd__` and the like.
Expression.__array_ufunc__ = None
# Torch functions on expressions (`W @ h` with a tensor on the left, `torch.tanh(x)`, any other)
# go through `Expression.__torch_function__`, which capture/dispatch.py defines.
