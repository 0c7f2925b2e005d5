"""The fused Tree-LSTM cells (flybatch/tree_lstm.py) compute what the torch ops compute.

Their hand-written backward passes float64 gradcheck for each cell kind; a float32 launch
equals the torch-op launch, values, gradients and counted FLOPs; the core's own float32 tanh and
sigmoid are within a few ulp of float64's over tiny, moderate and huge inputs. The path rule
and the switch are specified here too. fb.nn.TreeLSTMCell's equivalence tests against eager
run on both paths (tests/test_nn.py, the `tree_path` fixture).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flybatch as fb
from flybatch import kernels, tree_lstm

D, H = 5, 4
F64 = torch.float64


def tensors(*shapes, dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=gen, dtype=dtype) * 0.7).requires_grad_() for s in shapes]


def nary_operands(n, with_x, rows=3, shared=(), dtype=F64, seed=0):
    """A launch's operands as fb.nn's kernel gets them: the children's [h; c] (one row for
    those in `shared`: a child every node reads), x if `with_x`, the parameters [1, ...]."""
    hcs = tensors(*[(1 if k in shared else rows, 2 * H) for k in range(n)], dtype=dtype,
                  seed=seed)
    params = tensors((1, 3 * H, n * H), (1, n, H, H), (1, 3 * H), (1, H), dtype=dtype,
                     seed=seed + 1)
    if with_x:
        x, w_iou = tensors((rows, D), (1, 3 * H, D), dtype=dtype, seed=seed + 2)
        return [*hcs, x, *params, w_iou]
    return [*hcs, *params]


def on_path(path, kernel, *args):
    before = tree_lstm.get_tree_lstm()
    tree_lstm.set_tree_lstm(path)
    try:
        return kernel(*args)
    finally:
        tree_lstm.set_tree_lstm(before)


def nary(path, xs, n, with_x):
    return on_path(path, fb.nn._nary_kernel, xs, (n, with_x), (2 * H,))


def leaf(path, xs):
    return on_path(path, fb.nn._tree_leaf_kernel, xs, None, (2 * H,))


# ---- gradients -----------------------------------------------------------------------------------
def test_leaf_passes_gradcheck_in_float64():
    x, w, b = tensors((3, D), (1, 3 * H, D), (1, 3 * H))
    assert torch.autograd.gradcheck(tree_lstm.Leaf.apply, (x, w, b))


NARY_CASES = {"binary": (2, False, ()), "ternary-with-x": (3, True, ()),
              "a-shared-child": (2, False, (1,)), "shared-children-with-x": (2, True, (0, 1))}


@pytest.mark.parametrize("n, with_x, shared", NARY_CASES.values(), ids=NARY_CASES.keys())
def test_nary_passes_gradcheck_in_float64(n, with_x, shared):
    xs = nary_operands(n, with_x, shared=shared)
    assert torch.autograd.gradcheck(lambda *xs: nary("fused", xs, n, with_x), xs)


def child_sum_operands(lengths, shared=False, dtype=F64, seed=0):
    """A child-sum launch's operands as fb.nn's kernel gets them: x, the parameters [1, ...],
    then every node's children's [h; c], flat (one row every child is, if `shared`)."""
    children = 1 if shared else sum(lengths)
    return tensors((len(lengths), D), (1, 3 * H, D), (1, 3 * H, H), (1, H, D), (1, H, H),
                   (1, 3 * H), (1, H), *([(children, 2 * H)] if sum(lengths) else []),
                   dtype=dtype, seed=seed)


def child_sum(path, xs, lengths):
    return on_path(path, fb.nn._child_sum_kernel, xs, np.array(lengths), (2 * H,))


CHILD_SUM_CASES = {"ragged": ([2, 0, 3, 1], False), "a-shared-child": ([1, 2], True),
                   "no-children": ([0, 0], False)}


@pytest.mark.parametrize("lengths, shared", CHILD_SUM_CASES.values(), ids=CHILD_SUM_CASES.keys())
def test_child_sum_passes_gradcheck_in_float64(lengths, shared):
    xs = child_sum_operands(lengths, shared)
    assert torch.autograd.gradcheck(lambda *xs: child_sum("fused", xs, lengths), xs)


@pytest.mark.parametrize("lengths, shared", CHILD_SUM_CASES.values(), ids=CHILD_SUM_CASES.keys())
def test_a_float32_child_sum_launch_equals_the_torch_ops_launch(lengths, shared):
    xs = child_sum_operands(lengths, shared, dtype=torch.float32)
    dy = torch.randn(len(lengths), 2 * H)
    got, want = [], []
    for path, results in (("fused", got), ("torch", want)):
        kernels.flops.reset()
        y = child_sum(path, xs, lengths)
        results += [y, *torch.autograd.grad(y, xs, dy, allow_unused=True), kernels.flops.total]
    assert got[-1] == want[-1]
    for ours, theirs in zip(got[:-1], want[:-1]):
        if theirs is None:  # W_f, U_f, b_f where no node has children
            assert ours is None or not ours.any()
        else:
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n, with_x, shared", NARY_CASES.values(), ids=NARY_CASES.keys())
def test_a_float32_launch_equals_the_torch_ops_launch(n, with_x, shared):
    xs = nary_operands(n, with_x, rows=7, shared=shared, dtype=torch.float32)
    dy = torch.randn(7, 2 * H)
    got, want = [], []
    for path, results in (("fused", got), ("torch", want)):
        kernels.flops.reset()
        y = nary(path, xs, n, with_x)
        results += [y, *torch.autograd.grad(y, xs, dy), kernels.flops.total]
    if len(shared) < n:  # with every child shared, torch ops run the children's product once
        assert got[-1] == want[-1]
    for ours, theirs in zip(got[:-1], want[:-1]):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_a_float32_leaf_equals_the_torch_ops_leaf():
    xs = tensors((6, D), (1, 3 * H, D), (1, 3 * H), dtype=torch.float32)
    dy = torch.randn(6, 2 * H)
    got, want = [], []
    for path, results in (("fused", got), ("torch", want)):
        y = leaf(path, xs)
        results += [y, *torch.autograd.grad(y, xs, dy)]
    for ours, theirs in zip(got, want):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_children_of_any_strides_are_read_as_their_values():
    xs = nary_operands(2, False)
    strided = [xs[0], xs[1].detach().t().contiguous().t().requires_grad_(), *xs[2:]]
    assert strided[1].stride(1) != 1
    dy = torch.randn(3, 2 * H, dtype=F64)
    y = nary("fused", strided, 2, False)
    torch.testing.assert_close(y, nary("torch", xs, 2, False))
    torch.testing.assert_close(torch.autograd.grad(y, strided[1], dy)[0],
                               torch.autograd.grad(nary("torch", xs, 2, False), xs[1], dy)[0])


def test_a_launch_is_one_autograd_node_over_its_operands():
    """No squeeze or split between the launch's node and its operands, parameters included."""
    for y, name in ((nary("fused", nary_operands(2, True), 2, True), "NaryBackward"),
                    (child_sum("fused", child_sum_operands([1, 2]), [1, 2]), "ChildSumBackward"),
                    (leaf("fused", tensors((2, D), (1, 3 * H, D), (1, 3 * H))), "LeafBackward")):
        assert type(y.grad_fn).__name__ == name
        inputs = [type(f).__name__ for f, _ in y.grad_fn.next_functions if f is not None]
        assert set(inputs) == {"AccumulateGrad"}


