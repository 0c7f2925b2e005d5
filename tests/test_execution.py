"""The read planner of the execution stage (csrc/execute.cpp, `_core.plan_reads`).

Before a forward runs, each argument position of each batch is planned as ONE read of earlier
results: a zero-copy view of a run of rows, arbitrary rows of one result, or one read per
result put back in the nodes' order; results read in pieces are fanned out once. These tests
pin the kind chosen for known schedules, and check on random graphs that every read gathers
exactly the rows its nodes' arguments live in.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import eager
import flybatch as fb
from flybatch import _core, execution, scheduling


class Planned:
    """The schedule and read plan of a graph's pending nodes, as the next forward makes them."""

    def __init__(self, g: fb.Graph):
        g._grow_positions(g.n_nodes)
        self.graph = g
        self.schedule = scheduling.schedule(g, g.n_done, g.n_nodes)
        (self.reads, self.batch_reads, self.fan_outs, index_bytes, self.heads, self.readers,
         self.earlier) = _core.plan_reads(
            graph=g, first_batch=self.schedule.first_batch, order=self.schedule.order,
            ends=self.schedule.ends)
        self.indices = np.frombuffer(index_bytes, np.int64).tolist()

    def discard(self) -> None:
        """Forget this schedule, so that the graph's next forward can run."""
        self.graph.unschedule(self.schedule.start, self.schedule.first_batch)

    def batch_of(self, node: fb.Expression) -> int:
        return int(self.graph.node_batch[node.id])

    def read_ids_of(self, node: fb.Expression) -> tuple[int, ...]:
        """The reads of the batch that computes `node`, one per argument position."""
        return self.batch_reads[self.batch_of(node) - self.schedule.first_batch][0]

    def reads_of(self, node: fb.Expression) -> list[tuple]:
        return [self.reads[k] for k in self.read_ids_of(node)]

    def positions(self, k: int, rows: int) -> list[tuple[int, int]]:
        """(batch, row) of each of the `rows` rows that read `k` gathers (a view of one row
        read by several nodes is broadcast to all of them)."""
        read = self.reads[k]
        if read[0] == "view":
            _, source, start, length = read
            if length == 1:
                return [(source, start)] * rows
            return [(source, start + i) for i in range(length)]
        if read[0] == "rows":
            _, source, at, length = read
            return [(source, r) for r in self.indices[at:at + length]]
        _, parts, inverse, total, _ = read
        stacked = [p for part in parts for p in self.positions(part, 1)]
        if inverse is None:
            return stacked
        return [stacked[i] for i in self.indices[inverse:inverse + total]]

    def whole_positions(self, k: int) -> list[tuple[int, int]]:
        """(batch, row) of each row of multi read `k` as its `whole` rows name them: rows of
        the concatenation of its parts' whole results."""
        _, parts, _, total, whole = self.reads[k]
        sizes = np.frombuffer(self.graph.view("batch_sizes"), np.int32)
        rows_of = [(source, row) for source in (self.reads[p][1] for p in parts)
                   for row in range(sizes[source])]
        return [rows_of[i] for i in self.indices[whole:whole + total]]


def _inputs(k: int, width: int = 2) -> list[fb.Expression]:
    return [fb.input(torch.full((width,), float(i))) for i in range(k)]


# ---- the kind of each read ---------------------------------------------------------------------
def test_a_batch_reading_a_whole_result_in_order_reads_all_of_it_as_a_view():
    with fb.Graph(strategy="depth") as g:
        xs = _inputs(3)
        hs = [fb.tanh(x) for x in xs]
        planned = Planned(g)
        assert planned.reads_of(hs[0]) == [("view", planned.batch_of(xs[0]), 0, 3)]
        assert planned.fan_outs == {}  # read whole: nothing to fan out


def test_every_node_reading_the_same_node_reads_one_row_the_kernel_broadcasts():
    with fb.Graph(strategy="depth") as g:
        xs = _inputs(3)
        shared = fb.tanh(fb.input(torch.ones(2)))
        products = [x * shared for x in xs]
        planned = Planned(g)
        _, second = planned.reads_of(products[0])
        assert second == ("view", planned.batch_of(shared), 0, 1)


