"""`fb.nn` blocks compute the textbook math, batched.

Each block is checked against its eager twin (tests/eager.py, written from the equations) under
every strategy, on instances of different shapes; LSTMCell, GRUCell and the LSTM are also
checked against torch.nn's own modules with copied weights.
"""

from __future__ import annotations

from copy import deepcopy

import numpy as np
import pytest
import torch

import eager
import flybatch as fb
from flybatch import lstm_layer, tree_lstm
from flybatch.graph import STRATEGIES

F64 = torch.float64
TOL = eager.TOLERANCE[F64]
IN, H = 4, 3


def seeded(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """A float64 module with reproducible, non-trivial weights."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=F64) * 0.5)
    return module


def inputs(n: int, size: int = IN, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=gen, dtype=F64) for _ in range(n)]


def same_as_eager(strategy, modules, per_instance, instances):
    """Run `per_instance(B, blocks, instance)` for every instance with flybatch and eagerly."""
    params = [p for m in modules for p in m.parameters()]

    def build(B):
        blocks = modules if B is fb else [eager.twin(m) for m in modules]
        return [o for inst in instances for o in per_instance(B, blocks, inst)]

    expected = eager.run(eager, strategy, F64, build, params)
    actual = eager.run(fb, strategy, F64, build, params)
    eager.assert_same(actual, expected, F64)


def lengths_batch(lengths, size=IN):
    return [inputs(n, size, seed=k) for k, n in enumerate(lengths)]


RAGGED = [1, 4, 2, 5, 3]


# ---- Linear, Embedding, MLP ---------------------------------------------------------------------
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_linear_is_w_x_plus_b(strategy, bias):
    linear = seeded(fb.nn.Linear(IN, H, bias=bias).double())
    same_as_eager(strategy, [linear], lambda B, m, xs: [m[0](B.input(x)) for x in xs],
                  lengths_batch(RAGGED))


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_embedding_is_a_row_of_its_table(strategy, sparse):
    emb = seeded(fb.nn.Embedding(7, IN, sparse=sparse).double())
    same_as_eager(strategy, [emb], lambda B, m, ws: [m[0](w) for w in ws],
                  [[0, 3, 3], [6], [1, 2, 0, 3]])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_mlp_applies_layers_with_activation_between(strategy):
    mlp = seeded(fb.nn.MLP([IN, 5, 4, 2], activation=fb.relu).double())
    same_as_eager(strategy, [mlp], lambda B, m, xs: [m[0](B.input(x)) for x in xs],
                  lengths_batch(RAGGED))


def test_mlp_has_no_activation_after_the_last_layer():
    mlp = seeded(fb.nn.MLP([IN, 2], activation=fb.relu).double())
    x = torch.randn(IN, dtype=F64)
    with fb.Graph(dtype=F64):
        y = mlp(fb.input(x)).value()
    torch.testing.assert_close(y, mlp.layers[0].weight @ x + mlp.layers[0].bias)


# ---- recurrent cells against torch.nn ------------------------------------------------------------
def copy_lstm_cell(ours: fb.nn.LSTMCell) -> torch.nn.LSTMCell:
    """torch's LSTMCell with our weights: its two biases add up to our one bias."""
    theirs = torch.nn.LSTMCell(ours.input_size, ours.hidden_size).double()
    with torch.no_grad():
        theirs.weight_ih.copy_(ours.weight_ih)
        theirs.weight_hh.copy_(ours.weight_hh)
        theirs.bias_ih.copy_(ours.bias * 0.25)
        theirs.bias_hh.copy_(ours.bias * 0.75)
    return theirs


def run_cell_over_sequences(cell, sequences, recur):
    """Sum of weighted outputs over all steps of all sequences, with `recur(x, state)`."""
    gen = torch.Generator().manual_seed(7)
    total = 0
    for xs in sequences:
        state = None
        for x in xs:
            state = recur(x, state)
            for part in (state if isinstance(state, tuple) else (state,)):
                total = total + (part.reshape(-1) * torch.randn(H, generator=gen, dtype=F64)).sum()
    return total


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lstm_cell_equals_torch_lstm_cell_with_copied_weights(strategy):
    ours = seeded(fb.nn.LSTMCell(IN, H).double())
    theirs = copy_lstm_cell(ours)
    sequences = lengths_batch(RAGGED)

    def torch_step(x, state):
        h, c = theirs(x.unsqueeze(0), None if state is None else tuple(s.unsqueeze(0)
                                                                    for s in state))
        return h[0], c[0]

    expected = run_cell_over_sequences(theirs, sequences, torch_step)
    expected.backward()
    with fb.Graph(strategy=strategy, dtype=F64):
        def fb_step(x, state):
            state = ours(fb.input(x), state)
            return state.h, state.c
        gen = torch.Generator().manual_seed(7)
        parts = []
        for xs in sequences:
            state = None
            for x in xs:
                state = fb_step(x, state)
                parts += [fb.dot(s, torch.randn(H, generator=gen, dtype=F64)) for s in state]
        total = fb.esum(parts)
        total.backward()
        assert abs(total.item() - expected.item()) <= TOL * abs(expected.item())
    torch.testing.assert_close(ours.weight_ih.grad, theirs.weight_ih.grad, rtol=TOL, atol=TOL)
    torch.testing.assert_close(ours.weight_hh.grad, theirs.weight_hh.grad, rtol=TOL, atol=TOL)
    torch.testing.assert_close(ours.bias.grad, theirs.bias_ih.grad, rtol=TOL, atol=TOL)
    torch.testing.assert_close(ours.bias.grad, theirs.bias_hh.grad, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gru_cell_equals_torch_gru_cell_with_copied_weights(strategy):
    ours = seeded(fb.nn.GRUCell(IN, H).double())
    theirs = torch.nn.GRUCell(IN, H).double()
    theirs.load_state_dict(ours.state_dict())
    sequences = lengths_batch(RAGGED)

    def torch_step(x, h):
        return theirs(x.unsqueeze(0), None if h is None else h.unsqueeze(0))[0]

    expected = run_cell_over_sequences(theirs, sequences, torch_step)
    expected.backward()
    with fb.Graph(strategy=strategy, dtype=F64):
        gen = torch.Generator().manual_seed(7)
        parts = []
        for xs in sequences:
            h = None
            for x in xs:
                h = ours(fb.input(x), h)
                parts.append(fb.dot(h, torch.randn(H, generator=gen, dtype=F64)))
        total = fb.esum(parts)
        total.backward()
        assert abs(total.item() - expected.item()) <= TOL * abs(expected.item())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, getattr(theirs, name).grad, rtol=TOL, atol=TOL,
                                   msg=name)


def test_lstm_cell_starts_from_a_zero_state():
    cell = seeded(fb.nn.LSTMCell(IN, H).double())
    x = torch.randn(IN, dtype=F64)
    with fb.Graph(dtype=F64):
        default = cell(fb.input(x))
        explicit = cell(fb.input(x), (fb.zeros(H), fb.zeros(H)))
        for a, b in ((default.h, explicit.h), (default.c, explicit.c)):
            torch.testing.assert_close(a.value(), b.value(), rtol=0, atol=0)


# ---- LSTM: bidirectional, multi-layer ------------------------------------------------------------
def copy_lstm(ours: fb.nn.LSTM, num_layers: int) -> torch.nn.LSTM:
    theirs = torch.nn.LSTM(IN, H, num_layers=num_layers, bidirectional=ours.bidirectional).double()
    with torch.no_grad():
        for layer in range(num_layers):
            cells = [("", ours.forward_cells[layer])]
            if ours.bidirectional:
                cells.append(("_reverse", ours.backward_cells[layer]))
            for suffix, cell in cells:
                getattr(theirs, f"weight_ih_l{layer}{suffix}").copy_(cell.weight_ih)
                getattr(theirs, f"weight_hh_l{layer}{suffix}").copy_(cell.weight_hh)
                getattr(theirs, f"bias_ih_l{layer}{suffix}").copy_(cell.bias)
                getattr(theirs, f"bias_hh_l{layer}{suffix}").zero_()
    return theirs


@pytest.fixture(params=["onednn", "stepwise"])
def lstm_path(request):
    """Each test of fb.nn.LSTM runs on both kernels of its layers (flybatch/lstm_layer.py)."""
    before = lstm_layer.get_lstm()
    lstm_layer.set_lstm(request.param)
    yield request.param
    lstm_layer.set_lstm(before)


@pytest.mark.parametrize("layers, bidirectional", [(1, False), (2, False), (1, True), (2, True)],
                         ids=["1-layer", "2-layer", "1-layer-bi", "2-layer-bi"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lstm_equals_torch_lstm_with_copied_weights(strategy, layers, bidirectional, lstm_path):
    ours = seeded(fb.nn.LSTM(IN, H, num_layers=layers, bidirectional=bidirectional).double())
    theirs = copy_lstm(ours, layers)
    sequences = lengths_batch(RAGGED)
    with fb.Graph(strategy=strategy, dtype=F64) as g:
        outputs = [ours([fb.input(x) for x in xs]) for xs in sequences]
        got = [torch.stack(g.forward(out)) for out in outputs]
    for xs, out in zip(sequences, got):
        expected, _ = theirs(torch.stack(xs))
        torch.testing.assert_close(out, expected, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bidirectional_two_layer_lstm_gradients_match_eager(strategy, lstm_path):
    lstm = seeded(fb.nn.LSTM(IN, H, num_layers=2, bidirectional=True).double())
    same_as_eager(strategy, [lstm], lambda B, m, xs: m[0]([B.input(x) for x in xs]),
                  lengths_batch(RAGGED))


def test_lstm_length_groups_split_and_join_back_with_zeros_past_each_end():
    lengths = np.array([2, 9, 3, 8, 1])  # groups [9, 8], [3, 2], [1]: 8 and 2 run past their end
    x = torch.randn(5, 10, 3, dtype=F64)
    groups = lstm_layer._LengthGroups(lengths, 10, x.device)
    parts = groups.split(x)
    assert [tuple(p.shape) for p in parts] == [(2, 9, 3), (2, 3, 3), (1, 1, 3)]
    valid = torch.from_numpy(np.arange(10)[None, :] < lengths[:, None]).unsqueeze(-1)
    assert torch.equal(groups.join(parts), x * valid)


# ---- Tree-LSTMs ----------------------------------------------------------------------------------
@pytest.fixture(params=tree_lstm.TREE_LSTM_PATHS)
def tree_path(request):
    """Each test of an fb.nn.TreeLSTMCell runs on both kernels of its cells
    (flybatch/tree_lstm.py's fused ones, and torch ops), and "fused" must have run."""
    before, launches = tree_lstm.get_tree_lstm(), dict(tree_lstm.tree_lstm_counts)
    tree_lstm.set_tree_lstm(request.param)
    yield request.param
    tree_lstm.set_tree_lstm(before)
    assert tree_lstm.tree_lstm_counts[request.param] > launches[request.param]


BINARY_TREES = [0, (1, 2), ((3, 4), 5), (6, ((0, 1), (2, (3, 4)))), ((5, 6), (0, 1))]
NARY_TREES = [0, (1,), (2, 3, 4), ((5, 6), 0, (1, (2,), 3)), (((4,),),), (0, 1, 2, 3)]
WORDS = inputs(7, seed=3)


def nary_tree_lstm(B, blocks, tree, with_x=False):
    (cell,) = blocks
    outs = []

    def encode(t, depth=0):
        if isinstance(t, int):
            state = cell.leaf(B.input(WORDS[t]))
        else:
            x = B.input(WORDS[depth]) if with_x else None
            state = cell([encode(child, depth + 1) for child in t], x)
        outs.extend((state.h, state.c))
        return state

    encode(tree)
    return outs


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_binary_tree_lstm_matches_the_nary_equations(strategy, tree_path):
    cell = seeded(fb.nn.TreeLSTMCell(IN, H, arity=2).double())
    same_as_eager(strategy, [cell], nary_tree_lstm, BINARY_TREES)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_binary_tree_lstm_with_node_inputs_matches_the_nary_equations(strategy, tree_path):
    cell = seeded(fb.nn.TreeLSTMCell(IN, H, arity=2).double())
    same_as_eager(strategy, [cell],
                  lambda B, m, t: nary_tree_lstm(B, m, t, with_x=True), BINARY_TREES)


def ternary(tree):
    """Pad every internal node to three children (a leaf 0 fills the gaps)."""
    if isinstance(tree, int):
        return tree
    children = [ternary(c) for c in tree][:3]
    return tuple(children + [0] * (3 - len(children)))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ternary_tree_lstm_matches_the_nary_equations(strategy, tree_path):
    cell = seeded(fb.nn.TreeLSTMCell(IN, H, arity=3).double())
    same_as_eager(strategy, [cell], nary_tree_lstm, [ternary(t) for t in NARY_TREES])


def child_sum_tree_lstm(B, blocks, tree):
    (cell,) = blocks
    outs = []

    def encode(t, word):
        children = [] if isinstance(t, int) else [encode(c, k) for k, c in enumerate(t)]
        state = cell(children, B.input(WORDS[(t if isinstance(t, int) else word) % 7]))
        outs.extend((state.h, state.c))
        return state

    encode(tree, 6)
    return outs


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_child_sum_tree_lstm_matches_its_equations(strategy, tree_path):
    cell = seeded(fb.nn.TreeLSTMCell(IN, H, child_sum=True).double())
    same_as_eager(strategy, [cell], child_sum_tree_lstm, NARY_TREES)


def test_child_sum_leaf_is_a_node_without_children():
    cell = seeded(fb.nn.TreeLSTMCell(IN, H, child_sum=True).double())
    with fb.Graph(dtype=F64):
        x = fb.input(WORDS[0])
        a, b = cell.leaf(x), cell([], x)
        for s, t in ((a.h, b.h), (a.c, b.c)):
            torch.testing.assert_close(s.value(), t.value(), rtol=0, atol=0)


def test_nary_cell_rejects_the_wrong_number_of_children():
    cell = fb.nn.TreeLSTMCell(IN, H, arity=2)
    with fb.Graph():
        leaf = cell.leaf(fb.input(torch.randn(IN)))
        with pytest.raises(ValueError, match="arity"):
            cell([leaf])


def test_child_sum_cell_needs_the_node_input():
    cell = fb.nn.TreeLSTMCell(IN, H, child_sum=True)
    with fb.Graph():
        with pytest.raises(ValueError):
            cell([])


def test_nn_blocks_are_torch_modules_with_ordinary_parameters():
    model = torch.nn.ModuleList([fb.nn.Linear(2, 3), fb.nn.LSTMCell(2, 3), fb.nn.GRUCell(2, 3),
                                 fb.nn.TreeLSTMCell(2, 3), fb.nn.Embedding(4, 2),
                                 fb.nn.MLP([2, 3]), fb.nn.LSTM(2, 3, bidirectional=True)])
    state = model.state_dict()
    assert state and all(isinstance(v, torch.Tensor) for v in state.values())
    assert len(list(model.parameters())) == len(state)


@pytest.mark.parametrize("copy", ["deepcopy", "torch.save"])
def test_fused_cells_copied_or_saved_whole_compute_what_the_original_computes(copy, tmp_path):
    # A fused module describes its kinds of node once (FusedSpecs, held by the module), and
    # those must survive a deepcopy and a pickle of the whole module.
    cell = fb.nn.TreeLSTMCell(IN, H)
    if copy == "deepcopy":
        twin = deepcopy(cell)
    else:
        torch.save(cell, tmp_path / "cell.pt")
        twin = torch.load(tmp_path / "cell.pt", weights_only=False)
    x = torch.randn(IN)

    def root(c: fb.nn.TreeLSTMCell) -> torch.Tensor:
        with fb.Graph():
            return c([c.leaf(x), c.leaf(2 * x)]).h.value().detach()

    torch.testing.assert_close(root(twin), root(cell))


def test_a_state_reads_h_and_c_as_one_node_each_made_on_first_read():
    cell = fb.nn.TreeLSTMCell(IN, H)
    with fb.Graph() as g:
        state = cell.leaf(fb.input(torch.randn(IN)))
        before = g.n_nodes
        assert state.h is state.h and state.c is state.c
        assert g.n_nodes == before + 2
        torch.testing.assert_close(fb.concat([state.h, state.c]).value(), state.hc.value())


def test_building_with_fb_ops_and_modules_costs_no_capture_dispatch_per_op(monkeypatch):
    # Inside a graph block every torch call and tensor attribute read goes through the capture
    # mode (~2 us each). The fb path must not pay it per op: a few per graph (first use of each
    # parameter) at most, however many nodes are built.
    from flybatch import capture

    dispatched = []
    original = capture._Capture.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        dispatched.append(func)
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(capture._Capture, "__torch_function__", counting)
    torch.manual_seed(0)
    tree_cell, lstm_cell, gru_cell = fb.nn.TreeLSTMCell(IN, H), fb.nn.LSTMCell(IN, H), \
        fb.nn.GRUCell(IN, H)
    E, W, b = (torch.nn.Parameter(torch.randn(*s)) for s in ((10, IN), (H, H), (H,)))

    def build(n):
        with fb.Graph():
            for i in range(n):
                x = fb.lookup(E, i % 10)
                leaves = [tree_cell.leaf(x), tree_cell.leaf(x)]
                h = tree_cell(leaves).h + lstm_cell(x).h + gru_cell(x, fb.zeros(H))
                fb.pick_neg_log_softmax(fb.affine(W, fb.tanh(h), b), i % H)
        count = len(dispatched)
        dispatched.clear()
        return count

    assert build(50) == build(5)
