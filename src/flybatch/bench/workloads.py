"""Dynamic graphs unlike the five benchmark tasks: the model families of the autobatching
literature (ED-Batch, ACRoBat, Cavs, TensorFlow Fold), written here from their descriptions.

Every family is per-instance code written ONCE against a backend namespace `B` (`flybatch`, or
the tests' eager twin with the same names), so the same code measures batching quality
(`python -m flybatch.bench quality`) and is checked against eager PyTorch (tests/test_workloads.py).
A family is `Family(name, make_params, make_instance, loss)`: `make_instance(rng)` draws one
instance's structure (a tree, a lattice, a DAG...), `loss(B, params, instance)` writes its graph.
Structures are plain Python data drawn from a seeded `random.Random`, so both backends see the
same instances.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..nn import TreeLSTMCell

H = 8       # hidden size
VOCAB = 20
LABELS = 3


@dataclass(frozen=True)
class Family:
    name: str
    make_instance: Callable[[random.Random], Any]
    loss: Callable[[Any, dict, Any], Any]
    value_requests: bool = False  # asks for values mid-instance: run under map_batched


class Params(dict):
    """The parameters by name, and the `fb.nn` modules built over them (`module`), one per
    parameter set so that every instance's nodes of a module share its signature."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.modules: dict[str, torch.nn.Module] = {}

    def module(self, name: str, make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        if name not in self.modules:
            self.modules[name] = make()
        return self.modules[name]


def make_params(dtype: torch.dtype = torch.float32, seed: int = 0) -> Params:
    """One parameter set shared by every family (each uses the names it needs)."""
    gen = torch.Generator().manual_seed(seed)

    def p(*shape: int) -> torch.nn.Parameter:
        scale = 1.0 / max(1, shape[-1]) ** 0.5
        return torch.nn.Parameter((torch.randn(*shape, generator=gen, dtype=torch.float64)
                                   * scale).to(dtype))

    names = {
        "E": (VOCAB, H), "Wz": (H, 2 * H), "Wr": (H, 2 * H), "Wh": (H, 2 * H), "bz": (H,),
        "bh": (H,), "M1": (H, H), "m1": (H,), "M2": (LABELS, H), "W_in": (4 * H, H),
        "W_rec": (4 * H, H), "b_g": (4 * H,), "Wf": (H, H), "Uf": (H, H), "bf": (H,),
        "W_add": (H, 2 * H), "W_sub": (H, 2 * H), "W_mul": (H, 2 * H), "W_max": (H, 2 * H),
        "b_op": (H,), "A": (H, H), "Bm": (H, H), "W_comp": (H, 2 * H), "b_comp": (H,),
        "W_track": (H, 3 * H), "b_track": (H,), "W_iou": (3 * H, H), "U_iou": (3 * H, H),
        "b_iou": (3 * H,), "W_exit": (1, H), "Wa": (H, H), "Ua": (H, H), "va": (H,),
    }
    return Params((name, p(*shape)) for name, shape in names.items())


# ---- shared pieces -------------------------------------------------------------------------
def _mlp_loss(B, P, h, label: int):
    """The per-node classifier of tree models: a hidden layer and a softmax loss."""
    return B.pick_neg_log_softmax(B.matmul(P["M2"], B.tanh(B.affine(P["M1"], h, P["m1"]))), label)


def _random_tree(rng: random.Random, size: int):
    """A random binary tree over `size` leaves: a word id, or a (left, right) pair."""
    if size == 1:
        return rng.randrange(VOCAB)
    left = rng.randint(1, size - 1)
    return (_random_tree(rng, left), _random_tree(rng, size - left))


# ---- Tree-GRU with a per-node MLP ----------------------------------------------------------------
def _tree_gru(B, P, tree, losses: list):
    if isinstance(tree, int):
        h = B.lookup(P["E"], tree)
    else:
        hl, hr = _tree_gru(B, P, tree[0], losses), _tree_gru(B, P, tree[1], losses)
        x = B.concat([hl, hr])
        z = B.sigmoid(B.affine(P["Wz"], x, P["bz"]))
        r = B.sigmoid(B.matmul(P["Wr"], x))
        cand = B.tanh(B.affine(P["Wh"], B.concat([r * hl, r * hr]), P["bh"]))
        h = z * hl + (1.0 - z) * cand
    losses.append(_mlp_loss(B, P, h, len(losses) % LABELS))
    return h


def tree_gru_loss(B, P, tree):
    losses: list = []
    _tree_gru(B, P, tree, losses)
    return B.esum(losses)


# ---- lattice LSTM ----------------------------------------------------------------------------------
def make_lattice(rng: random.Random):
    """A word lattice: positions 0..n, an edge per character and some multi-character words;
    each position's state averages the states of the edges that end there."""
    n = rng.randint(3, 9)
    edges = [(i, i + 1, rng.randrange(VOCAB)) for i in range(n)]
    edges += [(i, i + k, rng.randrange(VOCAB)) for i in range(n) for k in (2, 3)
              if i + k <= n and rng.random() < 0.35]
    return n, sorted(edges, key=lambda e: e[1])


def _lstm_step(B, P, x, h, c):
    gates = B.affine(P["W_in"], x, P["b_g"]) + B.matmul(P["W_rec"], h)
    i, f = B.sigmoid(gates[0:H]), B.sigmoid(gates[H:2 * H])
    g, o = B.tanh(gates[2 * H:3 * H]), B.sigmoid(gates[3 * H:4 * H])
    c = f * c + i * g
    return o * B.tanh(c), c


def lattice_loss(B, P, lattice):
    n, edges = lattice
    states = {0: (B.zeros(H), B.zeros(H))}
    arriving: dict[int, list] = {}
    for start, end, word in edges:  # sorted by end: a position is final before it is left
        if start not in states:
            hs, cs = zip(*arriving[start])
            states[start] = (B.average(list(hs)), B.average(list(cs)))
        arriving.setdefault(end, []).append(_lstm_step(B, P, B.lookup(P["E"], word),
                                                       *states[start]))
    hs = [h for h, _ in arriving[n]]
    return B.pick_neg_log_softmax(B.matmul(P["M2"], B.average(hs)), n % LABELS)


# ---- random DAG of mixed ops ----------------------------------------------------------------
def make_dag(rng: random.Random):
    n = rng.randint(4, 14)
    return [(rng.choice(("tanh", "sigmoid", "add", "mul", "A", "Bm", "comp")),
             rng.randrange(VOCAB), [rng.randrange(i + 1) for _ in range(2)]) for i in range(n)]


def dag_loss(B, P, dag):
    values = [B.lookup(P["E"], dag[0][1])]
    for op, word, (a, b) in dag:
        x, y = values[a], values[b]
        if op in ("tanh", "sigmoid"):
            out = getattr(B, op)(x + B.lookup(P["E"], word))
        elif op == "add":
            out = x + y
        elif op == "mul":
            out = x * B.tanh(y)
        elif op == "comp":
            out = B.tanh(B.affine(P["W_comp"], B.concat([x, y]), P["b_comp"]))
        else:
            out = B.tanh(B.matmul(P[op], x))
        values.append(out)
    return B.sum_elems(B.esum(values[1:]))


# ---- expression-tree calculator: an operator type per node ----------------------------------------
def make_expression(rng: random.Random):
    def draw(depth: int):
        if depth == 0 or rng.random() < 0.3:
            return rng.randrange(VOCAB)
        return (rng.choice(("add", "sub", "mul", "max")), draw(depth - 1), draw(depth - 1))
    return draw(rng.randint(1, 5)), rng.randrange(LABELS)


def _evaluate(B, P, tree):
    if isinstance(tree, int):
        return B.lookup(P["E"], tree)
    op, left, right = tree
    x = B.concat([_evaluate(B, P, left), _evaluate(B, P, right)])
    return B.tanh(B.affine(P["W_" + op], x, P["b_op"]))


def calculator_loss(B, P, instance):
    tree, label = instance
    return _mlp_loss(B, P, _evaluate(B, P, tree), label)


# ---- SPINN: shift-reduce over a stack with a tracker ------------------------------------------
def make_transitions(rng: random.Random):
    """A valid shift/reduce sequence over a random binary tree (its post-order)."""
    out: list = []

    def walk(t):
        if isinstance(t, int):
            out.append(("shift", t))
        else:
            walk(t[0])
            walk(t[1])
            out.append(("reduce", None))
    walk(_random_tree(rng, rng.randint(2, 9)))
    return out


def spinn_loss(B, P, transitions):
    stack: list = []
    buffer_top = B.zeros(H)
    tracker = B.zeros(H)
    for kind, word in transitions:
        top = stack[-1] if stack else B.zeros(H)
        second = stack[-2] if len(stack) > 1 else B.zeros(H)
        tracker = B.tanh(B.affine(P["W_track"], B.concat([top, second, buffer_top]),
                                  P["b_track"]) + tracker)
        if kind == "shift":
            buffer_top = B.lookup(P["E"], word)
            stack.append(buffer_top)
        else:
            right, left = stack.pop(), stack.pop()
            stack.append(B.tanh(B.affine(P["W_comp"], B.concat([left, right]), P["b_comp"])
                                + tracker))
    return _mlp_loss(B, P, stack[-1], len(transitions) % LABELS)


# ---- child-sum Tree-LSTM over 0-4 children ------------------------------------------------------
def make_nary_tree(rng: random.Random, depth: int = 4):
    arity = 0 if depth == 0 else rng.choice((0, 1, 2, 2, 3, 4))
    return rng.randrange(VOCAB), [make_nary_tree(rng, depth - 1) for _ in range(arity)]


def _child_sum(B, P, tree, losses: list):
    word, children = tree
    x = B.lookup(P["E"], word)
    states = [_child_sum(B, P, child, losses) for child in children]
    if states:
        h_sum = B.esum([h for h, _ in states])
        iou = B.affine(P["W_iou"], x, P["b_iou"]) + B.matmul(P["U_iou"], h_sum)
    else:
        iou = B.affine(P["W_iou"], x, P["b_iou"])
    i, o, u = B.sigmoid(iou[0:H]), B.sigmoid(iou[H:2 * H]), B.tanh(iou[2 * H:3 * H])
    c = i * u
    if states:
        fx = B.affine(P["Wf"], x, P["bf"])
        c = c + B.esum([B.sigmoid(fx + B.matmul(P["Uf"], h)) * ck for h, ck in states])
    h = o * B.tanh(c)
    losses.append(_mlp_loss(B, P, h, word % LABELS))
    return h, c


def child_sum_loss(B, P, tree):
    losses: list = []
    _child_sum(B, P, tree, losses)
    return B.esum(losses)


# ---- the same with flybatch's fused child-sum cell (fb.nn.TreeLSTMCell) --------------------------
def _child_sum_cell(B, P):
    """`fb.nn.TreeLSTMCell(child_sum=True)` over P's tensors (its eager twin for the eager
    backend): one fused node per tree node, whatever its number of children."""
    def make():
        with torch.random.fork_rng(devices=[]):  # its own initialisation, replaced below
            cell = TreeLSTMCell(H, H, child_sum=True)
        for name, key in (("W_iou", "W_iou"), ("U_iou", "U_iou"), ("b_iou", "b_iou"),
                          ("W_f", "Wf"), ("U_f", "Uf"), ("b_f", "bf")):
            setattr(cell, name, P[key])
        return cell
    cell = P.module("child_sum_cell", make)
    return B.twin(cell) if hasattr(B, "twin") else cell


def child_sum_cell_loss(B, P, tree):
    cell, losses = _child_sum_cell(B, P), []

    def encode(node):
        word, children = node
        state = cell([encode(child) for child in children], B.lookup(P["E"], word))
        losses.append(_mlp_loss(B, P, state.h, word % LABELS))
        return state
    encode(tree)
    return B.esum(losses)


# ---- tree-to-sequence with attention over the tree's nodes ----------------------------------
def make_tree_to_sequence(rng: random.Random):
    return (_random_tree(rng, rng.randint(2, 9)),
            [rng.randrange(LABELS) for _ in range(rng.randint(1, 5))])


def tree_to_sequence_loss(B, P, instance):
    """A tree encoder whose node states (3 to 17 of them) a decoder attends over at every step
    (Eriguchi et al. 2016): the number of source positions varies per instance."""
    tree, target = instance
    memory: list = []

    def encode(t):
        if isinstance(t, int):
            h = B.lookup(P["E"], t)
        else:
            h = B.tanh(B.affine(P["W_comp"], B.concat([encode(t[0]), encode(t[1])]), P["b_comp"]))
        memory.append(h)
        return h
    h = encode(tree)
    losses = []
    for label in target:
        context = B.attention(memory, h)
        h = B.tanh(B.affine(P["M1"], h, P["m1"]) + B.matmul(P["A"], context))
        losses.append(B.pick_neg_log_softmax(B.matmul(P["M2"], h), label))
    return B.esum(losses)


# ---- a decoder with additive attention over a sentence ----------------------------------------
def make_translation(rng: random.Random):
    return ([rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))],
            [rng.randrange(LABELS) for _ in range(rng.randint(1, 5))])