def test_rows_of_one_result_out_of_order_are_one_rows_read():
    with fb.Graph(strategy="depth") as g:
        hs = [fb.tanh(x) for x in _inputs(3)]
        # Rows follow the first argument, so the second reads hs in the order 2, 0, 1.
        products = [hs[i] * hs[j] for i, j in [(0, 2), (1, 0), (2, 1)]]
        planned = Planned(g)
        first, second = planned.reads_of(products[0])
        assert first == ("view", planned.batch_of(hs[0]), 0, 3)
        kind, source, at, length = second
        assert (kind, source, length) == ("rows", planned.batch_of(hs[0]), 3)
        assert planned.indices[at:at + length] == [2, 0, 1]


def test_rows_of_several_results_are_one_read_per_result_then_put_back_in_order():
    with fb.Graph(strategy="depth") as g:
        xs = _inputs(3)
        # The first arguments are the latest results, so they fix the row order: 0, 1, 2.
        deep = [fb.tanh(fb.tanh(x)) for x in xs]
        ss, es = [fb.sigmoid(x) for x in xs], [fb.exp(x) for x in xs]
        products = [deep[0] * ss[1], deep[1] * es[0], deep[2] * ss[0]]
        planned = Planned(g)
        _, mixed = planned.read_ids_of(products[0])
        kind, parts, inverse, rows, whole = planned.reads[mixed]
        assert kind == "multi" and rows == 3
        assert whole is None  # two results: read part by part
        sources = [planned.reads[p][1] for p in parts]
        assert sources == sorted([planned.batch_of(ss[0]), planned.batch_of(es[0])])
        assert inverse is not None  # the results interleave: the concatenation is reordered
        assert planned.positions(mixed, 3) == [(planned.batch_of(v), int(g.node_row[v.id]))
                                               for v in (ss[1], es[0], ss[0])]


def test_rows_of_many_results_also_list_each_nodes_row_in_the_whole_results():
    """From eight results on, a multi read also names every row in the concatenation of its
    parts' whole results (execution reads many small results as one cat and one index_select)."""
    with fb.Graph(strategy="depth") as g:
        h, states = _inputs(1)[0], []
        for _ in range(9):  # nine steps: nine results of one row each, by depth
            h = fb.tanh(h)
            states.append(h)
        g.forward()
        picked = [states[i] for i in (7, 0, 3, 8, 1, 2, 5, 4, 6, 0)]
        joined = fb.concat(picked)
        planned = Planned(g)
        (k,) = planned.read_ids_of(joined)
        kind, parts, _, rows, whole = planned.reads[k]
        assert kind == "multi" and len(parts) == 9 and rows == 10 and whole is not None
        expected = [(int(g.node_batch[v.id]), int(g.node_row[v.id])) for v in picked]
        assert planned.whole_positions(k) == planned.positions(k, 10) == expected


def test_a_ragged_batch_reads_every_argument_flat_and_each_nodes_arity():
    with fb.Graph(strategy="depth") as g:
        hs = [fb.tanh(x) for x in _inputs(3)]
        sums = [fb.esum(hs[:2]), fb.esum(hs[2:])]
        planned = Planned(g)
        read_ids, stacked, arities, *_ = planned.batch_reads[planned.batch_of(sums[0])]
        assert [planned.reads[k] for k in read_ids] == [("view", planned.batch_of(hs[0]), 0, 3)]
        assert stacked == 0 and planned.indices[arities:arities + 2] == [2, 1]


def test_each_batch_is_planned_with_its_first_nodes_op_signature_attr_shape_and_grad_mode():
    """What a launch needs to know of its batch comes with the plan, one tuple per batch,
    instead of one call into the store each."""
    with fb.Graph(strategy="agenda") as g:
        xs = _inputs(3)
        hs = [fb.tanh(x) for x in xs]
        with torch.no_grad():
            picked = [fb.pick(h, 1) for h in hs]
        sums = [fb.esum(hs[:2]), fb.esum(hs[1:])]
        planned = Planned(g)
        assert len(planned.heads) == len(planned.schedule.batches)
        for nodes, head in zip(planned.schedule.batches, planned.heads):
            first = int(nodes[0])
            assert head == (first, g.op_of(first), g.sig_of(first), g.attr_of(first),
                            g.shape_of(first), g.is_no_grad(first))
        assert planned.heads[planned.batch_of(picked[0]) - planned.schedule.first_batch][5]
        assert not planned.heads[planned.batch_of(sums[0]) - planned.schedule.first_batch][5]


