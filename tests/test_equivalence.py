"""Equivalence: batched execution computes exactly what the per-instance code says.

Every workload is per-instance code written ONCE against a backend namespace `B`, run with
`B = flybatch` under each strategy and with `B = eager` (plain PyTorch, one op at a time). The
values of every output and the gradient of every parameter must agree to 1e-10 (relative) in
float64 and 1e-5 in float32. Workloads: random DAGs mixing every op over several shapes (and
one DAG that uses every op), batches of sequences of different lengths, random binary and
n-ary trees.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import eager
import flybatch as fb
from flybatch.graph import STRATEGIES

DTYPES = (torch.float64, torch.float32)
VOCAB = 7


# ---- parameters and per-instance data ---------------------------------------------------------
@dataclass
class Params:
    E: torch.Tensor   # (VOCAB, 4) lookup table
    W: torch.Tensor   # (4, 3)
    V: torch.Tensor   # (3, 4)
    M: torch.Tensor   # (2, 3)
    b4: torch.Tensor  # (4,)
    b3: torch.Tensor  # (3,)
    u3: torch.Tensor  # (3,)

    def all(self) -> list[torch.Tensor]:
        return list(vars(self).values())


def parameter_maker(dtype: torch.dtype, device: str, seed: int, scale: float):
    """`p(*shape)`: seeded random Parameters, drawn in float64 so every dtype sees one stream."""
    gen = torch.Generator().manual_seed(seed)

    def p(*shape: int) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen, dtype=torch.float64) * scale
        return torch.nn.Parameter(t.to(device, dtype))

    return p


def make_params(dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> Params:
    p = parameter_maker(dtype, device, seed, 0.5)
    return Params(E=p(VOCAB, 4), W=p(4, 3), V=p(3, 4), M=p(2, 3), b4=p(4), b3=p(3), u3=p(3))


class InstanceData:
    """An instance's own inputs, word ids and labels: the same stream for both backends."""

    def __init__(self, seed: int, dtype: torch.dtype, device: str = "cpu"):
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype, self.device = dtype, device

    def tensor(self, *shape: int) -> torch.Tensor:
        t = torch.randn(shape, generator=self.gen, dtype=torch.float64)
        return t.to(self.device, self.dtype)

    def word(self) -> int:
        return self.rng.randrange(VOCAB)

    def index(self, n: int) -> int:
        """An index into n elements, negative half of the time (Python semantics)."""
        return self.rng.randrange(-n, n)


# ---- random DAGs -------------------------------------------------------------------------------
class Skip(Exception):
    """No operand of the needed shape is available: the instruction builds nothing."""


def shape_of(x) -> tuple[int, ...]:
    return tuple(x.shape)


def any_shape(s):
    return True


def vector(s):
    return len(s) == 1


def matrix(s):
    return len(s) == 2


def nonscalar(s):
    return len(s) >= 1


def exactly(shape):
    return lambda s: s == tuple(shape)


