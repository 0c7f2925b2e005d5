"""Ops that used to accept a mistake or compute something else than torch (issue 9).

Each case is raised at the user's call, naming the op and the shapes, or computes exactly what
the eager torch code does: signed zeros and NaN constants, numpy arrays on either side of an
operator, bool indices, `dot` of non-vectors, `nn.Embedding` options, negative sizes and graph
dtypes.
"""

from __future__ import annotations

import copy
import math
import re

import numpy as np
import pytest
import torch

import flybatch as fb

F64 = torch.float64


# ---- interned constants ------------------------------------------------------------------------
def test_dividing_by_zero_and_by_negative_zero_gives_infinities_of_both_signs():
    with fb.Graph():
        x = fb.input([1.0, -2.0])
        by_zero, by_negative_zero = x / 0.0, x / -0.0
        assert by_zero.value().tolist() == [math.inf, -math.inf]
        assert by_negative_zero.value().tolist() == [-math.inf, math.inf]


def test_equal_constants_share_one_node_even_when_they_are_nan():
    with fb.Graph() as g:
        x = fb.input([1.0, 2.0])
        a, b = x + float("nan"), x + float("nan")
        assert g.args_of(a.id)[1] == g.args_of(b.id)[1]
        assert g.args_of((x + 0.0).id)[1] != g.args_of((x + -0.0).id)[1]
        assert torch.isnan(a.value()).all() and torch.isnan(b.value()).all()


# ---- numpy arrays as operands ------------------------------------------------------------------
OPERATORS = [
    ("+", lambda a, b: a + b), ("-", lambda a, b: a - b), ("*", lambda a, b: a * b),
    ("/", lambda a, b: a / b), ("@", lambda a, b: a @ b),
]


@pytest.mark.parametrize("op", [o[1] for o in OPERATORS], ids=[o[0] for o in OPERATORS])
@pytest.mark.parametrize("array_on_the_left", [True, False], ids=["ndarray-left", "ndarray-right"])
def test_an_operator_between_an_ndarray_and_an_expression_gives_one_expression(
        op, array_on_the_left):
    x_np = np.array([[1.0, 2.0], [3.0, 4.0]])
    a_np = np.array([[0.5, -1.0], [2.0, 0.25]])
    with fb.Graph(dtype=F64):
        x = fb.input(x_np)
        got = op(a_np, x) if array_on_the_left else op(x, a_np)
        want = op(a_np, x_np) if array_on_the_left else op(x_np, a_np)
        assert isinstance(got, fb.Expression)
        np.testing.assert_allclose(got.numpy(), want)


def test_a_numpy_scalar_on_the_left_of_an_operator_gives_one_expression():
    with fb.Graph(dtype=F64):
        got = np.float64(3.0) - fb.input([1.0, 2.0])
        assert isinstance(got, fb.Expression)
        assert got.value().tolist() == [2.0, 1.0]


# ---- indices -----------------------------------------------------------------------------------
@pytest.mark.parametrize("index", [True, False, np.bool_(True)], ids=["True", "False", "np.bool_"])
def test_a_bool_index_raises_type_error_in_getitem_as_in_pick(index):
    with fb.Graph() as g:
        x = fb.input([1.0, 2.0])
        with pytest.raises(TypeError, match="pick"):
            x[index]
        with pytest.raises(TypeError, match="pick"):
            fb.pick(x, index)
        assert g.n_nodes == 1


# ---- dot ---------------------------------------------------------------------------------------
DOT_MISFITS = [
    ("vector, matrix", (2,), (2, 3)),
    ("matrix, vector", (3, 2), (2,)),
    ("vectors of unequal length", (3,), (4,)),
    ("scalar, scalar", (), ()),
]


@pytest.mark.parametrize("sa, sb", [c[1:] for c in DOT_MISFITS], ids=[c[0] for c in DOT_MISFITS])
def test_dot_of_anything_but_two_vectors_of_equal_length_raises_shape_error(sa, sb):
    with fb.Graph() as g:
        a, b = fb.input(torch.ones(sa)), fb.input(torch.ones(sb))
        nodes = g.n_nodes
        with pytest.raises(fb.ShapeError) as error:
            fb.dot(a, b)
        message = str(error.value)
        assert re.search(r"\bdot\b", message) and str(sa) in message and str(sb) in message
        assert g.n_nodes == nodes