def test_a_padded_batch_reads_each_argument_at_its_longest_and_each_nodes_length():
    """`K_i @ q` over instance matrices of 3 and 1 rows: K is read 3 rows wide (the stack of 1
    row is padded), q as it is, and the kernel gets the lengths 3 and 1."""
    with fb.Graph(strategy="depth") as g:
        xs = _inputs(4)
        keys = [fb.stack(xs[:3]), fb.stack(xs[3:])]
        scores = [k @ xs[0] for k in keys]
        planned = Planned(g)
        _, _, _, widths, lengths, uneven = planned.batch_reads[planned.batch_of(scores[0])]
        assert planned.indices[widths:widths + 2] == [3, 2] and uneven
        assert planned.indices[lengths:lengths + 2] == [3, 1]
        _, _, _, widths, lengths, uneven = planned.batch_reads[planned.batch_of(keys[0])]
        assert planned.indices[widths] == 2 and lengths is None and uneven  # items (2,): as read


def test_a_padded_batch_of_equal_lengths_gets_no_lengths():
    with fb.Graph(strategy="depth") as g:
        xs = _inputs(4)
        weights = [fb.softmax(fb.stack(xs[:2])[0]), fb.softmax(fb.stack(xs[2:])[1])]
        planned = Planned(g)
        _, _, _, widths, lengths, uneven = planned.batch_reads[planned.batch_of(weights[0])]
        assert planned.indices[widths] == 2 and lengths is None and not uneven


def test_a_ragged_op_reads_its_fixed_arguments_one_each_then_its_lists_flat():
    """A child-sum Tree-LSTM cell: its input and six parameters, then its 0..k children."""
    torch.manual_seed(0)
    cell = fb.nn.TreeLSTMCell(3, 4, child_sum=True)

    def cells(planned: Planned) -> tuple[np.ndarray, tuple]:
        (found,) = [(nodes, layout) for nodes, layout in zip(planned.schedule.batches,
                                                             planned.batch_reads)
                    if planned.graph.op_of(int(nodes[0])).name == "tree_lstm_child_sum"]
        return found

    with fb.Graph(strategy="depth") as g:
        xs = _inputs(4, width=3)
        leaves = [cell([], x) for x in xs[:2]]
        planned = Planned(g)
        nodes, (read_ids, stacked, arities, *_) = cells(planned)
        assert len(read_ids) == 7  # every list is empty: no read of list items
        assert planned.indices[arities:arities + 2] == [0, 0]
        planned.discard()
        g.forward()
        cell(leaves, xs[2]), cell(leaves[:1], xs[3])
        planned = Planned(g)
        nodes, (read_ids, stacked, arities, *_) = cells(planned)
        assert len(read_ids) == 8 and stacked == 0
        assert planned.indices[arities:arities + 2] == [len(g.args_of(int(v))) - 7 for v in nodes]
        children = [u for v in nodes for u in g.args_of(int(v))[7:]]
        assert planned.positions(read_ids[-1], 3) == [(int(g.node_batch[u]), int(g.node_row[u]))
                                                      for u in children]


def test_a_variadic_op_of_many_arguments_is_one_stacked_read():
    with fb.Graph(strategy="depth") as g:
        hs = [fb.tanh(x) for x in _inputs(16)]
        joined = [fb.concat(hs[:8]), fb.concat(hs[8:])]
        planned = Planned(g)
        read_ids, stacked, arities, *_ = planned.batch_reads[planned.batch_of(joined[0])]
        assert stacked == 8 and arities is None
        assert [planned.reads[k] for k in read_ids] == [("view", planned.batch_of(hs[0]), 0, 16)]


