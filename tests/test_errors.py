"""Errors are raised at the user's line, say what is wrong, and leave the graph usable.

- a shape mismatch raises `fb.ShapeError` (a ValueError) when the op is CALLED, naming the op and
  the shapes, never later inside a batched kernel;
- an out-of-range lookup or pick raises IndexError at the call;
- an expression of a closed graph raises `fb.GraphError` wherever it is used;
- a forward that fails leaves nothing half-executed: earlier values stay valid, nothing is
  counted twice, and the graph can forward again.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import flybatch as fb

W43 = torch.nn.Parameter(torch.randn(4, 3))
B4 = torch.nn.Parameter(torch.randn(4))


def v(n):
    return fb.input(torch.randn(n))


def m(r, c):
    return fb.input(torch.randn(r, c))


def child(n):
    """A Tree-LSTM child's state with h and c of size n."""
    return fb.nn.State.of(h=v(n), c=v(n))


# (op named in the message, shapes named in the message, the offending call)
SHAPE_ERRORS = [
    ("add", ["(3,)", "(4,)"], lambda: fb.add(v(3), v(4))),
    ("add", ["(3,)", "(4,)"], lambda: v(3) + v(4)),
    ("sub", ["(2, 3)", "(2,)"], lambda: m(2, 3) - v(2)),
    ("mul", ["(3,)", "(4,)"], lambda: v(3) * v(4)),
    ("div", ["(5,)", "(2,)"], lambda: fb.div(v(5), v(2))),
    ("matmul", ["(4, 3)", "(4,)"], lambda: W43 @ v(4)),
    ("matmul", ["(2, 3)", "(2, 3)"], lambda: fb.matmul(m(2, 3), m(2, 3))),
    ("matmul", ["(3,)", "(4, 3)"], lambda: v(3) @ W43),
    ("affine", ["(4, 3)", "(4,)"], lambda: fb.affine(W43, v(4), B4)),
    ("affine", ["(3,)", "(2,)"], lambda: fb.affine(W43, v(3), v(2))),
    ("dot", ["(2, 3)"], lambda: fb.dot(m(2, 3), m(2, 3))),
    ("esum", ["(3,)", "(4,)"], lambda: fb.esum([v(3), v(4), v(3)])),
    ("average", ["(3,)", "(4,)"], lambda: fb.average([v(3), v(4)])),
    ("emax", ["(2,)", "(4,)"], lambda: fb.emax([v(2), v(4)])),
    ("concat", ["(2, 3)", "(2, 4)"], lambda: fb.concat([m(2, 3), m(2, 4)])),
    ("concat", ["(3,)"], lambda: fb.concat([v(3), v(3)], dim=1)),
    ("reshape", ["(6,)", "(4,)"], lambda: fb.reshape(v(6), 4)),
    ("transpose", ["(3,)"], lambda: fb.transpose(v(3))),
    ("softmax", ["(2, 3)"], lambda: fb.softmax(m(2, 3))),
    ("log_softmax", ["(2, 3)"], lambda: fb.log_softmax(m(2, 3))),
    ("pick_neg_log_softmax", ["(2, 3)"], lambda: fb.pick_neg_log_softmax(m(2, 3), 0)),
    ("lookup", ["(5,)"], lambda: fb.lookup(torch.randn(5), 0)),
    ("pick", ["scalar"], lambda: fb.pick(fb.sum_elems(v(3)), 0)),
    ("slice", ["scalar"], lambda: fb.sum_elems(v(3))[0:1]),
]


@pytest.mark.parametrize("op, shapes, call", SHAPE_ERRORS,
                         ids=[f"{k}-{c[0]}" for k, c in enumerate(SHAPE_ERRORS)])
def test_shape_mismatch_raises_shape_error_naming_op_and_shapes(op, shapes, call):
    with fb.Graph() as g:
        with pytest.raises(fb.ShapeError) as error:
            call()
        message = str(error.value)
        assert re.search(rf"\b{op}\b", message), message
        for shape in shapes:
            assert shape in message, message
        assert g.stats().batches == 0  # raised at the call: nothing was run


def test_shape_error_is_a_value_error():
    assert issubclass(fb.ShapeError, ValueError)


