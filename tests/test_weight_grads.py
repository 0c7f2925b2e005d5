"""A shared weight's gradient is ONE product per backward, over every launch that used it.

Each batched product with a shared weight (and each fused Tree-LSTM cell) hands its (dY, X) to
the weight's `WeightGrad`, whose autograd node runs after all of them and computes
dW = [dY_1; ...]^T [X_1; ...] once (weight_grads.py). These tests hold the gradients to eager
PyTorch's (float64) under every strategy and through torch.autograd's other calls
(retain_graph, autograd.grad, inputs=, create_graph, hooks, backward over part of a graph),
and count the products.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import flybatch as fb
from flybatch import kernels, tree_lstm, weight_grads
from flybatch.graph import STRATEGIES

F64 = torch.float64
LENGTHS = (3, 1, 5, 2)


class Elman(nn.Module):
    """h_t = tanh(W [h_{t-1}; x_t] + b), a score U h_T: W is used by one launch per step."""

    def __init__(self, dtype: torch.dtype = F64):
        super().__init__()
        torch.manual_seed(0)
        self.cell = nn.Linear(7, 4, dtype=dtype)
        self.out = nn.Linear(4, 2, bias=False, dtype=dtype)

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(4, dtype=xs.dtype)
        for x in xs:
            h = torch.tanh(self.cell(torch.cat([h, x])))
        return (self.out(h) ** 2).sum()


@pytest.fixture(autouse=True)
def defer_every_weight(monkeypatch):
    """The models here are small: defer the gradients of weights of any size."""
    monkeypatch.setattr(weight_grads, "DEFER_MIN_ELEMENTS", 1)


def _sequences(requires_grad: bool = False) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(n, 3, generator=gen, dtype=F64, requires_grad=requires_grad)
            for n in LENGTHS]


def _grads(model: nn.Module) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def _eager(model: nn.Module, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    sum(model(x) for x in xs).backward()
    return _grads(model)


def _assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-9)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_weight_gets_its_gradient_from_one_product_however_many_launches_used_it(strategy):
    model, xs = Elman(), _sequences()
    want = _eager(model, xs)
    launches, products = (weight_grads.deferred_counts[k] for k in ("launches", "products"))
    with fb.Graph(strategy=strategy):
        sum(model(x) for x in xs).backward()
    # One launch per step at least (the longest sequence's 5 steps), every strategy.
    assert weight_grads.deferred_counts["launches"] - launches >= max(LENGTHS) + 1
    # The cell's weight and the output's: one product each (biases: a column sum per launch).
    assert weight_grads.deferred_counts["products"] - products == 2
    _assert_equal(_grads(model), want)


def test_a_second_backward_with_retain_graph_adds_the_gradients_again():
    model, xs = Elman(), _sequences()
    want = [2 * g for g in _eager(model, xs)]
    products = weight_grads.deferred_counts["products"]
    with fb.Graph():
        loss = sum(model(x) for x in xs)
        loss.backward(retain_graph=True)
        loss.backward()
    assert weight_grads.deferred_counts["products"] - products == 4
    _assert_equal(_grads(model), want)


def test_autograd_grad_of_the_inputs_only_leaves_nothing_behind_for_the_next_backward():
    model, xs = Elman(), _sequences(requires_grad=True)
    want_x = torch.autograd.grad(sum(model(x) for x in xs), xs)
    want = _eager(model, xs)
    products = weight_grads.deferred_counts["products"]
    with fb.Graph():
        loss = sum(model(x) for x in xs)
        got_x = torch.autograd.grad(loss, xs, retain_graph=True)
        # no weight's gradient asked for, none computed
        assert weight_grads.deferred_counts["products"] == products
        loss.backward()
    _assert_equal(got_x, want_x)
    _assert_equal(_grads(model), want)


def test_autograd_grad_of_some_parameters_runs_their_products_only():
    model, xs = Elman(), _sequences()
    want = torch.autograd.grad(sum(model(x) for x in xs), [model.out.weight])
    products = weight_grads.deferred_counts["products"]
    with fb.Graph():
        got = torch.autograd.grad(sum(model(x) for x in xs), [model.out.weight])
    assert weight_grads.deferred_counts["products"] - products == 1
    assert all(p.grad is None for p in model.parameters())
    _assert_equal(got, want)


def test_backward_into_chosen_inputs_sets_only_their_gradients():
    model, xs = Elman(), _sequences()
    sum(model(x) for x in xs).backward(inputs=[model.cell.bias])
    want = model.cell.bias.grad.clone()
    model.zero_grad(set_to_none=True)
    with fb.Graph():
        sum(model(x) for x in xs).backward(inputs=[model.cell.bias])
    torch.testing.assert_close(model.cell.bias.grad, want, rtol=0, atol=1e-9)
    assert model.cell.weight.grad is None and model.out.weight.grad is None


def test_backwards_of_separate_forwards_each_take_their_own_launches():
    model, xs = Elman(), _sequences()
    want = _eager(model, xs)
    with fb.Graph():
        first = sum(model(x) for x in xs[:2])
        first.item()  # a forward of its own: the second loss's launches are others
        second = sum(model(x) for x in xs[2:])
        second.item()
        first.backward()
        second.backward()
    _assert_equal(_grads(model), want)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_gradient_penalty_on_the_weights_is_eager_double_backward(strategy):
    model, xs = Elman(), _sequences()

    def penalised():
        loss = sum(model(x) for x in xs)
        grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        (loss + sum((g ** 2).sum() for g in grads)).backward()

    penalised()
    want = _grads(model)
    with fb.Graph(strategy=strategy):
        penalised()
    _assert_equal(_grads(model), want)


def test_a_hook_on_a_parameter_sees_the_total_gradient_once():
    model, xs = Elman(), _sequences()
    seen = []
    handle = model.cell.weight.register_hook(lambda g: seen.append(g.clone()))
    want = _eager(model, xs)
    with fb.Graph():
        sum(model(x) for x in xs).backward()
    handle.remove()
    assert len(seen) == 2
    torch.testing.assert_close(seen[1], seen[0], rtol=0, atol=1e-9)
    _assert_equal(_grads(model), want)


def test_a_weight_also_used_eagerly_outside_the_graph_sums_both_gradients():
    model, xs = Elman(), _sequences()
    probe = torch.linspace(-1, 1, 7, dtype=F64)
    (model.cell(probe).sum() + sum(model(x) for x in xs)).backward()
    want = _grads(model)
    eager_part = model.cell(probe).sum()
    with fb.Graph():
        loss = sum(model(x) for x in xs)
        loss.backward()
    eager_part.backward()
    _assert_equal(_grads(model), want)


def test_without_grad_no_weight_gradient_is_made():
    model, xs = Elman(), _sequences()
    launches = weight_grads.deferred_counts["launches"]
    with torch.no_grad(), fb.Graph() as g:
        loss = sum(model(x) for x in xs)
        loss.item()
        assert g.weight_grads == {}
    assert weight_grads.deferred_counts["launches"] == launches


def test_an_optimizer_step_between_forwards_of_a_graph_is_seen_by_the_second():
    xs = _sequences()

    def train(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sum(model(x) for x in xs[:2]).backward()
        opt.step()
        model.zero_grad(set_to_none=True)
        sum(model(x) for x in xs[2:]).backward()
        return _grads(model)

    want = train(Elman())
    products = weight_grads.deferred_counts["products"]
    with fb.Graph():
        got = train(Elman())
    assert weight_grads.deferred_counts["products"] - products == 4  # two weights, two backwards
    _assert_equal(got, want)


def test_a_rebound_parameter_gets_a_weight_gradient_of_its_own():
    model, xs = Elman(), _sequences()
    sum(model(x) for x in xs[:2]).backward()
    with torch.no_grad():
        model.cell.weight.data = model.cell.weight.data * 0.5
    sum(model(x) for x in xs[2:]).backward()
    want = _grads(model)
    model = Elman()
    with fb.Graph() as g:
        sum(model(x) for x in xs[:2]).backward()
        with torch.no_grad():
            model.cell.weight.data = model.cell.weight.data * 0.5
        sum(model(x) for x in xs[2:]).backward()
        assert len(g.weight_grads) == 3  # the cell's weight before and after, the output's
    _assert_equal(_grads(model), want)


def test_an_in_place_write_before_backward_raises_as_eagerly():
    model, xs = Elman(), _sequences()
    with fb.Graph():
        loss = sum(model(x) for x in xs)
        loss.item()
        with torch.no_grad():
            model.cell.weight.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_on_the_onednn_path_the_gradients_are_eager_ones():
    before = kernels.get_gemm()
    kernels.set_gemm("onednn")
    try:
        model, xs = Elman(torch.float32), [x.float() for x in _sequences()]
        want = _eager(model, xs)
        onednn, products = kernels.gemm_counts["onednn"], weight_grads.deferred_counts["products"]
        with fb.Graph(strategy="agenda"):
            sum(model(x) for x in xs).backward()
        assert kernels.gemm_counts["onednn"] > onednn
        assert weight_grads.deferred_counts["products"] - products == 2
        for g, w in zip(_grads(model), want):
            torch.testing.assert_close(g, w)
    finally:
        kernels.set_gemm(before)


class _Doubled(torch.autograd.Function):
    """y = 2 x W^T with a hand-written backward that defers dW to the weight's WeightGrad."""

    @staticmethod
    def forward(ctx, x, w, token, weight_grad):
        ctx.save_for_backward(x, w)
        ctx.weight_grad = weight_grad
        return 2 * x @ w.T

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        ctx.weight_grad.add(2 * dy, x)
        return 2 * dy @ w, None, None, None