def bahdanau_loss(B, P, instance):
    """A decoder with additive attention (Bahdanau et al. 2015) over the states of a sentence
    of 1 to 9 words: at each step the scores `tanh(K Wa + s Ua) va` of its n source positions
    (an (n, H) matrix plus a broadcast row, elementwise), their softmax and the context."""
    source, target = instance
    keys = B.stack([B.tanh(B.affine(P["M1"], B.lookup(P["E"], w), P["m1"])) for w in source])
    projected = B.matmul(keys, P["Wa"])  # K Wa: once per sentence, (n, H)
    s = B.tanh(B.matmul(P["A"], B.lookup(P["E"], source[-1])))
    losses = []
    for label in target:
        scores = B.matmul(B.tanh(projected + B.matmul(s, P["Ua"])), P["va"])
        context = B.matmul(B.softmax(scores), keys)
        s = B.tanh(B.affine(P["M1"], s, P["m1"]) + B.matmul(P["Bm"], context))
        losses.append(B.pick_neg_log_softmax(B.matmul(P["M2"], s), label))
    return B.esum(losses)


# ---- hierarchical RNN: words per sentence, then sentences ------------------------------------
def make_document(rng: random.Random):
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
            for _ in range(rng.randint(1, 4))]


def document_loss(B, P, document):
    h_doc, c_doc = B.zeros(H), B.zeros(H)
    for sentence in document:
        h, c = B.zeros(H), B.zeros(H)
        for word in sentence:
            h, c = _lstm_step(B, P, B.lookup(P["E"], word), h, c)
        h_doc, c_doc = _lstm_step(B, P, h, h_doc, c_doc)
    return B.pick_neg_log_softmax(B.matmul(P["M2"], h_doc), len(document) % LABELS)