def test_torch_code_that_catches_a_shape_runtime_error_catches_it_inside_a_graph_too():
    W = torch.nn.Parameter(torch.randn(3, 3))

    def project(x):  # eager torch raises RuntimeError for the mismatch
        try:
            return W @ x
        except RuntimeError:
            return W @ x[:3]

    with fb.Graph():
        assert project(fb.input(torch.ones(4))).shape == (3,)


def test_a_rejected_op_adds_no_node_and_the_graph_stays_usable():
    with fb.Graph() as g:
        x, y = v(3), v(4)
        nodes = g.stats().nodes
        with pytest.raises(fb.ShapeError):
            fb.add(x, y)
        assert g.stats().nodes == nodes
        assert fb.sum_elems(fb.tanh(x)).value().shape == ()


# nn blocks are single fused nodes: their input sizes must be checked at the call too.
NN_SHAPE_ERRORS = [
    ("LSTMCell input", lambda: fb.nn.LSTMCell(3, 2)(v(4))),
    ("LSTMCell state", lambda: fb.nn.LSTMCell(3, 2)(v(3), (v(3), v(2)))),
    ("GRUCell input", lambda: fb.nn.GRUCell(3, 2)(v(4))),
    ("GRUCell state", lambda: fb.nn.GRUCell(3, 2)(v(3), v(5))),
    ("TreeLSTMCell leaf input", lambda: fb.nn.TreeLSTMCell(3, 2).leaf(v(4))),
    ("TreeLSTMCell child state", lambda: fb.nn.TreeLSTMCell(3, 2)([child(2), child(3)])),
    ("TreeLSTMCell node input", lambda: fb.nn.TreeLSTMCell(3, 2)([child(2)] * 2, v(2))),
    ("child-sum TreeLSTMCell input",
     lambda: fb.nn.TreeLSTMCell(3, 2, child_sum=True)([child(2)], v(4))),
    ("State of unequal h and c", lambda: fb.nn.State.of(h=v(2), c=v(3))),
    ("Linear input", lambda: fb.nn.Linear(3, 2)(v(4))),
    ("LSTM input", lambda: fb.nn.LSTM(3, 2)([v(3), v(4)])),
]


@pytest.mark.parametrize("call", [c[1] for c in NN_SHAPE_ERRORS],
                         ids=[c[0] for c in NN_SHAPE_ERRORS])
def test_nn_block_given_a_wrong_size_raises_shape_error_at_the_call(call):
    with fb.Graph() as g:
        with pytest.raises(fb.ShapeError):
            call()
        assert g.stats().batches == 0


# ---- index errors ------------------------------------------------------------------------------
INDEX_ERRORS = [
    ("lookup past the end", lambda: fb.lookup(torch.randn(5, 2), 5)),
    ("lookup negative", lambda: fb.lookup(torch.randn(5, 2), -1)),
    ("lookup in nn.Embedding", lambda: fb.lookup(torch.nn.Embedding(3, 2), 3)),
    ("pick past the end", lambda: fb.pick(v(3), 3)),
    ("pick before the start", lambda: fb.pick(v(3), -4)),
    ("pick a matrix row", lambda: fb.pick(m(2, 3), 2)),
    ("x[i]", lambda: v(3)[7]),
    ("pick_neg_log_softmax label", lambda: fb.pick_neg_log_softmax(v(3), 3)),
    ("pick_neg_log_softmax label of a list", lambda: fb.pick_neg_log_softmax([v(()), v(())], 2)),
    ("pick_neg_log_softmax label before a list", lambda: fb.pick_neg_log_softmax([v(())], -2)),
]


@pytest.mark.parametrize("call", [c[1] for c in INDEX_ERRORS], ids=[c[0] for c in INDEX_ERRORS])
def test_out_of_range_index_raises_index_error_at_the_call(call):
    with fb.Graph() as g:
        with pytest.raises(IndexError):
            call()
        assert g.stats().batches == 0


def test_an_out_of_range_label_of_a_list_of_scores_names_the_op_and_the_list_length():
    # A list of candidates' scores is indexed like a Python list (-1 is the last candidate);
    # past either end the error names the op and the list's length (as the vector case names
    # its shape), not Python's bare "list index out of range".
    with fb.Graph():
        scores = [v(()), v(()), v(())]
        with pytest.raises(IndexError, match=r"pick_neg_log_softmax: index 3 out of range for a "
                                             r"list of 3 scores"):
            fb.pick_neg_log_softmax(scores, 3)
        with pytest.raises(IndexError, match="index -4 out of range for a list of 3 scores"):
            fb.pick_neg_log_softmax(scores, -4)