def test_a_variadic_op_whose_arguments_are_all_rows_of_one_result_is_one_stacked_read():
    with fb.Graph(strategy="depth") as g:
        hs = [fb.tanh(x) for x in _inputs(4)]
        joined = [fb.concat([hs[3], hs[0]]), fb.concat([hs[1], hs[1]])]
        planned = Planned(g)
        batch = planned.batch_of(joined[0])
        read_ids, stacked, *_ = planned.batch_reads[batch]
        assert stacked == 2 and len(read_ids) == 1
        assert planned.reads[read_ids[0]][:2] == ("rows", planned.batch_of(hs[0]))
        arguments = [u for v in planned.schedule.batches[batch] for u in g.args_of(int(v))]
        assert planned.positions(read_ids[0], 4) == [  # node after node
            (int(g.node_batch[u]), int(g.node_row[u])) for u in arguments]


def test_a_variadic_op_reading_runs_of_several_results_reads_argument_by_argument():
    with fb.Graph(strategy="depth") as g:
        xs = _inputs(2)
        hs, ss = [fb.tanh(x) for x in xs], [fb.sigmoid(x) for x in xs]
        joined = [fb.concat([h, s]) for h, s in zip(hs, ss)]
        planned = Planned(g)
        read_ids, stacked, *_ = planned.batch_reads[planned.batch_of(joined[0])]
        assert stacked == 0  # two views, concatenated by the kernel: one copy
        assert [planned.reads[k] for k in read_ids] == [
            ("view", planned.batch_of(hs[0]), 0, 2), ("view", planned.batch_of(ss[0]), 0, 2)]


def test_a_variadic_op_whose_arguments_need_gathers_from_several_results_is_one_stacked_read():
    with fb.Graph(strategy="depth") as g:
        xs = _inputs(3)
        hs, ss = [fb.tanh(x) for x in xs], [fb.sigmoid(x) for x in xs]
        joined = [fb.concat([hs[2], ss[0]]), fb.concat([ss[1], hs[0]])]
        planned = Planned(g)
        batch = planned.batch_of(joined[0])
        read_ids, stacked, *_ = planned.batch_reads[batch]
        assert stacked == 2 and len(read_ids) == 1
        kind, parts, *_ = planned.reads[read_ids[0]]
        assert kind == "multi" and len(parts) == 2  # one gather per result, not per position
        arguments = [u for v in planned.schedule.batches[batch] for u in g.args_of(int(v))]
        assert planned.positions(read_ids[0], 4) == [
            (int(g.node_batch[u]), int(g.node_row[u])) for u in arguments]


# ---- fan-outs ----------------------------------------------------------------------------------
def test_a_result_read_in_disjoint_runs_is_split_once_into_pieces():
    with fb.Graph(strategy="depth") as g:
        hs = [fb.tanh(x) for x in _inputs(5)]
        low, high = [fb.sigmoid(h) for h in hs[:2]], [fb.exp(h) for h in hs[3:]]
        planned = Planned(g)
        (low_read,), (high_read,) = planned.reads_of(low[0]), planned.reads_of(high[0])
        assert low_read[2:] == (0, 2) and high_read[2:] == (3, 2)
        read_ids, gather, sizes, piece = planned.fan_outs[planned.batch_of(hs[0])]
        assert gather is None  # the result itself is split
        assert sizes == (2, 1, 2)  # row 2, read by nobody, is a piece of its own
        (low_id,), (high_id,) = planned.read_ids_of(low[0]), planned.read_ids_of(high[0])
        assert dict(zip(read_ids, piece)) == {low_id: 0, high_id: 2}


def test_a_result_read_in_overlapping_pieces_is_gathered_once():
    with fb.Graph(strategy="depth") as g:
        hs = [fb.tanh(x) for x in _inputs(4)]
        for h in hs[:3]:
            fb.sigmoid(h)
        for h in hs[1:]:
            fb.exp(h)
        planned = Planned(g)
        read_ids, gather, sizes, piece = planned.fan_outs[planned.batch_of(hs[0])]
        assert sizes == (3, 3) and piece == (0, 1)  # one gather of both reads' rows, split
        gathered = planned.indices[gather:gather + 6]
        assert sorted([gathered[:3], gathered[3:]]) == [[0, 1, 2], [1, 2, 3]]


