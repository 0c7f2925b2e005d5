"""The user-facing API: the README example, operators, values, `stats()`, sparse lookups, float64.
"""

from __future__ import annotations

import re
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import eager
import flybatch as fb
from flybatch.graph import STRATEGIES

F64 = torch.float64
TOL = eager.TOLERANCE[F64]

README_EXAMPLE = textwrap.dedent("""\
    import torch, flybatch as fb
    W = torch.nn.Parameter(torch.randn(64, 96) * 0.1); b = torch.nn.Parameter(torch.zeros(64))
    E = torch.nn.Parameter(torch.randn(1000, 32) * 0.1)
    U = torch.nn.Parameter(torch.randn(5, 64) * 0.1)
    opt = torch.optim.SGD([W, b, E, U], lr=0.1)
    batch = [([3, 14, 15], 2), ([9, 2], 0), ([6, 5, 3, 5, 8], 4)]
    with fb.Graph(strategy="agenda") as g:
        losses = []
        for words, label in batch:
            h = fb.zeros(64)
            for w in words:
                h = fb.tanh(W @ fb.concat([h, fb.lookup(E, w)]) + b)
            losses.append(fb.pick_neg_log_softmax(U @ h, label))
        loss = fb.esum(losses)
        print(loss.item())
        loss.backward()
    opt.step()
    print(g.stats())
""")


# ---- the README example --------------------------------------------------------------------------
def test_readme_example_runs_as_written(capsys):
    torch.manual_seed(0)
    namespace: dict = {}
    exec(compile(README_EXAMPLE, "README.md", "exec"), namespace)
    printed = capsys.readouterr().out.splitlines()
    loss = float(printed[0])
    assert 0 < loss < 3 * np.log(5) + 1  # three near-uniform 5-way losses
    assert printed[1].startswith("strategy agenda:")
    assert namespace["W"].grad is not None and namespace["E"].grad is not None