# ---- early exit: a value-dependent number of steps (map_batched) ----------------------------
def make_early_exit(rng: random.Random):
    return [rng.randrange(VOCAB) for _ in range(rng.randint(2, 8))]


def early_exit_loss(B, P, words):
    """An RNN that stops reading once its exit score says so (asks for a value each step)."""
    h = B.zeros(H)
    for word in words:
        h = B.tanh(B.affine(P["M1"], h, P["m1"]) + B.lookup(P["E"], word))
        if _value(B.sum_elems(B.matmul(P["W_exit"], h))).item() > 0.5:
            break
    return B.pick_neg_log_softmax(B.matmul(P["M2"], h), len(words) % LABELS)


def _value(x):
    return x.value() if hasattr(x, "value") else x


# ---- n-ary trees whose nodes pick among several op types --------------------------------------
def make_mixed_op_tree(rng: random.Random, depth: int = 4):
    """A tree of 0-3 children per node; each inner node draws its combining op (a sum, a max or
    a gated pair of its children), so one tree level mixes ops, arities and leaves."""
    arity = 0 if depth == 0 else rng.choice((0, 1, 2, 2, 3))
    op = rng.choice(("sum", "max", "pair")) if arity >= 2 else "one"
    return op, rng.randrange(VOCAB), [make_mixed_op_tree(rng, depth - 1) for _ in range(arity)]