def test_a_hand_written_backward_hands_its_products_to_the_weights_gradient():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(5, 3, generator=gen, dtype=F64, requires_grad=True)
    xs = [torch.randn(n, 3, generator=gen, dtype=F64, requires_grad=True) for n in (1, 4, 2)]
    sum((2 * x @ w.T).sum() for x in xs).backward()
    want = [w.grad.clone()] + [x.grad.clone() for x in xs]
    w.grad = None
    for x in xs:
        x.grad = None
    products = weight_grads.deferred_counts["products"]
    with weight_grads.deferring({}):
        weight_grad = weight_grads.weight_grad_of(w)
        ys = [_Doubled.apply(x, w, weight_grad.token, weight_grad) for x in xs]
    sum(y.sum() for y in ys).backward()
    assert weight_grads.deferred_counts["products"] - products == 1
    _assert_equal([w.grad] + [x.grad for x in xs], want)


class _RaisingOnce(torch.autograd.Function):
    """The identity, whose backward raises the first time (a hook or kernel failing midway)."""

    raised = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, dx):
        if not _RaisingOnce.raised:
            _RaisingOnce.raised = True
            raise RuntimeError("a backward that fails midway")
        return dx


def test_what_a_backward_that_raised_handed_in_is_not_taken_by_the_next():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(5, 3, generator=gen, dtype=F64, requires_grad=True)
    xs = [torch.randn(n, 3, generator=gen, dtype=F64, requires_grad=True) for n in (2, 3)]
    sum((2 * x @ w.T).sum() for x in xs).backward()
    want = w.grad.clone()
    w.grad = None
    _RaisingOnce.raised = False
    with weight_grads.deferring({}):
        weight_grad = weight_grads.weight_grad_of(w)  # its node: the oldest, run last
        ys = [_Doubled.apply(_RaisingOnce.apply(x), w, weight_grad.token, weight_grad)
              for x in xs]
    loss = sum(y.sum() for y in ys)
    # The launches hand in, then the failing node (newer than the weight's) raises first.
    with pytest.raises(RuntimeError, match="fails midway"):
        loss.backward(retain_graph=True)
    assert w.grad is None
    loss.backward()
    _assert_equal([w.grad], [want])