# ---- closed graphs -----------------------------------------------------------------------------
def closed_expression() -> fb.Expression:
    with fb.Graph():
        x = fb.tanh(fb.input([1.0, 2.0]))
    return x


USES_OF_A_CLOSED_EXPRESSION = [
    ("value", lambda x: x.value()),
    ("item", lambda x: fb.sum_elems(x).item()),
    ("backward", lambda x: x.backward()),
    ("unary op", lambda x: fb.tanh(x)),
    ("operator", lambda x: x * 2),
    ("with a new expression", lambda x: fb.input([1.0, 1.0]) + x),
    ("new expression with it", lambda x: x + fb.input([1.0, 1.0])),
    ("in a list op", lambda x: fb.esum([fb.input([1.0, 1.0]), x])),
    ("its graph's forward", lambda x: x.graph.forward()),
]


@pytest.mark.parametrize("use", [c[1] for c in USES_OF_A_CLOSED_EXPRESSION],
                         ids=[c[0] for c in USES_OF_A_CLOSED_EXPRESSION])
def test_using_an_expression_of_a_closed_graph_raises_graph_error(use):
    x = closed_expression()
    with fb.Graph():
        with pytest.raises(fb.GraphError):
            use(x)


def test_a_new_default_graph_closes_the_previous_one():
    x = fb.tanh(fb.input([1.0]))
    fb.new_graph()
    with pytest.raises(fb.GraphError):
        x.value()


def test_mixing_two_open_graphs_raises_graph_error():
    with fb.Graph() as g1:
        x = fb.input([1.0])
        with fb.Graph():
            y = fb.input([1.0])
            with pytest.raises(fb.GraphError):
                fb.add(x, y)
        assert fb.tanh(x).graph is g1


# ---- failing forwards ----------------------------------------------------------------------------
def _graph_with_a_failing_node():
    """A float32 graph with some good nodes already forwarded, then a chain whose last node
    multiplies by a parameter that became float64 after the node was created (creation checks
    the dtype), by a rebind the graph does not see (a rebind it sees computes the pending nodes
    first): its kernel fails after other batches of the same forward already ran."""
    g = fb.Graph(strategy="agenda")
    g.__enter__()
    good = fb.tanh(fb.input([0.5, -0.5, 1.0]))
    good.value()
    bad_w = torch.nn.Parameter(torch.randn(2, 3))
    pending = fb.sigmoid(fb.tanh(good) * 3)
    bad = bad_w @ pending
    with torch._C.DisableTorchFunction():  # not seen by the graph's capture
        bad_w.data = bad_w.data.double()
    return g, good, pending, bad, bad_w


def test_a_failing_forward_raises_and_keeps_earlier_values():
    g, good, pending, bad, _ = _graph_with_a_failing_node()
    try:
        before = good.value().clone()
        launches = g.stats().batches
        with pytest.raises(RuntimeError):
            bad.value()
        assert torch.equal(good.value(), before)
        assert g.stats().batches == launches  # nothing of the failed forward is counted
        assert "pending" in repr(pending)
    finally:
        g.__exit__(None, None, None)


def test_a_failing_forward_fails_the_same_way_when_retried():
    g, _, _, bad, _ = _graph_with_a_failing_node()
    try:
        with pytest.raises(RuntimeError) as first:
            bad.value()
        with pytest.raises(RuntimeError) as second:
            g.forward()
        assert str(second.value) == str(first.value)
    finally:
        g.__exit__(None, None, None)


def test_after_a_failing_forward_is_fixed_the_graph_computes_one_shot_values():
    g, good, pending, bad, bad_w = _graph_with_a_failing_node()
    try:
        with pytest.raises(RuntimeError):
            bad.value()
        bad_w.data = bad_w.data.float()  # fix the cause, then forward the same nodes again
        values = [t.clone() for t in g.forward([good, pending, bad])]
        launches = g.stats().batches
    finally:
        g.__exit__(None, None, None)
    with fb.Graph(strategy="agenda") as one_shot:
        good2 = fb.tanh(fb.input([0.5, -0.5, 1.0]))
        pending2 = fb.sigmoid(fb.tanh(good2) * 3)
        expected = one_shot.forward([good2, pending2, bad_w @ pending2])
        assert launches == one_shot.stats().batches
    for got, want in zip(values, expected):
        torch.testing.assert_close(got, want)