def test_dot_with_a_tensor_operand_adds_one_input_and_one_product():
    with fb.Graph(dtype=F64) as g:
        b = fb.input([1.0, 2.0])
        nodes = g.n_nodes
        d = fb.dot(torch.tensor([3.0, 4.0], dtype=F64), b)
        assert d.item() == 11.0 and g.n_nodes == nodes + 2


# ---- nn.Embedding options ----------------------------------------------------------------------
WORDS = [1, 0, 3, 0, 0, 2, 4, 3]  # one minibatch of lookups: repeated words, row 0 among them
SCALE = torch.tensor([1.0, -2.0, 3.0], dtype=F64)  # so that every entry gets its own gradient


def eager_lookups(emb: torch.nn.Embedding) -> list[torch.Tensor]:
    """The reference: one `nn.Embedding` call per word, as per-instance eager code makes."""
    vectors = [emb(torch.tensor([w]))[0] for w in WORDS]
    sum((v * SCALE).sum() * (k + 1) for k, v in enumerate(vectors)).backward()
    return [v.detach() for v in vectors]


def batched_lookups(emb: torch.nn.Embedding) -> tuple[list[torch.Tensor], fb.Stats]:
    with fb.Graph(dtype=F64) as g:
        vectors = [fb.lookup(emb, w) for w in WORDS]
        fb.esum([fb.sum_elems(v * SCALE) * (k + 1) for k, v in enumerate(vectors)]).backward()
        return [v.value().detach().clone() for v in vectors], g.stats()


def lookup_launches(stats: fb.Stats) -> int:
    return sum(n for sig, n in stats.by_signature.items() if sig.startswith("lookup"))


EMBEDDINGS = {
    "padding_idx=0": dict(padding_idx=0),
    "padding_idx=-1": dict(padding_idx=-1),
    "max_norm=1": dict(max_norm=1.0),
    "max_norm=1.5, norm_type=1": dict(max_norm=1.5, norm_type=1.0),
    "padding_idx and max_norm": dict(padding_idx=3, max_norm=0.8),
    "sparse, padding_idx, max_norm": dict(padding_idx=0, max_norm=1.0, sparse=True),
}


@pytest.mark.parametrize("options", EMBEDDINGS.values(), ids=EMBEDDINGS.keys())
def test_lookup_of_an_embedding_honours_its_options_as_eager_calls_do(options):
    """Values, gradients (none for `padding_idx`) and the table renormalised in place by
    `max_norm` at forward time, all equal to one eager call per word, in ONE batched lookup."""
    torch.manual_seed(0)
    eager = torch.nn.Embedding(5, 3, **options).double()
    with torch.no_grad():
        eager.weight.mul_(2.0)  # rows longer than max_norm
    batched = copy.deepcopy(eager)
    want = eager_lookups(eager)
    got, stats = batched_lookups(batched)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(batched.weight.grad.to_dense(), eager.weight.grad.to_dense())
    torch.testing.assert_close(batched.weight.detach(), eager.weight.detach())
    assert batched.weight.grad.is_sparse == eager.weight.grad.is_sparse
    assert lookup_launches(stats) == 1


def test_lookups_of_one_table_with_different_options_do_not_batch_together():
    torch.manual_seed(0)
    plain = torch.nn.Embedding(4, 3).double()
    padded = torch.nn.Embedding(4, 3, padding_idx=0).double()
    padded.weight = plain.weight  # one table, two modules (tied embeddings)
    with fb.Graph(dtype=F64) as g:
        loss = fb.esum([fb.sum_elems(fb.lookup(emb, 0) * SCALE)
                        for emb in (padded, plain, padded, plain, plain)])
        loss.backward()
        assert lookup_launches(g.stats()) == 2
    assert plain.weight.grad[0].tolist() == (3 * SCALE).tolist()


def test_lookup_of_an_embedding_with_scale_grad_by_freq_raises_at_the_call():
    """Its gradient scale counts the words of one embedding call; batching decides which
    lookups share a call, so no batched result could equal the eager one."""
    emb = torch.nn.Embedding(5, 3, scale_grad_by_freq=True)
    with fb.Graph() as g:
        with pytest.raises(ValueError, match=r"lookup.*scale_grad_by_freq"):
            fb.lookup(emb, 1)
        assert g.n_nodes == 0


