"""The compiled node store: its columns as zero-copy views, the handle, the rules' caches."""

import numpy as np
import pytest
import torch

import flybatch as fb


def test_a_column_view_reads_the_store_without_copying_and_outlives_its_growth():
    W = torch.nn.Parameter(torch.randn(3, 3))
    with fb.Graph() as g:
        x = fb.input(torch.ones(3))
        y = fb.tanh(W @ x)
        sigs = np.asarray(g.view("sigs"))
        assert sigs.tolist() == [g.sig_of(v) for v in range(4)] and not sigs.flags.writeable
        assert np.asarray(g.view("arg_ptr")).tolist() == [0, 0, 0, 2, 3]
        assert np.asarray(g.view("arg_flat")).tolist() == [1, 0, 2]  # W @ x, tanh
        ops = fb._core.op_table()
        assert [ops[c].name for c in np.asarray(g.view("ops"))] == \
            ["input", "parameter", "matmul", "tanh"]
        for _ in range(5000):  # the columns move to larger blocks; the old view keeps its own
            y = fb.tanh(y)
        assert sigs.tolist() == np.asarray(g.view("sigs"))[:4].tolist()
        assert len(np.asarray(g.view("depths"))) == g.n_nodes == 5004


def test_an_expression_is_a_small_handle_without_a_dict():
    with fb.Graph():
        x = fb.input(torch.ones(2))
        assert not hasattr(x, "__dict__")
        with pytest.raises(AttributeError):
            x.id = 3


def test_a_parameter_whose_grad_is_switched_off_is_an_input_from_then_on():
    W = torch.nn.Parameter(torch.ones(2, 2))
    with fb.Graph() as g:
        x = fb.input(torch.ones(2))
        first = W @ x
        W.requires_grad_(False)
        second = W @ x
        assert g.op_of(g.args_of(first.id)[0]).name == "parameter"
        assert g.op_of(g.args_of(second.id)[0]).name == "input"


def test_setting_requires_grad_false_makes_it_an_input_too_and_true_again_a_parameter():
    W = torch.nn.Parameter(torch.ones(2, 2))
    with fb.Graph() as g:
        x = fb.input(torch.ones(2))
        first = W @ x
        W.requires_grad = False
        second = W @ x
        W.requires_grad = True
        third = W @ x
        kinds = [g.op_of(g.args_of(e.id)[0]).name for e in (first, second, third)]
        assert kinds == ["parameter", "input", "parameter"]


def test_switching_requires_grad_off_is_seen_by_a_default_graph_and_a_graph_not_entered():
    W = torch.nn.Parameter(torch.ones(2, 2))
    x = fb.input(torch.ones(2))  # no `with`: the default graph, where no capture mode runs
    first = W @ x
    W.requires_grad_(False)
    second = W @ x
    g = fb.current_graph()
    assert [g.op_of(g.args_of(e.id)[0]).name for e in (first, second)] == ["parameter", "input"]
    W.requires_grad_(True)
    other = fb.Graph()  # built on explicitly while another graph's block (its mode) runs
    with fb.Graph():
        y = fb.input(torch.ones(2), graph=other)
        first = W @ y
        W.requires_grad_(False)
        second = W @ y
        kinds = [other.op_of(other.args_of(e.id)[0]).name for e in (first, second)]
        assert kinds == ["parameter", "input"]


def test_a_table_rebound_to_more_rows_inside_a_graph_is_looked_up_by_its_new_size():
    E = torch.nn.Parameter(torch.ones(3, 2))
    with fb.Graph():
        fb.lookup(E, 2)
        with pytest.raises(IndexError, match="out of range for a table of 3 rows"):
            fb.lookup(E, 4)
        E.data = torch.arange(10.0).reshape(5, 2)
        assert fb.lookup(E, 4).value().tolist() == [8.0, 9.0]


def test_an_lstm_over_a_sequence_is_one_node_giving_what_its_cell_gives_step_by_step():
    torch.manual_seed(0)
    cell = fb.nn.LSTMCell(3, 4)
    xs = [torch.randn(3) for _ in range(5)]
    with fb.Graph():
        stepwise, state = [], None
        for x in xs:
            state = cell(x, state)
            stepwise.append(state.h)
        together = fb.nn.LSTM.run(cell, xs)
        assert [e.op for e in together] == ["lstm_step"] * 5
        assert {together[0].graph.op_of(a).name for a in together[0].graph.args_of(
            together[0].id)} == {"lstm_layer"}
        for a, b in zip(stepwise, together):
            torch.testing.assert_close(a.value(), b.value())


def test_stacked_rows_finds_the_rows_of_one_batch_result_in_one_call():
    W = torch.nn.Parameter(torch.randn(3, 4))
    with fb.Graph(strategy="agenda") as g:
        scores = [W @ fb.input(torch.randn(4)) for _ in range(4)]
        other = fb.tanh(scores[0])
        g.forward()
        batch, row = g.position(scores[0].id)
        assert g.stacked_rows(scores) == (batch, row, None)  # consecutive rows: a view
        batch, first, rows = g.stacked_rows(scores[::-1])
        assert np.frombuffer(rows, np.int64).tolist() == [row + 3, row + 2, row + 1, row]
        # two results, two shapes, a pending node, not a list: the general path decides
        pending = fb.tanh(other)
        for exprs in ([scores[0], other], [other, fb.input(torch.ones(3))], [scores[0], pending],
                      iter(scores), []):
            assert g.stacked_rows(exprs) is None