# ---- other misuse --------------------------------------------------------------------------------
def test_a_parameter_of_another_dtype_raises_type_error_at_the_call():
    with fb.Graph(dtype=torch.float32):
        with pytest.raises(TypeError, match="float64"):
            torch.nn.Parameter(torch.ones(2, 2, dtype=torch.float64)) @ fb.input([1.0, 2.0])


def test_a_parameter_of_another_dtype_than_the_first_one_met_raises_type_error():
    with fb.Graph():  # no dtype: the first parameter fixes it
        torch.nn.Parameter(torch.ones(2, 2, dtype=torch.float64)) @ fb.input([1.0, 2.0])
        with pytest.raises(TypeError, match="float32"):
            torch.nn.Parameter(torch.ones(2, 2, dtype=torch.float32)) @ fb.input([1.0, 2.0])


def test_an_input_tensor_the_graph_dtype_would_round_raises_type_error():
    with fb.Graph(dtype=torch.float32):
        with pytest.raises(TypeError, match=r"input: a torch.float64 tensor of shape \(3,\)"):
            fb.input(torch.ones(3, dtype=torch.float64))
        # what the graph's dtype holds exactly is converted, as are lists and arrays
        assert fb.input(torch.ones(3, dtype=torch.float16)).value().dtype == torch.float32
        assert fb.input(np.ones(3)).value().dtype == torch.float32
    with fb.Graph():  # no dtype: the first floating tensor fixes it
        fb.input(torch.ones(2, dtype=torch.float32))
        with pytest.raises(TypeError, match="float64"):
            fb.input(torch.ones(2, dtype=torch.float64))


def test_a_float_or_bool_index_raises_type_error_at_the_call():
    table = torch.nn.Parameter(torch.ones(4, 2))
    with fb.Graph():
        with pytest.raises(TypeError, match="lookup"):
            fb.lookup(table, 1.7)
        with pytest.raises(TypeError, match="pick"):
            fb.pick(fb.input([1.0, 2.0]), True)
        assert fb.lookup(table, np.int64(3)).shape == (2,)
        assert fb.pick(fb.input([1.0, 2.0]), torch.tensor(1)).shape == ()


def test_backward_of_a_non_scalar_raises_value_error():
    with fb.Graph():
        with pytest.raises(ValueError, match="scalar"):
            fb.tanh(fb.input([1.0, 2.0])).backward()


def test_unknown_strategy_raises_value_error():
    with pytest.raises(ValueError, match="strategy"):
        fb.Graph(strategy="greedy")


@pytest.mark.parametrize("call", [lambda: fb.esum([]), lambda: fb.concat([]),
                                  lambda: fb.dropout(v(2), 1.0)], ids=["esum", "concat", "dropout"])
def test_invalid_arguments_raise_value_error(call):
    with fb.Graph():
        with pytest.raises(ValueError):
            call()


@pytest.mark.parametrize("call", [
    lambda g, e, t: g.forward([e, t]),
    lambda g, e, t: g.forward([e, t], stack=True),
    lambda g, e, t: g.backward([fb.sum_elems(e), t]),
], ids=["forward", "forward(stack=True)", "backward"])
def test_a_tensor_among_the_expressions_of_forward_or_backward_raises_type_error(call):
    # forward and backward take expressions; a parameter or tensor among them (a parser that
    # stacks its scores with a bias vector) is named, with the way to make it an expression,
    # not an AttributeError from inside the graph.
    W = torch.nn.Parameter(torch.ones(2))
    with fb.Graph() as g:
        e = fb.tanh(fb.input([1.0, 2.0]))
        with pytest.raises(TypeError, match=r"Parameter is not a flybatch expression.*"
                                            r"fb.parameter"):
            call(g, e, W)
        assert g.forward([e, fb.parameter(W)], stack=True).shape == (2, 2)