# ---- every read gathers exactly its nodes' arguments -------------------------------------------
STEP = st.tuples(st.sampled_from(["input", "tanh", "sigmoid", "mul", "esum", "concat"]),
                 st.integers(0, 3), st.integers(0, 99), st.integers(0, 5).map(lambda k: k == 0))


def _random_graph(steps) -> None:
    """Nodes wired at random (recent inputs, so that chains form, and any earlier one), with a
    forward now and then: later reads then also read results of earlier forwards."""
    g = fb.current_graph()
    pool = [fb.input(torch.zeros(2))]
    for op, back, anywhere, forward in steps:
        if forward and g.n_nodes > g.n_done:
            g.forward()
        x, y = pool[max(0, len(pool) - 1 - back)], pool[anywhere % len(pool)]
        node = {"input": lambda: fb.input(torch.zeros(2)), "tanh": lambda: fb.tanh(x),
                "sigmoid": lambda: fb.sigmoid(x), "mul": lambda: x * y,
                "esum": lambda: fb.esum([x, y, x][:1 + anywhere % 3]),
                "concat": lambda: fb.concat([x, y] * 4)[0:2]}[op]()
        pool.append(node)


def _arguments(g: fb.Graph, nodes: np.ndarray, layout: tuple) -> list[list[int]]:
    """The node ids each read of a batch should gather, by the op's argument layout: one read
    per argument position, except the flat read of all lists (a ragged op's arguments after its
    `fixed` first ones) or of all arguments (a stacked variadic op), node after node."""
    read_ids, stacked, arities, *_ = layout
    args = [g.args_of(int(v)) for v in nodes]
    if stacked:
        return [[a for node_args in args for a in node_args]]
    if arities is None:
        return [[node_args[j] for node_args in args] for j in range(len(read_ids))]
    fixed = getattr(g.op_of(int(nodes[0])), "fixed", 0)
    items = [a for node_args in args for a in node_args[fixed:]]
    return [[node_args[j] for node_args in args] for j in range(fixed)] + ([items] if items else [])


@settings(max_examples=150)  # cheap: nothing runs but the core
@given(steps=st.lists(STEP, min_size=1, max_size=20))
def test_every_read_gathers_exactly_the_rows_its_nodes_arguments_live_in(steps):
    for strategy in ("none", "depth", "agenda", "auto"):
        with fb.Graph(strategy=strategy) as g:
            _random_graph(steps)
            if g.n_done == g.n_nodes:
                continue
            planned = Planned(g)
            for nodes, layout in zip(planned.schedule.batches, planned.batch_reads):
                for k, ids in zip(layout[0], _arguments(g, nodes, layout), strict=True):
                    expected = [(int(g.node_batch[v]), int(g.node_row[v])) for v in ids]
                    assert planned.positions(k, len(ids)) == expected
            batch_sizes = np.asarray(g.view("batch_sizes"))
            for source, (read_ids, gather, sizes, piece_of) in planned.fan_outs.items():
                assert len(read_ids) >= 2
                # The pieces of the result (or of one gather of rows), in row order.
                rows = (range(batch_sizes[source]) if gather is None else
                        planned.indices[gather:gather + sum(sizes)])
                assert len(rows) == sum(sizes)
                starts = np.cumsum((0,) + sizes)
                for k, piece in zip(read_ids, piece_of):
                    wanted = [row for _, row in planned.positions(k, planned.reads[k][3])]
                    assert list(rows[starts[piece]:starts[piece + 1]]) == wanted
            # How many view and rows reads read each batch of this forward; which of them read
            # part of an earlier forward's result.
            first = planned.schedule.first_batch
            plain = [(k, r) for k, r in enumerate(planned.reads) if r[0] != "multi"]
            assert list(planned.readers) == [
                sum(r[1] == b for _, r in plain)
                for b in range(first, first + len(planned.schedule.batches))]
            assert list(planned.earlier) == [
                k for k, r in plain if r[1] < first and
                not (r[0] == "view" and r[2] == 0 and r[3] == batch_sizes[r[1]])]