def mixed_op_tree_loss(B, P, tree):
    def encode(node):
        op, word, children = node
        if not children:
            return B.lookup(P["E"], word)
        hs = [encode(child) for child in children]
        if op == "one":
            return B.tanh(B.matmul(P["A"], hs[0]) + B.lookup(P["E"], word))
        if op == "sum":
            return B.tanh(B.affine(P["Wf"], B.esum(hs), P["bf"]))
        if op == "max":
            return B.relu(B.affine(P["M1"], B.emax(hs), P["m1"]))
        gate = B.sigmoid(B.matmul(P["Bm"], hs[-1]))
        return gate * B.tanh(B.affine(P["W_comp"], B.concat(hs[:2]), P["b_comp"]))
    return B.pick_neg_log_softmax(B.matmul(P["M2"], encode(tree)), tree[1] % LABELS)


# ---- a recurrent chain with long skip connections ----------------------------------------
def make_skip_chain(rng: random.Random):
    """Per step a word and, at random steps, a skip from a state 2-8 steps back: paths through
    the chain meet the skip ops at different positions in every instance."""
    n = rng.randint(3, 14)
    return [(rng.randrange(VOCAB), rng.randint(2, 8) if t >= 2 and rng.random() < 0.4 else 0)
            for t in range(n)]