class Chooser:
    """Picks operands from the pool with an instruction's integers (structure, not data)."""

    def __init__(self, pool: list, ints: list[int]):
        self.pool, self.ints, self.k = pool, ints, 0

    def int(self) -> int:
        i = self.ints[self.k % len(self.ints)] + 7919 * (self.k // len(self.ints))
        self.k += 1
        return i

    def __call__(self, accept=any_shape):
        candidates = [x for x in self.pool if accept(shape_of(x))]
        if not candidates:
            raise Skip
        return candidates[self.int() % len(candidates)]


MAX_NUMEL = 16


def small(x):
    if shape_of(x) and torch.Size(shape_of(x)).numel() > MAX_NUMEL:
        raise Skip
    return x


def same_shape_list(c, n):
    first = c(any_shape)
    return [first] + [c(exactly(shape_of(first))) for _ in range(n - 1)]


def _slice(B, c, d):
    x = c(nonscalar)
    n = shape_of(x)[0]
    a = c.int() % n
    b = a + 1 + c.int() % (n - a)
    return x[a:b]


def _reshape(B, c, d):
    x = c(nonscalar)
    s = shape_of(x)
    numel = torch.Size(s).numel()
    if len(s) == 2 or numel % 2:
        return B.reshape(x, (numel,))
    return B.reshape(x, (2, numel // 2))


def _matmul(B, c, d):
    a = c(matrix)
    b = c(lambda s: 1 <= len(s) <= 2 and s[0] == shape_of(a)[1])
    return B.tanh(small(B.matmul(a, b)))


def _vecmat(B, c, d):
    a = c(vector)
    b = c(lambda s: matrix(s) and s[0] == shape_of(a)[0])
    return B.tanh(a @ b)


def _affine(B, c, d):
    w = c(matrix)
    x = c(exactly((shape_of(w)[1],)))
    b = c(exactly((shape_of(w)[0],)))
    return B.tanh(B.affine(w, x, b))


def _dot(B, c, d):
    a = c(vector)
    return B.tanh(B.dot(a, c(exactly(shape_of(a)))))


def _concat(B, c, d):
    return small(B.concat([c(vector) for _ in range(2 + c.int() % 2)]))


def _concat_matrices(B, c, d):
    dim = c.int() % 2
    a = c(matrix)
    other = [n for k, n in enumerate(shape_of(a)) if k != dim][0]
    b = c(lambda s: matrix(s) and s[1 - dim] == other)
    return small(B.concat([a, b], dim=dim))


def _concat_many(B, c, d):
    """Eight or more equal shapes: concat gathers them as ONE stacked copy."""
    xs = [c(exactly((2,)))] + [c(exactly((2,))) for _ in range(7 + c.int() % 2)]
    a = c.int() % 8
    return B.concat(xs)[a:a + 4]


def _stack(B, c, d):
    return small(B.stack(same_shape_list(c, 1 + c.int() % 4)))


def _attend(B, c, d):
    """Attention over the rows of an instance matrix (any number of them): M @ q, softmax,
    weights @ M."""
    m = c(matrix)
    weights = B.softmax(B.matmul(m, c(exactly((shape_of(m)[1],)))))
    return B.matmul(weights, m)


def _n_ary(name):
    def build(B, c, d):
        xs = same_shape_list(c, 1 + c.int() % 4)
        return B.tanh(getattr(B, name)(xs))
    return build


def _binary(name, squash=True):
    def build(B, c, d):
        a = c(any_shape)
        out = getattr(B, name)(a, c(exactly(shape_of(a))))
        return B.tanh(out) if squash else out
    return build


def _unary(name):
    return lambda B, c, d: getattr(B, name)(c(any_shape))


# Each op: name -> build(B, chooser, instance data) returning ONE new expression. Ops whose
# result can grow without bound are squashed by a tanh so that long random chains stay finite.
OPS = {
    # unary elementwise
    "tanh": _unary("tanh"),
    "sigmoid": _unary("sigmoid"),
    "logistic": _unary("logistic"),
    "relu": _unary("relu"),
    "rectify": _unary("rectify"),
    "abs": _unary("abs"),
    "neg": _unary("neg"),
    "square": lambda B, c, d: B.tanh(B.square(c())),
    "exp": lambda B, c, d: B.tanh(B.exp(c())),
    "log": lambda B, c, d: B.log(B.sigmoid(c())),
    "sqrt": lambda B, c, d: B.sqrt(B.sigmoid(c())),
    "dropout(p=0)": lambda B, c, d: B.dropout(c(), 0.0),
    # binary elementwise, same shapes and broadcasting
    "add": _binary("add", squash=False),
    "sub": _binary("sub", squash=False),
    "mul": _binary("mul"),
    "cmult": _binary("cmult"),
    "div": lambda B, c, d: B.div(c(), B.add(B.sigmoid(c(exactly(()))), 0.5)),
    "cdiv": lambda B, c, d: (
        lambda a: B.cdiv(a, B.add(B.sigmoid(c(exactly(shape_of(a)))), 0.5)))(c()),
    "add scalar + any": lambda B, c, d: B.tanh(B.add(c(exactly(())), c())),
    "row vector * matrix": lambda B, c, d: (
        lambda m: B.mul(c(exactly((shape_of(m)[1],))), m))(c(matrix)),
    "matrix - row vector": lambda B, c, d: (
        lambda m: B.sub(m, c(exactly((shape_of(m)[1],)))))(c(matrix)),
    "add ones": lambda B, c, d: (lambda x: B.tanh(x + B.ones(shape_of(x))))(c()),
    "sub zeros": lambda B, c, d: (lambda x: x - B.zeros(shape_of(x)))(c()),
    # operators, with numbers and tensors on either side
    "x + y": lambda B, c, d: (lambda a: B.tanh(a + c(exactly(shape_of(a)))))(c()),
    "x - y": lambda B, c, d: (lambda a: B.tanh(a - c(exactly(shape_of(a)))))(c()),
    "x * y": lambda B, c, d: (lambda a: B.tanh(a * c(exactly(shape_of(a)))))(c()),
    "x / (y*y + 1)": lambda B, c, d: (lambda a: a / (B.square(c(exactly(shape_of(a)))) + 1))(c()),
    "2 * x": lambda B, c, d: 2 * c(),
    "x * 0.5": lambda B, c, d: c() * 0.5,
    "1 - x": lambda B, c, d: 1 - c(),
    "x + 1": lambda B, c, d: c() + 1,
    "x / 3": lambda B, c, d: c() / 3,
    "-x": lambda B, c, d: -c(),
    "x + tensor": lambda B, c, d: (lambda x: x + d.tensor(*shape_of(x)))(c()),
    "tensor * x": lambda B, c, d: (lambda x: B.tanh(d.tensor(*shape_of(x)) * x))(c()),
    "parameter(b) + x": lambda B, c, d: B.parameter(P_OF[B].b3) + c(exactly((3,))),
    "b + x (tensor on the left)": lambda B, c, d: P_OF[B].b3 + c(exactly((3,))),
    "x[i]": lambda B, c, d: (lambda x: x[d.index(shape_of(x)[0])])(c(nonscalar)),
    "x[a:b]": _slice,
    "W @ x": lambda B, c, d: P_OF[B].W @ c(exactly((3,))),
    "x @ W": lambda B, c, d: c(exactly((4,))) @ P_OF[B].W,
    "M @ matrix": lambda B, c, d: B.tanh(B.matmul(P_OF[B].M, c(exactly((3, 2))))),
    "u . x": lambda B, c, d: B.tanh(P_OF[B].u3 @ c(exactly((3,)))),
    # products
    "matmul": _matmul,
    "vector @ matrix": _vecmat,
    "dot": _dot,
    "affine W": lambda B, c, d: B.affine(P_OF[B].W, c(exactly((3,))), P_OF[B].b4),
    "affine V": lambda B, c, d: B.affine(P_OF[B].V, c(exactly((4,))), P_OF[B].b3),
    "affine (instance matrix)": _affine,
    # lists
    "esum": _n_ary("esum"),
    "average": _n_ary("average"),
    "emax": _n_ary("emax"),
    "concat": _concat,
    "concat matrices": _concat_matrices,
    "concat of 8+": _concat_many,
    "stack": _stack,
    "attend": _attend,
    # reductions and losses
    "sum_elems": lambda B, c, d: B.tanh(B.sum_elems(c())),
    "mean_elems": lambda B, c, d: B.mean_elems(c()),
    "squared_norm": lambda B, c, d: B.tanh(B.squared_norm(c())),
    "squared_distance": lambda B, c, d: (
        lambda a: B.tanh(B.squared_distance(a, c(exactly(shape_of(a))))))(c()),
    "softmax": lambda B, c, d: B.softmax(c(vector)),
    "log_softmax": lambda B, c, d: B.log_softmax(c(vector)),
    "pick": lambda B, c, d: (lambda x: B.pick(x, d.index(shape_of(x)[0])))(c(nonscalar)),
    "pick_neg_log_softmax": lambda B, c, d: (
        lambda x: B.pick_neg_log_softmax(x, d.index(shape_of(x)[0])))(c(vector)),
    # shape ops
    "slice_rows": lambda B, c, d: (lambda x: B.slice_rows(x, 0, max(1, shape_of(x)[0] - 1)))(
        c(nonscalar)),
    "reshape": _reshape,
    "transpose": lambda B, c, d: B.transpose(c(matrix)),
    # leaves
    "lookup": lambda B, c, d: B.lookup(P_OF[B].E, d.word()),
    "input": lambda B, c, d: B.input(d.tensor(3)),
    "input from list": lambda B, c, d: B.input([float(v) for v in d.tensor(2)]),
}
OP_NAMES = sorted(OPS)
P_OF: dict = {}  # backend -> the Params its instances read (set by `dag_batch`)


def dag_instance(B, program, data: InstanceData, applied: set | None = None) -> list:
    """Interpret one instance's program; returns every expression it built."""
    pool = [B.input(data.tensor(2)), B.input(data.tensor(3)), B.input(data.tensor(4)),
            B.input(data.tensor(2, 3)), B.input(data.tensor()), B.lookup(P_OF[B].E, data.word())]
    for name, ints in program:
        try:
            pool.append(OPS[name](B, Chooser(pool, ints), data))
        except Skip:
            continue
        if applied is not None:
            applied.add(name)
    return pool


def dag_batch(programs, instances, dtype, device="cpu"):
    """The per-instance code of a batch: instance k runs programs[p][:length] on its own data."""
    params = make_params(dtype, device)

    def build(B):
        P_OF[B] = params
        outs = []
        for p, length, seed in instances:
            program = programs[p % len(programs)][:length]
            outs += dag_instance(B, program, InstanceData(seed, dtype, device))
        return outs

    return build, params.all()


instruction = st.tuples(st.sampled_from(OP_NAMES), st.lists(st.integers(0, 2**16), min_size=8,
                                                            max_size=8))
programs = st.lists(st.lists(instruction, min_size=1, max_size=10), min_size=1, max_size=3)
instances = st.lists(st.tuples(st.integers(0, 2), st.integers(1, 10), st.integers(0, 2**16)),
                     min_size=1, max_size=6)


def check(build, params, strategy, dtype, device="cpu"):
    expected = eager.run(eager, strategy, dtype, build, params, device)
    actual = eager.run(fb, strategy, dtype, build, params, device)
    eager.assert_same(actual, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=30)
@given(programs=programs, instances=instances)
def test_random_dags_match_eager_values_and_gradients(strategy, dtype, programs, instances):
    build, params = dag_batch(programs, instances, dtype)
    check(build, params, strategy, dtype)


EVERY_OP = [(name, [3 * k + 1, 5 * k + 2, 7 * k + 3, 11 * k, 13 * k + 4, 17 * k, 19 * k, 23 * k])
            for k, name in enumerate(OP_NAMES)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_dag_using_every_op_matches_eager(strategy, dtype):
    program = EVERY_OP + EVERY_OP[::-1]
    build, params = dag_batch([program], [(0, len(program), seed) for seed in range(4)], dtype)
    # The program really uses every op (an op is skipped only for want of an operand).
    applied: set = set()
    with eager.Graph(dtype=dtype):
        P_OF[eager] = make_params(dtype)
        dag_instance(eager, program, InstanceData(0, dtype), applied)
    assert applied == set(OPS)
    check(build, params, strategy, dtype)


# ---- sequences ---------------------------------------------------------------------------------
H = 3


@dataclass
class SeqParams:
    E: torch.Tensor   # (VOCAB, 4)
    Wg: torch.Tensor  # (4H, 4 + H): gates from [x; h]
    bg: torch.Tensor  # (4H,)
    Wr: torch.Tensor  # (H, 4 + H): a tanh RNN, the README's
    br: torch.Tensor  # (H,)
    U: torch.Tensor   # (5, 2H)

    def all(self):
        return list(vars(self).values())


def make_seq_params(dtype, device="cpu"):
    p = parameter_maker(dtype, device, 1, 0.4)
    return SeqParams(E=p(VOCAB, 4), Wg=p(4 * H, 4 + H), bg=p(4 * H), Wr=p(H, 4 + H), br=p(H),
                     U=p(5, 2 * H))


def sequence_instance(B, P: SeqParams, words: list[int], label: int) -> list:
    """An LSTM written with ops (affine, slices, gates) next to a tanh RNN; one loss at the end."""
    h = c = r = B.zeros(H)
    outs = []
    for w in words:
        x = B.lookup(P.E, w)
        gates = B.affine(P.Wg, B.concat([x, h]), P.bg)
        i, f, o = B.sigmoid(gates[0:H]), B.sigmoid(gates[H:2 * H]), B.sigmoid(gates[2 * H:3 * H])
        g = B.tanh(B.slice_rows(gates, 3 * H, 4 * H))
        c = f * c + i * g
        h = o * B.tanh(c)
        r = B.tanh(P.Wr @ B.concat([x, r]) + P.br)
        outs += [h, c, r]
    loss = B.pick_neg_log_softmax(P.U @ B.concat([h, r]), label)
    return outs + [loss]


sequences = st.lists(st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=7),
                               st.integers(0, 4)), min_size=1, max_size=6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=12)
@given(batch=sequences)
def test_sequences_of_different_lengths_match_eager(strategy, dtype, batch):
    P = make_seq_params(dtype)

    def build(B):
        return [o for words, label in batch for o in sequence_instance(B, P, words, label)]

    check(build, P.all(), strategy, dtype)


# ---- trees -------------------------------------------------------------------------------------
@dataclass
class TreeParams:
    E: torch.Tensor    # (VOCAB, 4)
    WL: torch.Tensor   # (H, 4) leaf projection
    bL: torch.Tensor   # (H,)
    W2: torch.Tensor   # (H, 2H) binary composition
    Ws: torch.Tensor   # (H, H) n-ary: from the sum of the children
    Wm: torch.Tensor   # (H, H) n-ary: from the elementwise max of the children
    b: torch.Tensor    # (H,)
    U: torch.Tensor    # (5, H)

    def all(self):
        return list(vars(self).values())


def make_tree_params(dtype, device="cpu"):
    p = parameter_maker(dtype, device, 2, 0.5)
    return TreeParams(E=p(VOCAB, 4), WL=p(H, 4), bL=p(H), W2=p(H, 2 * H), Ws=p(H, H), Wm=p(H, H),
                      b=p(H), U=p(5, H))


def tree_instance(B, P: TreeParams, tree, label: int) -> list:
    """A recursive net over a tree (int leaves, tuple internal nodes); every node's h, a loss."""
    outs = []

    def encode(t):
        if isinstance(t, int):
            h = B.tanh(B.affine(P.WL, B.lookup(P.E, t), P.bL))
        elif len(t) == 2:
            h = B.tanh(P.W2 @ B.concat([encode(t[0]), encode(t[1])]) + P.b)
        else:
            hs = [encode(child) for child in t]
            pooled = B.average(hs) if len(hs) % 2 else B.esum(hs)
            h = B.tanh(B.affine(P.Ws, pooled, P.b) + P.Wm @ B.emax(hs))
        outs.append(h)
        return h

    root = encode(tree)
    return outs + [B.pick_neg_log_softmax(P.U @ root, label)]


leaf = st.integers(0, VOCAB - 1)
binary_trees = st.recursive(leaf, lambda t: st.tuples(t, t), max_leaves=10)
nary_trees = st.recursive(leaf, lambda t: st.lists(t, min_size=1, max_size=4).map(tuple),
                          max_leaves=10)


def check_trees(batch, strategy, dtype):
    P = make_tree_params(dtype)

    def build(B):
        return [o for tree, label in batch for o in tree_instance(B, P, tree, label)]

    check(build, P.all(), strategy, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=12)
@given(batch=st.lists(st.tuples(binary_trees, st.integers(0, 4)), min_size=1, max_size=5))
def test_binary_trees_match_eager(strategy, dtype, batch):
    check_trees(batch, strategy, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=10)
@given(batch=st.lists(st.tuples(nary_trees, st.integers(0, 4)), min_size=1, max_size=5))
def test_nary_trees_match_eager(strategy, dtype, batch):
    check_trees(batch, strategy, dtype)


# ---- CUDA ----------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=10)
@given(programs=programs, instances=instances)
def test_random_dags_on_cuda_match_eager(strategy, dtype, programs, instances):
    build, params = dag_batch(programs, instances, dtype, device="cuda")
    check(build, params, strategy, dtype, device="cuda")


@cuda
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_dag_using_every_op_on_cuda_matches_eager(strategy):
    program = EVERY_OP + EVERY_OP[::-1]
    build, params = dag_batch([program], [(0, len(program), s) for s in range(4)],
                              torch.float64, device="cuda")
    check(build, params, strategy, torch.float64, device="cuda")