# ---- reads of an earlier forward's results: one gradient buffer per result ----------------------
# Step patterns of rows read from a 12-row encoder result by each later forward: scattered,
# a run, out of order with a repeat.
STEP_ROWS = [lambda s: [s % 12, (s + 5) % 12], lambda s: [3, 4, 5], lambda s: [11, 0, 7, 7]]


def _encoder_then_steps(W, E, rows, backwards):
    """Encode 12 tokens in one forward, then 6 forwards that each score some encoder rows;
    backward `backwards` times (retain_graph between); the gradients of the last one."""
    with fb.Graph() as g:
        states = [fb.tanh(W @ fb.lookup(E, i)) for i in range(12)]
        g.forward()
        losses = []
        for step in range(6):
            losses += [fb.sum_elems(fb.tanh(W @ states[r])) for r in rows(step)]
            g.forward()
        loss = fb.esum(losses)
        for _ in range(backwards):
            W.grad = E.grad = None
            loss.backward(retain_graph=True)
    return W.grad, E.grad


# An encoder result of 12 x 4 is read as it is, one of 12 x 512 through its gradient sink.
WIDTHS = pytest.mark.parametrize("width", [4, 512], ids=["small result", "large result"])


@WIDTHS
@pytest.mark.parametrize("rows", STEP_ROWS)
@pytest.mark.parametrize("backwards", [1, 2])
def test_reads_of_an_earlier_forward_give_eager_gradients_also_on_a_second_backward(rows,
                                                                                   backwards,
                                                                                   width):
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(width, width, dtype=torch.float64) / width ** 0.5)
    E = torch.nn.Parameter(torch.randn(12, width, dtype=torch.float64))
    states = [torch.tanh(W @ E[i]) for i in range(12)]
    eager = sum(torch.tanh(W @ states[r]).sum() for step in range(6) for r in rows(step))
    expected = torch.autograd.grad(eager, (W, E))
    for got, want in zip(_encoder_then_steps(W, E, rows, backwards), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@WIDTHS
def test_reads_of_a_large_result_of_an_earlier_forward_make_one_gradient_buffer_not_one_per_read(
        width):
    from torch.utils._python_dispatch import TorchDispatchMode

    class FullSizeZeros(TorchDispatchMode):
        """Counts the tensors of the encoder result's size that backward zero-fills."""

        def __init__(self, shape):
            super().__init__()
            self.shape, self.count = shape, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.zeros, torch.ops.aten.zeros_like,
                                       torch.ops.aten.new_zeros, torch.ops.aten.fill_,
                                       torch.ops.aten.zero_) and \
                    isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape:
                self.count += 1
            return out

    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(width, width))
    E = torch.nn.Parameter(torch.randn(12, width))
    with fb.Graph() as g:
        states = [fb.tanh(W @ fb.lookup(E, i)) for i in range(12)]
        g.forward()
        encoder = g.values[g.position(states[0].id)[0]]
        losses = []
        for step in range(20):  # 20 later forwards, each reading two scattered rows
            losses += [fb.sum_elems(W @ states[(step * 5 + k) % 12]) for k in (0, 7)]
            g.forward()
        loss = fb.esum(losses)
        counting = FullSizeZeros(tuple(encoder.shape))
        with counting:
            loss.backward()
    # A small result (under SINK_MIN_ELEMENTS) is read as autograd reads it: a zero tensor per
    # read (one per forward here), which costs less than a sink.
    assert (encoder.numel() >= execution.SINK_MIN_ELEMENTS) == (width == 512)
    assert counting.count == (1 if width == 512 else 20)


# ---- concat of rows of one result: one stacked read, eager values and gradients ----------------
# Each step scores three concats of encoder rows (one repeated), and reads two encoder rows with
# other ops too (so the result is also read in pieces); "mixed" adds a concat reading another
# result, so its batch reads argument by argument.
FEATURES = [(0, 2, 5), (5, 5, 1), (3, 4, 0)]