def skip_chain_loss(B, P, steps):
    states = [B.zeros(H)]
    for word, back in steps:
        h = B.affine(P["M1"], states[-1], P["m1"]) + B.lookup(P["E"], word)
        if back:  # a long skip: the state `back` steps ago, projected, joins this one
            h = h + B.tanh(B.matmul(P["A"], states[max(0, len(states) - back)]))
        states.append(B.tanh(h))
    return B.pick_neg_log_softmax(B.matmul(P["M2"], B.average(states[1:])), len(steps) % LABELS)


# ---- iterative refinement until converged, per instance (map_batched) ---------------------------
def make_refinement(rng: random.Random):
    return rng.randrange(VOCAB), rng.randint(1, 7), rng.randrange(LABELS)


def refinement_loss(B, P, instance):
    """Refines a state until its update is small or it has run its own number of iterations
    (1-7); the size of each update is asked for as a value, so instances stop at different
    iterations and the rest go on."""
    word, most, label = instance
    x = B.lookup(P["E"], word)
    h = B.tanh(B.matmul(P["Bm"], x))
    for _ in range(most):
        update = B.tanh(B.matmul(P["A"], h) + B.affine(P["Wf"], x, P["bf"])) - h
        h = h + 0.5 * update
        if _value(B.squared_norm(update)).item() < 0.3:
            break
    return B.pick_neg_log_softmax(B.matmul(P["M2"], h), label)


# ---- beam search: every kept hypothesis fans out, the best survive (map_batched) -------------
def make_beam(rng: random.Random):
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))]
            for _ in range(rng.randint(1, 4))]


def beam_loss(B, P, steps):
    """A beam of up to 2 hypotheses: at each step every hypothesis extends by each of that
    step's 1-3 candidate words, each extension is scored (a value request), and the 2 best
    survive; the loss sums the survivors' losses at the end."""
    beam = [B.tanh(B.matmul(P["Bm"], B.lookup(P["E"], 0)))]
    for words in steps:
        grown = [B.tanh(B.affine(P["M1"], h, P["m1"]) + B.lookup(P["E"], w))
                 for h in beam for w in words]
        scores = [_value(B.dot(P["va"], h)).item() for h in grown]
        ranked = sorted(range(len(grown)), key=lambda i: -scores[i])
        beam = [grown[i] for i in ranked[:2]]
    return B.esum([B.pick_neg_log_softmax(B.matmul(P["M2"], h), k) for k, h in enumerate(beam)])


# ---- a 2-D grid RNN over per-instance grids of different sizes --------------------------------
def make_grid(rng: random.Random):
    """A grid of 1-4 rows by 1-5 columns of word ids (an image patch, a table)."""
    rows, cols = rng.randint(1, 4), rng.randint(1, 5)
    return [[rng.randrange(VOCAB) for _ in range(cols)] for _ in range(rows)]


def grid_rnn_loss(B, P, grid):
    """Cell (i, j) reads the cells above and to its left (zeros at the borders), so a cell's
    depth is i + j: anti-diagonals of grids of different shapes line up, and the cells of the
    first row and column take a different op (no state from outside) at every depth."""
    rows, cols = len(grid), len(grid[0])
    h: dict = {}
    for i in range(rows):
        for j in range(cols):
            x = B.lookup(P["E"], grid[i][j])
            if i == 0 and j == 0:
                h[i, j] = B.tanh(B.affine(P["M1"], x, P["m1"]))
            elif i == 0 or j == 0:  # one neighbour: the border rule
                h[i, j] = B.tanh(B.matmul(P["A"], h[i - 1, j] if i else h[i, j - 1]) + x)
            else:
                both = B.concat([h[i - 1, j], h[i, j - 1]])
                h[i, j] = B.tanh(B.affine(P["W_comp"], both, P["b_comp"]) + x)
    return B.pick_neg_log_softmax(B.matmul(P["M2"], h[rows - 1, cols - 1]), (rows * cols) % LABELS)


# ---- a graph network: per-instance message passing on random graphs ----------------------------
def make_message_graph(rng: random.Random):
    """2-7 nodes with a word each, random directed edges, and 1-3 rounds of message passing."""
    n = rng.randint(2, 7)
    edges = [(u, v) for u in range(n) for v in range(n) if u != v and rng.random() < 0.3]
    return [rng.randrange(VOCAB) for _ in range(n)], edges, rng.randint(1, 3)