def test_readme_md_per_instance_example_runs_as_written(capsys):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S)
              if "fb.Graph(" in b and "opt.step()" in b]
    assert blocks, "README.md has no per-instance training example"
    torch.manual_seed(0)
    exec(compile(blocks[0], "README.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert float(printed[0]) > 0
    assert printed[1].startswith("strategy ")


def test_readme_example_loss_equals_the_eager_loss(capsys):
    torch.manual_seed(0)
    namespace: dict = {}
    exec(compile(README_EXAMPLE, "README.md", "exec"), namespace)
    loss = float(capsys.readouterr().out.splitlines()[0])
    torch.manual_seed(0)
    W, b = torch.randn(64, 96) * 0.1, torch.zeros(64)
    E, U = torch.randn(1000, 32) * 0.1, torch.randn(5, 64) * 0.1
    expected = 0.0
    for words, label in namespace["batch"]:
        h = torch.zeros(64)
        for w in words:
            h = torch.tanh(W @ torch.cat([h, E[w]]) + b)
        expected += -torch.log_softmax(U @ h, 0)[label].item()
    assert loss == pytest.approx(expected, rel=1e-5)


# ---- operators -----------------------------------------------------------------------------------
W = torch.nn.Parameter(torch.randn(2, 3, dtype=F64))
Y = torch.randn(3, dtype=F64)

OPERATORS = {
    "W @ x (Parameter on the left)": lambda B, x: W @ x,
    "x @ W.T-shaped tensor": lambda B, x: x @ torch.ones(3, 2, dtype=F64),
    "x @ y": lambda B, x: x @ B.input(Y),
    "2 * x": lambda B, x: 2 * x,
    "x * 2": lambda B, x: x * 2,
    "1 - x": lambda B, x: 1 - x,
    "x - 1": lambda B, x: x - 1,
    "1 + x": lambda B, x: 1 + x,
    "x / 3": lambda B, x: x / 3,
    "3 / (1 + x * x)": lambda B, x: 3 / (1 + x * x),
    "-x": lambda B, x: -x,
    "x + y": lambda B, x: x + B.input(Y),
    "x * y": lambda B, x: x * B.input(Y),
    "x / y": lambda B, x: x / B.input(Y),
    "tensor + x": lambda B, x: torch.ones(3, dtype=F64) + x,
    "x - tensor": lambda B, x: x - torch.ones(3, dtype=F64),
    "x[1]": lambda B, x: x[1],
    "x[-1]": lambda B, x: x[-1],
    "x[0:2]": lambda B, x: x[0:2],
    "x[1:]": lambda B, x: x[1:],
    "x[:-1]": lambda B, x: x[:-1],
    "(W @ x)[1]": lambda B, x: (W @ x)[1],
}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", sorted(OPERATORS))
def test_operator_matches_pytorch(name, strategy):
    def build(B):
        return [OPERATORS[name](B, B.tanh(W.T @ B.input(torch.tensor([k, 1.0 - k], dtype=F64))))
                for k in (0.5, -1.0)]

    expected = eager.run(eager, strategy, F64, build, [W])
    actual = eager.run(fb, strategy, F64, build, [W])
    eager.assert_same(actual, expected, F64)


def test_operators_build_expressions_lazily():
    with fb.Graph() as g:
        x = fb.input([1.0, 2.0, 3.0])
        results = [2 * x, 1 - x, x / 3, -x, x[0], x[0:2], torch.ones(3) + x, x @ x]
        assert all(isinstance(r, fb.Expression) for r in results)
        assert g.stats().batches == 0


def test_iterating_an_expression_yields_its_rows_as_a_tensor_does():
    with fb.Graph():
        rows = list(fb.input([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))
        assert len(rows) == 3 and all(r.shape == (2,) for r in rows)
        assert [r.value().tolist() for r in rows] == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
        assert [float(x) for x in fb.input([1.0, 2.0])] == [1.0, 2.0]
        with pytest.raises(TypeError, match="0-d"):
            list(fb.sum_elems(fb.input([1.0, 2.0])))


# ---- values --------------------------------------------------------------------------------------
def test_forward_returns_the_values_of_the_given_expressions():
    with fb.Graph() as g:
        x = fb.input([1.0, -2.0])
        a, b = fb.tanh(x), fb.sum_elems(x)
        values = g.forward([a, b])
        assert len(values) == 2
        torch.testing.assert_close(values[0], torch.tanh(torch.tensor([1.0, -2.0])))
        torch.testing.assert_close(values[1], torch.tensor(-1.0))


def test_forward_without_expressions_computes_everything_and_returns_none():
    with fb.Graph() as g:
        y = fb.tanh(fb.input([1.0]))
        assert g.forward() is None
        assert "done" in repr(y)


def test_value_conversions():
    with fb.Graph():
        x = fb.input([0.5, 3.0, -1.0])
        s = fb.sum_elems(x)
        assert s.item() == pytest.approx(2.5)
        assert float(s) == pytest.approx(2.5)
        assert int(fb.pick(x, 1)) == 3
        assert x.argmax() == 1
        np.testing.assert_allclose(x.numpy(), [0.5, 3.0, -1.0])
        assert bool(fb.pick(x, 0)) is True
        assert s > 2 and s < 3 and s >= 2.5 and s <= 2.5


def test_expressions_hash_by_identity_so_they_are_dict_keys_and_eq_compares_values():
    with fb.Graph(dtype=F64):
        x, y, z = fb.input([1.0]), fb.input([1.0]), fb.input([2.0])
        assert {x: 1, y: 2}[y] == 2 and len({x, y, x}) == 2  # hash and lookup: identity
        assert bool(x == y) and not bool(x != y) and bool(x != z)  # values, as torch's ==
        assert (x == z).dtype == torch.bool and (x == z).value().tolist() == [False]
        assert y in [x] and z not in [x, y]  # a list's `in` compares values, as with tensors


def test_shape_and_op_are_known_before_any_forward():
    with fb.Graph(dtype=W.dtype):
        x = fb.concat([fb.input(np.zeros(3)), fb.zeros(2)])
        assert x.shape == (5,) and x.op == "concat"
        assert (W @ fb.input([1.0, 2.0, 3.0])).shape == (2,)


@pytest.mark.parametrize("make", [
    lambda: fb.input([1.0, 2.0]),
    lambda: fb.input(np.array([1.0, 2.0])),
    lambda: fb.input(torch.tensor([1.0, 2.0])),
    lambda: fb.zeros(2) + 1.5,
    lambda: fb.ones(2) * 3,
], ids=["list", "ndarray", "tensor", "zeros + number", "ones * number"])
def test_float64_graph_computes_in_float64(make):
    with fb.Graph(dtype=F64):
        assert make().value().dtype == F64


def test_float64_graph_gives_float64_parameters_float64_gradients():
    p = torch.nn.Parameter(torch.randn(2, 2, dtype=F64))
    with fb.Graph(dtype=F64):
        fb.sum_elems(fb.tanh(p @ fb.input([1.0, 2.0]))).backward()
    assert p.grad.dtype == F64


def test_dropout_zeroes_or_scales_each_element():
    with fb.Graph(dtype=F64):
        y = fb.dropout(fb.ones(1000), 0.5).value()
    assert set(y.unique().tolist()) <= {0.0, 2.0}
    assert 300 < int((y == 0).sum()) < 700


def test_graph_is_current_inside_its_with_block_only():
    outer = fb.current_graph()
    with fb.Graph() as g:
        assert fb.current_graph() is g
        assert fb.input([1.0]).graph is g
    assert fb.current_graph() is outer and g.closed


# ---- stats ---------------------------------------------------------------------------------------
def three_chains(strategy="agenda"):
    """Three instances of tanh(W @ x): 3 inputs + 1 parameter, 6 ops in 2 batches of 3."""
    M = torch.nn.Parameter(torch.randn(4, 3))
    g = fb.Graph(strategy=strategy)
    with g:
        loss = fb.esum([fb.sum_elems(fb.tanh(M @ fb.input(torch.randn(3)))) for _ in range(3)])
        loss.backward()
    return g.stats()


def test_stats_count_nodes_and_launches():
    stats = three_chains()
    assert stats.strategy == "agenda"
    assert stats.nodes == 3 + 1 + 3 * 3 + 1  # inputs, W, (matmul, tanh, sum_elems) x3, esum
    assert stats.batches == 4


def test_stats_batch_sizes_count_launches_per_size():
    assert three_chains().batch_sizes == Counter({3: 3, 1: 1})
    assert three_chains("none").batch_sizes == Counter({1: 10})


def test_stats_by_signature_names_each_kernel():
    by_signature = three_chains().by_signature
    assert sum(by_signature.values()) == 4
    assert by_signature["tanh(4,)"] == 1
    assert by_signature["sum_elems(4,)"] == 1
    assert [k for k in by_signature if k.startswith("matmul")] and \
        [k for k in by_signature if k.startswith("esum")]


def test_stats_count_gathers_made_and_avoided():
    stats = three_chains()
    assert isinstance(stats.gathers, int) and isinstance(stats.gathers_avoided, int)
    assert stats.gathers + stats.gathers_avoided > 0


def test_stats_lower_bound_of_three_chains():
    stats = three_chains()
    assert stats.lower_bound == 4 == stats.batches


def test_stats_time_build_schedule_forward_and_backward():
    seconds = three_chains().seconds
    assert set(seconds) == {"build", "schedule", "forward", "backward"}
    assert all(t >= 0 for t in seconds.values())
    assert seconds["forward"] > 0 and seconds["backward"] > 0


def test_stats_print_as_a_readable_table():
    stats = three_chains()
    text = str(stats)
    assert "strategy agenda" in text
    assert f"{stats.nodes} nodes" in text and f"{stats.batches} launches" in text
    assert f"lower bound {stats.lower_bound}" in text
    for signature, launches in stats.by_signature.items():
        assert any(signature in line and str(launches) in line for line in text.splitlines())


# ---- sparse lookups ------------------------------------------------------------------------------
def lookup_loss(E, sparse, words=(3, 1, 3, 0), strategy="agenda"):
    with fb.Graph(strategy=strategy, dtype=F64):
        vectors = [fb.lookup(E, w, sparse=sparse) for w in words]
        loss = fb.esum([fb.sum_elems(fb.tanh(v) * float(k + 1)) for k, v in enumerate(vectors)])
        loss.backward()
        return loss.item()


def test_sparse_lookup_gives_a_sparse_gradient():
    E = torch.nn.Parameter(torch.randn(6, 4, dtype=F64))
    lookup_loss(E, sparse=True)
    assert E.grad.is_sparse


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sparse_lookup_gradient_equals_the_dense_one(strategy):
    E = torch.nn.Parameter(torch.randn(6, 4, dtype=F64))
    loss_sparse = lookup_loss(E, sparse=True, strategy=strategy)
    sparse_grad = E.grad.to_dense()
    E.grad = None
    loss_dense = lookup_loss(E, sparse=False, strategy=strategy)
    assert not E.grad.is_sparse
    assert loss_sparse == loss_dense
    torch.testing.assert_close(sparse_grad, E.grad, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("make, look_up", [
    (lambda: torch.nn.Embedding(6, 4, sparse=True), lambda emb, i: fb.lookup(emb, i)),
    (lambda: fb.nn.Embedding(6, 4, sparse=True), lambda emb, i: emb(i)),
], ids=["torch.nn.Embedding", "fb.nn.Embedding"])
def test_embedding_with_sparse_true_looks_up_sparsely_by_default(make, look_up):
    emb = make().double()
    with fb.Graph(dtype=F64):
        fb.sum_elems(look_up(emb, 2) + look_up(emb, 5)).backward()
    assert emb.weight.grad.is_sparse
    torch.testing.assert_close(emb.weight.grad.to_dense().sum(1),
                               torch.tensor([0, 0, 4, 0, 0, 4], dtype=F64))


def test_sparse_lookups_train_with_sparse_adam():
    E = torch.nn.Parameter(torch.randn(6, 4, dtype=F64))
    reference = torch.nn.Parameter(E.detach().clone())
    opt, ref_opt = torch.optim.SparseAdam([E], lr=0.1), torch.optim.SparseAdam([reference], lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        lookup_loss(E, sparse=True)
        opt.step()
        ref_opt.zero_grad()
        rows = torch.nn.functional.embedding(torch.tensor([3, 1, 3, 0]), reference, sparse=True)
        (torch.tanh(rows) * torch.arange(1, 5, dtype=F64)[:, None]).sum().backward()
        ref_opt.step()
    torch.testing.assert_close(E.detach(), reference.detach(), rtol=TOL, atol=TOL)


def test_rows_never_looked_up_are_not_touched_by_sparse_adam():
    E = torch.nn.Parameter(torch.randn(6, 4, dtype=F64))
    before = E.detach().clone()
    opt = torch.optim.SparseAdam([E], lr=0.1)
    lookup_loss(E, sparse=True)
    opt.step()
    assert torch.equal(E.detach()[[2, 4, 5]], before[[2, 4, 5]])
    assert not torch.equal(E.detach()[[0, 1, 3]], before[[0, 1, 3]])


# ---- one backward per instance -------------------------------------------------------------------
def per_instance_backwards(B, retain_graph):
    """Per-instance code that calls backward on each instance's loss separately."""
    P = torch.nn.Parameter(torch.linspace(-1, 1, 9, dtype=F64).reshape(3, 3))
    with B.Graph(dtype=F64):
        losses = [B.sum_elems(B.tanh(P @ B.input([float(k), 1.0, -1.0]))) for k in range(3)]
        for loss in losses:
            if retain_graph is None:
                loss.backward()
            else:
                loss.backward(retain_graph=retain_graph)
    return P.grad


def test_backward_per_instance_with_retain_graph_accumulates_the_eager_gradients():
    torch.testing.assert_close(per_instance_backwards(fb, retain_graph=True),
                               per_instance_backwards(eager, retain_graph=False),
                               rtol=TOL, atol=TOL)


def test_backward_per_instance_by_default_accumulates_the_eager_gradients():
    torch.testing.assert_close(per_instance_backwards(fb, retain_graph=None),
                               per_instance_backwards(eager, retain_graph=False),
                               rtol=TOL, atol=TOL)


def test_a_second_backward_of_one_expression_raises_as_eagerly():
    P = torch.nn.Parameter(torch.ones(3, dtype=F64))
    with fb.Graph(dtype=F64):
        loss = fb.sum_elems(fb.tanh(P * fb.input([1.0, 2.0, 3.0])))
        loss.backward()
        first = P.grad.clone()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()
    assert torch.equal(P.grad, first)  # not accumulated twice


def test_a_second_backward_after_retain_graph_accumulates_as_eagerly():
    P = torch.nn.Parameter(torch.ones(3, dtype=F64))
    with fb.Graph(dtype=F64):
        loss = fb.sum_elems(fb.tanh(P * fb.input([1.0, 2.0, 3.0])))
        loss.backward(retain_graph=True)
        first = P.grad.clone()
        loss.backward()
    torch.testing.assert_close(P.grad, 2 * first, rtol=TOL, atol=TOL)