def _scored_features(W, E, U, strategy, earlier, mixed):
    """Losses and gradients of two steps over a 6-token encoder: computed by the steps'
    forward (earlier=False) or by an earlier one, each step then its own forward."""
    with fb.Graph(strategy=strategy) as g:
        states = [fb.tanh(W @ fb.lookup(E, i)) for i in range(6)]
        other = fb.sigmoid(W @ fb.lookup(E, 1))
        if earlier:
            g.forward()
        losses = []
        for step in range(2):
            features = [[states[(i + step) % 6] for i in f] for f in FEATURES]
            if mixed:
                features.append([states[step], other, states[4]])
            losses += [fb.sum_elems(U @ fb.concat(f)) for f in features]
            losses += [fb.sum_elems(fb.sigmoid(states[i])) for i in (1, 3 + step)]
            if earlier:
                g.forward()
        loss = fb.esum(losses)
        loss.backward()
        return [v.item() for v in losses], (W.grad, E.grad, U.grad)


@pytest.mark.parametrize("strategy", ["none", "depth", "agenda", "auto"])
@pytest.mark.parametrize("earlier", [False, True], ids=["this forward", "earlier forward"])
@pytest.mark.parametrize("mixed", [False, True], ids=["one result", "mixed"])
def test_a_concat_of_rows_of_one_result_gives_eager_values_and_gradients(strategy, earlier,
                                                                        mixed):
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    E = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.float64))
    U = torch.nn.Parameter(torch.randn(2, 12, dtype=torch.float64))
    states = [torch.tanh(W @ E[i]) for i in range(6)]
    other = torch.sigmoid(W @ E[1])
    losses = []
    for step in range(2):
        features = [[states[(i + step) % 6] for i in f] for f in FEATURES]
        if mixed:
            features.append([states[step], other, states[4]])
        losses += [(U @ torch.cat(f)).sum() for f in features]
        losses += [torch.sigmoid(states[i]).sum() for i in (1, 3 + step)]
    expected = torch.autograd.grad(sum(losses), (W, E, U))
    values, grads = _scored_features(W, E, U, strategy, earlier, mixed)
    torch.testing.assert_close(values, [v.item() for v in losses], rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _autograd_functions(tensor: torch.Tensor) -> list[str]:
    """The names of the autograd functions `tensor` was computed through (each once)."""
    seen, todo, names = set(), [tensor.grad_fn], []
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.append(type(fn).__name__)
        todo += [next_fn for next_fn, _ in fn.next_functions]
    return names


@pytest.mark.parametrize("strategy", ["none", "depth", "agenda", "auto"])
def test_a_forward_reads_rows_of_several_earlier_results_through_one_autograd_function(strategy,
                                                                                      monkeypatch):
    monkeypatch.setattr(execution, "SINK_MIN_ELEMENTS", 0)  # every result behind its sink
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    E = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.float64))
    with fb.Graph(strategy=strategy) as g:
        sequences = []
        for offset in (0, 1):  # two sequences: each step's result holds two rows
            h, states = fb.zeros(4), []
            for i in range(3):
                h = fb.tanh(W @ h + fb.lookup(E, i + offset))
                states.append(h)
            sequences.append(states)
        g.forward()
        # Rows of three results, one of them read twice.
        reads = [sequences[0][0], sequences[0][2], sequences[1][1], sequences[0][2]]
        losses = [fb.sum_elems(fb.sigmoid(W @ h)) for h in reads]
        value = fb.esum(losses).value()
        value.backward()
    if strategy != "none":  # (one batch per node: no result holds two rows)
        assert _autograd_functions(value).count("_SinkReadsBackward") == 1
    eager = []
    for offset in (0, 1):
        h, states = torch.zeros(4, dtype=torch.float64), []
        for i in range(3):
            h = torch.tanh(W @ h + E[i + offset])
            states.append(h)
        eager.append(states)
    expected = sum(torch.sigmoid(W @ h).sum()
                   for h in [eager[0][0], eager[0][2], eager[1][1], eager[0][2]])
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip((W.grad, E.grad), torch.autograd.grad(expected, (W, E))):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("strategy", ["none", "depth", "agenda", "auto"])
def test_a_concat_of_rows_of_many_small_earlier_results_gives_eager_values_and_gradients(
        strategy, monkeypatch):
    """Ten features, each a row of another step's result (one part per result): read as one
    cat of the whole results and one index_select (`_rows_of_small_results`)."""
    whole_reads = []
    read = execution._rows_of_small_results
    monkeypatch.setattr(execution, "_rows_of_small_results",
                        lambda *args: whole_reads.append(read(*args)) or whole_reads[-1])
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    E = torch.nn.Parameter(torch.randn(12, 4, dtype=torch.float64))
    U = torch.nn.Parameter(torch.randn(2, 40, dtype=torch.float64))
    picks = [[(5 * k + step) % 12 for k in range(10)] for step in range(2)]  # out of order
    with fb.Graph(strategy=strategy) as g:
        h, states = fb.zeros(4), []
        for i in range(12):
            h = fb.tanh(W @ h + fb.lookup(E, i))
            states.append(h)
        g.forward()
        losses = []
        for rows in picks:
            losses.append(fb.sum_elems(U @ fb.concat([states[r] for r in rows])))
            g.forward()
        fb.esum(losses).backward()
        values = [loss.item() for loss in losses]
    assert any(t is not None for t in whole_reads)
    h, eager = torch.zeros(4, dtype=torch.float64), []
    for i in range(12):
        h = torch.tanh(W @ h + E[i])
        eager.append(h)
    expected = [(U @ torch.cat([eager[r] for r in rows])).sum() for rows in picks]
    torch.testing.assert_close(values, [v.item() for v in expected], rtol=1e-12, atol=1e-12)
    for got, want in zip((W.grad, E.grad, U.grad), torch.autograd.grad(sum(expected), (W, E, U))):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _attention_steps(B, W, E, q, steps: int = 12):
    """Per step, attention weights over 3 and over 3..5 source rows (`B` is fb or an eager
    twin): results padded to their batch's longest, one forward per step when `B` is fb."""
    short, longer = [], []
    for k in range(steps):
        weights = []
        for length in (3, 3 + k % 3):
            M = B.stack([B.tanh(W @ B.lookup(E, (k + j) % 20)) for j in range(length)])
            weights.append(B.softmax(M @ q))
        if B is fb:
            weights[1].value()
        short.append(weights[0])
        longer.append(weights[1])
    return short, longer