def test_outside_a_graphs_execution_there_is_no_weight_gradient():
    assert weight_grads.weight_grad_of(torch.zeros(2, 2, requires_grad=True)) is None


# ---- the fused Tree-LSTM cells -------------------------------------------------------------------
TREES = [((0, 1), 2), (3, (4, (5, 0))), 1, ((2, 3), (4, 5))]
CHILD_SUM_TREES = [(0, 1, 2), ((3,), 4), 5, ((0, 1), (2, 3, 4), 5)]


def _tree_cell(child_sum: bool) -> fb.nn.TreeLSTMCell:
    torch.manual_seed(3)
    cell = fb.nn.TreeLSTMCell(3, 4, arity=2, child_sum=child_sum).double()
    with torch.no_grad():
        for p in cell.parameters():
            p.normal_(0, 0.5)
    return cell


def _encode(B, cell, tree, words, child_sum):
    """The root's state of `tree` (ints: leaves, tuples: nodes; a child-sum node reads an
    input too) by the cell, on fb (`B` = fb) or eagerly (`B` = the tests' eager module)."""
    if isinstance(tree, int):
        return cell.leaf(B.input(words[tree]))
    x = B.input(words[len(tree)]) if child_sum else None
    return cell([_encode(B, cell, t, words, child_sum) for t in tree], x)