# ---- shapes ------------------------------------------------------------------------------------
NEGATIVE_SIZES = [
    ("zeros", "(-3,)", lambda: fb.zeros(-3)),
    ("ones", "(-1,)", lambda: fb.ones(-1)),
    ("zeros", "(2, -1)", lambda: fb.zeros((2, -1))),
    ("reshape", "(-2, -3)", lambda: fb.reshape(fb.input(torch.ones(6)), (-2, -3))),
    ("reshape", "(-1, -1)", lambda: fb.reshape(fb.input(torch.ones(6)), (-1, -1))),
    ("reshape", "(4, -1)", lambda: fb.reshape(fb.input(torch.ones(6)), (4, -1))),
    ("reshape", "(0, -1)", lambda: fb.reshape(fb.input(torch.ones(0)), (0, -1))),
]


@pytest.mark.parametrize("op, shape, call", NEGATIVE_SIZES,
                         ids=[f"{op}{shape}" for op, shape, _ in NEGATIVE_SIZES])
def test_a_negative_size_raises_shape_error_at_the_call_naming_op_and_shape(op, shape, call):
    with fb.Graph() as g:
        with pytest.raises(fb.ShapeError) as error:
            call()
        message = str(error.value)
        assert re.search(rf"\b{op}\b", message) and shape in message, message
        assert g.stats().batches == 0


@pytest.mark.parametrize("shape", [(-1,), (2, -1), (-1, 3), (1, -1, 1, 3)])
def test_reshape_infers_one_minus_one_size_as_torch_does(shape):
    x = torch.arange(6.0)
    with fb.Graph():
        got = fb.reshape(fb.input(x), shape)
        assert got.shape == x.reshape(shape).shape
        assert torch.equal(got.value(), x.reshape(shape))


def test_zero_sizes_are_shapes():
    with fb.Graph():
        assert fb.zeros(0).value().shape == (0,)
        assert fb.reshape(fb.ones((2, 0)), (0, 5)).value().shape == (0, 5)


@pytest.mark.parametrize("strategy", ["none", "depth", "agenda", "auto"])
def test_an_empty_slice_is_an_empty_expression_as_in_torch(strategy):
    W = torch.nn.Parameter(torch.randn(3, 3, dtype=F64))
    xs = torch.randn(4, 3, dtype=F64)

    def loss(k, x):  # h[k:] is empty for k == 3, h[:k] for k == 0, h[2:1] always
        h = torch.tanh(W @ x)
        return h[k:].sum() + 2 * h[:k].sum() + h[2:1].sum() + torch.cat([h[:k], h[k:]]).sum()

    expected = sum(loss(k, x) for k, x in enumerate(xs))
    (grad,) = torch.autograd.grad(expected, W)
    with fb.Graph(strategy):
        assert (W @ xs[0])[3:].shape == (0,)
        got = sum(loss(k, x) for k, x in enumerate(xs))
        got.backward()
        torch.testing.assert_close(got.value(), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(W.grad, grad, rtol=0, atol=1e-12)


# ---- graph dtype -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", torch.int64, torch.bool, torch.complex64, np.float32],
                         ids=["str", "int64", "bool", "complex64", "numpy"])
@pytest.mark.parametrize("make", [fb.Graph, fb.new_graph], ids=["Graph", "new_graph"])
def test_a_graph_dtype_that_is_not_a_floating_torch_dtype_raises_type_error(make, dtype):
    with pytest.raises(TypeError, match="dtype"):
        make(dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_a_graph_of_a_floating_dtype_computes_in_it(dtype):
    with fb.Graph(dtype=dtype):
        assert fb.tanh(fb.input([0.5, 1.0])).value().dtype == dtype


def test_a_rejected_new_graph_leaves_the_current_default_graph_open():
    fb.new_graph()
    x = fb.tanh(fb.input([1.0]))
    with pytest.raises(TypeError):
        fb.new_graph(dtype=torch.int64)
    assert x.item() == pytest.approx(math.tanh(1.0))