@pytest.mark.parametrize("strategy", ["none", "depth", "agenda", "auto"])
def test_reads_of_many_earlier_padded_results_and_a_parameter_give_eager_values_and_gradients(
        strategy):
    """A later forward reads one node of each of twelve earlier forwards' results, stored padded
    to different widths, with a parameter among them: in one batch of a plain op (W3 @ a), of
    a padded one (tanh of vectors of 3..5), as picks, and stacked by forward(stack=True)."""
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    E = torch.nn.Parameter(torch.randn(20, 3, dtype=torch.float64))
    q = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    W3 = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
    v = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    params = (W, E, q, W3, v)
    with fb.Graph(strategy=strategy) as g:
        short, longer = _attention_steps(fb, W, E, q)
        short = short + [fb.parameter(v)]
        stacked = g.forward(short, stack=True)
        loss = fb.esum([fb.sum_elems(fb.tanh(W3 @ a)) for a in short]
                       + [fb.sum_elems(fb.tanh(a) * 2.0) + a[0] for a in longer])
        square_sum = (stacked * stacked).sum()  # a torch tensor, with the graph's history
        value = loss.item() + square_sum.item()
        loss.backward()
        square_sum.backward()
    short, longer = _attention_steps(eager, W, E, q)
    short = short + [v]
    expected = (sum(torch.tanh(W3 @ a).sum() for a in short)
                + sum((torch.tanh(a) * 2.0).sum() + a[0] for a in longer)
                + (torch.stack(short) ** 2).sum())
    torch.testing.assert_close(value, expected.item(), rtol=1e-12, atol=1e-12)
    for got, want in zip([p.grad for p in params], torch.autograd.grad(expected, params)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