@pytest.mark.parametrize("gemm, dtype", [("default", F64), ("onednn", torch.float32)],
                         ids=["float64", "float32-onednn"])
@pytest.mark.parametrize("child_sum", [False, True], ids=["nary", "child-sum"])
@pytest.mark.parametrize("path", tree_lstm.TREE_LSTM_PATHS)
def test_a_tree_lstm_cells_weights_get_eagers_gradients_from_one_product_each(
        path, child_sum, gemm, dtype):
    import eager

    cell = _tree_cell(child_sum).to(dtype)
    trees = CHILD_SUM_TREES if child_sum else TREES
    gen = torch.Generator().manual_seed(4)
    words = [torch.randn(3, generator=gen, dtype=dtype) for _ in range(6)]
    params = list(cell.parameters())

    def build(B):
        blocks = cell if B is fb else eager.twin(cell)
        return [_encode(B, blocks, t, words, child_sum).h for t in trees]

    tree_before, gemm_before = tree_lstm.get_tree_lstm(), kernels.get_gemm()
    tree_lstm.set_tree_lstm(path)
    kernels.set_gemm(gemm)  # oneDNN takes float32 products only
    try:
        expected = eager.run(eager, "agenda", dtype, build, params)
        products = weight_grads.deferred_counts["products"]
        launches, onednn = tree_lstm.tree_lstm_counts[path], kernels.gemm_counts["onednn"]
        actual = eager.run(fb, "agenda", dtype, build, params)
        assert tree_lstm.tree_lstm_counts[path] > launches  # the cells ran on `path`
        assert (kernels.gemm_counts["onednn"] > onednn) == (gemm == "onednn")
    finally:
        tree_lstm.set_tree_lstm(tree_before)
        kernels.set_gemm(gemm_before)
    eager.assert_same(actual, expected, dtype)
    # N-ary: W_iou (leaves), U_iou, U_f[0], U_f[1]; child-sum: W_iou (leaves and nodes), U_iou,
    # W_f, U_f. One product each, however many tree levels launched the cell.
    assert weight_grads.deferred_counts["products"] - products == 4


def test_a_weight_below_the_size_threshold_keeps_its_gradient_per_launch(monkeypatch):
    monkeypatch.setattr(weight_grads, "DEFER_MIN_ELEMENTS", 7 * 4 + 1)  # the cell's W is 4 x 7
    model, xs = Elman(), _sequences()
    want = _eager(model, xs)
    products = weight_grads.deferred_counts["products"]
    with fb.Graph():
        sum(model(x) for x in xs).backward()
    assert weight_grads.deferred_counts["products"] == products
    _assert_equal(_grads(model), want)