def test_a_double_backward_raises_instead_of_getting_it_wrong():
    xs = nary_operands(2, False)
    y = nary("fused", xs, 2, False)
    dy = torch.ones_like(y, requires_grad=True)
    (d_hc,) = torch.autograd.grad(y, xs[0], dy, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        d_hc.sum().backward()


# ---- the core's float32 activations --------------------------------------------------------------
# Moderate inputs densely, tiny and huge ones by orders of magnitude, both signs, the switch of
# tanh's two formulas (|x| 0.55) and the edges of exp's range.
WIDE = np.concatenate([np.linspace(-12, 12, 200_001), np.logspace(-40, 38, 20_000),
                       -np.logspace(-40, 38, 20_000), [0.0, 0.55, -0.55, 87.5, -87.5, 89, -89],
                       np.nextafter(np.float32(0.55), np.float32([0, 1]))]).astype(np.float32)


def leaf_gate(values: np.ndarray, gate: int) -> np.ndarray:
    """The fused leaf's c = sigmoid(i) * tanh(u) with `values` as the pre-activations of gate
    `gate` (0: i, 2: u) and the other factor exactly 1 (a pre-activation of 100): x is the
    values, W an identity in that gate's rows (an exact product)."""
    width = 256
    x = torch.from_numpy(np.pad(values, (0, -len(values) % width))).view(-1, width)
    w, b = torch.zeros(3 * width, width), torch.full((3 * width,), 100.0)
    w[gate * width:(gate + 1) * width] = torch.eye(width)
    b[gate * width:(gate + 1) * width] = 0.0
    with torch.no_grad():
        c = tree_lstm.Leaf.apply(x, w[None], b[None])[:, width:]
    return c.reshape(-1).numpy()[:len(values)]


def ulps(got: np.ndarray, exact: np.ndarray) -> np.ndarray:
    return np.abs(got - exact) / np.spacing(np.abs(exact).astype(np.float32))


def test_float32_tanh_is_within_2_ulp_of_float64s():
    exact = np.tanh(WIDE.astype(np.float64))
    assert ulps(leaf_gate(WIDE, 2), exact).max() <= 2.0  # torch.tanh's: 0.51


def test_float32_sigmoid_is_within_3_ulp_of_float64s():
    v = WIDE.astype(np.float64)
    with np.errstate(over="ignore"):
        exact = np.where(v >= 0, 1 / (1 + np.exp(-np.abs(v))),
                         np.exp(-np.abs(v)) / (1 + np.exp(-np.abs(v))))
    got = leaf_gate(WIDE, 0)
    normal = exact >= np.finfo(np.float32).tiny
    assert ulps(got[normal], exact[normal]).max() <= 3.0  # torch.sigmoid's: 2.05
    assert np.abs(got[~normal] - exact[~normal]).max() < np.finfo(np.float32).tiny


def test_float32_activations_keep_a_nan_a_nan():
    assert np.isnan(leaf_gate(np.float32([np.nan]), 2)).all()
    assert np.isnan(leaf_gate(np.float32([np.nan]), 0)).all()


# ---- the path ------------------------------------------------------------------------------------
def test_other_dtypes_and_the_torch_path_run_torch_ops():
    xs = nary_operands(2, False, dtype=torch.bfloat16)
    assert type(nary("fused", xs, 2, False).grad_fn).__name__ != "NaryBackward"
    xs = nary_operands(2, False)
    assert type(nary("torch", xs, 2, False).grad_fn).__name__ != "NaryBackward"


def test_set_tree_lstm_rejects_an_unknown_path():
    with pytest.raises(ValueError, match="set_tree_lstm: path must be one of"):
        tree_lstm.set_tree_lstm("fast")