def message_passing_loss(B, P, graph):
    """Each round, every node sums the messages `tanh(A h_u)` of its in-neighbours (a node with
    none keeps its state through a different op) and updates with a GRU-like gate; the readout
    takes the max over nodes. Nodes of one round have different in-degrees (esum of any
    length) and the instances different numbers of rounds."""
    words, edges, rounds = graph
    h = [B.tanh(B.lookup(P["E"], w)) for w in words]
    for _ in range(rounds):
        messages = [B.tanh(B.matmul(P["A"], hu)) for hu in h]
        incoming: dict[int, list] = {}
        for u, v in edges:
            incoming.setdefault(v, []).append(messages[u])
        new = []
        for v, hv in enumerate(h):
            if v not in incoming:
                new.append(B.tanh(B.affine(P["Wf"], hv, P["bf"])))
                continue
            m = B.esum(incoming[v])
            z = B.sigmoid(B.affine(P["Wz"], B.concat([hv, m]), P["bz"]))
            new.append(z * hv + (1.0 - z) * B.tanh(B.matmul(P["Bm"], m)))
        h = new
    return B.pick_neg_log_softmax(B.matmul(P["M2"], B.emax(h)), len(edges) % LABELS)


# ---- a multi-task model: per-instance heads of different op sequences ------------------------
def make_multi_task(rng: random.Random):
    return rng.randrange(3), [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]


def multi_task_loss(B, P, instance):
    """A shared RNN encoder over 1-6 words, then the instance's task picks its head: a
    classifier (2 ops), a gated refinement (5 ops) or a 2-step decoder whose steps reuse the
    encoder's cell. The same op types (tanh, the encoder's product) appear at very different
    depths in different instances."""
    task, words = instance
    h = B.zeros(H)
    for w in words:
        h = B.tanh(B.affine(P["M1"], h, P["m1"]) + B.lookup(P["E"], w))
    if task == 0:
        return B.pick_neg_log_softmax(B.matmul(P["M2"], B.relu(B.matmul(P["A"], h))), 0)
    if task == 1:
        gate = B.sigmoid(B.matmul(P["Bm"], h))
        h = gate * B.tanh(B.affine(P["Wf"], h, P["bf"])) + (1.0 - gate) * h
        return B.pick_neg_log_softmax(B.matmul(P["M2"], h), 1)
    losses = []
    for label in (1, 2):
        h = B.tanh(B.affine(P["M1"], h, P["m1"]) + B.lookup(P["E"], label))
        losses.append(B.pick_neg_log_softmax(B.matmul(P["M2"], h), label))
    return B.esum(losses)


FAMILIES = (
    Family("tree-gru-mlp", lambda rng: _random_tree(rng, rng.randint(2, 9)), tree_gru_loss),
    Family("lattice-lstm", make_lattice, lattice_loss),
    Family("random-dag", make_dag, dag_loss),
    Family("calculator", make_expression, calculator_loss),
    Family("spinn", make_transitions, spinn_loss),
    Family("child-sum-treelstm", make_nary_tree, child_sum_loss),
    Family("child-sum-cell", make_nary_tree, child_sum_cell_loss),
    Family("tree-to-seq-attention", make_tree_to_sequence, tree_to_sequence_loss),
    Family("bahdanau-attention", make_translation, bahdanau_loss),
    Family("hierarchical-rnn", make_document, document_loss),
    Family("early-exit", make_early_exit, early_exit_loss, value_requests=True),
    Family("mixed-op-tree", make_mixed_op_tree, mixed_op_tree_loss),
    Family("skip-chain", make_skip_chain, skip_chain_loss),
    Family("refinement", make_refinement, refinement_loss, value_requests=True),
    Family("beam-search", make_beam, beam_loss, value_requests=True),
    Family("grid-rnn", make_grid, grid_rnn_loss),
    Family("message-passing", make_message_graph, message_passing_loss),
    Family("multi-task", make_multi_task, multi_task_loss),
)


def family(name: str) -> Family:
    return next(f for f in FAMILIES if f.name == name)


def instances(fam: Family, n: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    return [fam.make_instance(rng) for _ in range(n)]


def build(fb, fam: Family, params: dict, items: list) -> list:
    """The per-instance losses of `items` in the current graph (map_batched if the family asks
    for values)."""
    if fam.value_requests:
        return fb.map_batched(lambda item: fam.loss(fb, params, item), items)
    return [fam.loss(fb, params, item) for item in items]
