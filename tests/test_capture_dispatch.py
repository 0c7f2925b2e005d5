"""torch's Python-level functions (F.softmax, F.cross_entropy, torch.functional, Tensor methods of
torch/_tensor.py) reach the capture mode through `_core.handle_torch_function`, flybatch's C
version of torch.overrides.handle_torch_function: these tests hold it to torch's semantics with
other modes stacked, errors, threads, and outside graphs."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import flybatch as fb
from flybatch import _core


class Calls(TorchFunctionMode):
    """A user's mode: notes each function it sees and its `types`, then runs it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append((getattr(func, "__name__", ""), types))
        return func(*args, **(kwargs or {}))


def mode_stack() -> list:
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]


def test_torch_python_functions_dispatch_through_flybatch_and_torch_keeps_its_own():
    for module in (F, torch.functional, torch._tensor):
        assert module.handle_torch_function is _core.handle_torch_function
    assert torch.overrides.handle_torch_function is not _core.handle_torch_function


def test_a_functional_call_on_an_expression_is_recorded_with_eager_values():
    with fb.Graph():
        x = fb.input(torch.tensor([0.5, -1.0, 2.0]))
        y = F.softmax(x, -1)
        parts = x.split(1)  # Tensor.split is Python (torch/_tensor.py)
        assert isinstance(y, fb.Expression) and all(isinstance(p, fb.Expression) for p in parts)
        torch.testing.assert_close(y.value(), F.softmax(torch.tensor([0.5, -1.0, 2.0]), -1))
        assert [p.value().item() for p in parts] == [0.5, -1.0, 2.0]


def test_a_users_mode_inside_a_graph_sees_the_call_first_and_it_is_still_recorded():
    with fb.Graph():
        x = fb.input(torch.ones(3))
        with Calls() as user:
            y = F.softmax(x, -1)
        assert isinstance(y, fb.Expression)
    assert user.seen[0][0] == "softmax" and user.seen[0][1] == (fb.Expression,)


def test_a_users_mode_under_a_graph_sees_the_calls_that_run_eagerly():
    with Calls() as user:
        with fb.Graph():
            out = F.softmax(torch.zeros(2), 0)
    assert type(out) is torch.Tensor and torch.equal(out, torch.full((2,), 0.5))
    assert ("softmax", (torch.Tensor,)) in user.seen


def test_an_error_in_a_recorded_functional_call_leaves_the_mode_stack_as_it_was():
    with fb.Graph():
        before = mode_stack()
        logits = fb.input(torch.zeros(1, 3))
        with pytest.raises(IndexError, match="F.cross_entropy: target 7"):
            F.cross_entropy(logits, torch.tensor([7]))
        with pytest.raises(TypeError, match="unsupported operand"):  # NotImplemented throughout
            "a" - torch.ones(2)
        assert mode_stack() == before
        assert isinstance(F.cross_entropy(logits, torch.tensor([2])), fb.Expression)


def test_functional_calls_outside_graphs_are_torch_own():
    class Logged(torch.Tensor):
        pass

    plain, logged = torch.ones(2), torch.ones(2).as_subclass(Logged)
    assert torch.equal(F.softmax(plain, 0), torch.full((2,), 0.5))
    with Calls() as user:  # a mode of the user's, no graph: the types as torch gives them
        F.softmax(plain, 0)
        F.mse_loss(plain, logged)
    assert user.seen == [("softmax", (torch.Tensor,)), ("mse_loss", (Logged, torch.Tensor))]
    with torch._C.DisableTorchFunction(), fb.Graph():
        assert type(F.softmax(plain, 0)) is torch.Tensor


def test_each_thread_records_into_its_own_graph():
    results, barrier = {}, threading.Barrier(2)

    def work(k):
        with fb.Graph() as g:
            barrier.wait()
            x = fb.input(torch.full((2,), float(k)))
            outs = [F.log_softmax(x * i, 0) for i in range(50)]
            results[k] = (all(o.graph is g for o in outs), len(mode_stack()))
        results[k] += (len(mode_stack()),)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: (True, 1, 0), 1: (True, 1, 0)}


def test_a_calls_key_tells_floats_and_bools_apart_as_capture_key_does():
    from flybatch import capture

    constants = (1.5, -0.0, 0.0, float("nan"), True, 1, "sum", None)
    with fb.Graph() as g:
        x = fb.input(torch.ones(3))
        key = _core.take_apart(g, (x,) + constants, None, ())[-1]
    assert key == ("#",) + tuple(capture._key(c) for c in constants)
    assert len(set(key)) == len(key)  # -0.0 is not 0.0, True is not 1


def test_a_call_taken_by_its_known_plan_adds_only_its_own_nodes():
    W = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.float64))
    b = torch.nn.Parameter(torch.randn(6, dtype=torch.float64))
    frozen = torch.randn(6, 4, dtype=torch.float64)  # no grad: the generic path, 3 nodes
    x0 = torch.randn(4, dtype=torch.float64)
    expected = F.linear(x0, W, b).detach()
    with fb.Graph() as g:
        x = fb.input(x0)
        calls = [(lambda: F.linear(x, W, b), 1), (lambda: F.linear(x, W), 1),
                 (lambda: x.unsqueeze(0), 0), (lambda: x.chunk(2), 2),  # (a view: no node)
                 (lambda: F.linear(x, frozen), 3)]
        for call, nodes in calls:
            call()  # the first sight makes the plan (and W's, b's parameter nodes)
            for _ in range(3):
                before = g.n_nodes
                out = call()
                assert g.n_nodes - before == nodes
        torch.testing.assert_close(F.linear(x, W, b).value(), expected)
        assert [p.value().tolist() for p in x.chunk(2)] == [x0[:2].tolist(), x0[2:].tolist()]


def test_a_known_plans_later_nodes_batch_as_eager_grad_modes_and_weights_say():
    # A plan's node is learnt from its first one, but a node written under no_grad has a
    # signature of its own, and a product by another weight (an expression) another launch.
    W = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.float64))
    xs0 = [torch.randn(4, dtype=torch.float64) for _ in range(4)]
    with fb.Graph(strategy="agenda") as g:
        xs = [fb.input(x0) for x0 in xs0]
        V = fb.input(torch.randn(3, 4, dtype=torch.float64)) * 1.0  # a weight that is no parameter
        first, again = F.linear(xs[0], W), F.linear(xs[1], W)
        with torch.no_grad():
            quiet = F.linear(xs[2], W)
        by_v = [F.linear(xs[3], V), F.linear(xs[0], V)]
        after = F.linear(xs[3], W)
        sig = g.sig_of
        assert sig(first.id) == sig(again.id) == sig(after.id) != sig(quiet.id)
        assert g.is_no_grad(quiet.id) and not g.is_no_grad(after.id)
        assert sig(by_v[0].id) == sig(by_v[1].id) != sig(first.id)
        values = [e.value() for e in (first, again, quiet, after)]
        assert not values[2].requires_grad and values[3].requires_grad
    for got, x0 in zip(values, [xs0[0], xs0[1], xs0[2], xs0[3]]):
        torch.testing.assert_close(got.detach(), F.linear(x0, W).detach(), rtol=0, atol=1e-12)


def test_the_capture_mode_and_an_expression_give_by_c_string_what_getattr_gives():
    # torch looks __torch_function__ up with PyObject_GetAttrString (on a mode) and by C string
    # through tp_getattr (on an argument), which both types answer with their own tp_getattr
    # (csrc/capture.cpp mode_getattr, csrc/store.cpp expression_getattr)
    import ctypes

    from flybatch import capture

    by_c_string = ctypes.pythonapi.PyObject_GetAttrString
    by_c_string.restype, by_c_string.argtypes = ctypes.py_object, [ctypes.py_object, ctypes.c_char_p]
    with fb.Graph():
        x = fb.input(torch.ones(2))
    for obj, names in ((capture._Capture(), ("__torch_function__", "__enter__", "__class__")),
                       (x, ("__torch_function__", "graph", "id", "shape", "value"))):
        for name in names:
            assert by_c_string(obj, name.encode()) == getattr(obj, name)
        with pytest.raises(AttributeError):
            by_c_string(obj, b"no_such_attribute")


# ---- shortcuts: the hot torch functions straight to the mode ----------------------------------
SIGMOID, LINEAR, CAT, TENSOR = torch.sigmoid, F.linear, torch.cat, torch.tensor  # torch's own


def test_hot_torch_functions_are_shortcuts_only_while_a_graph_captures():
    assert torch.sigmoid is SIGMOID and F.linear is LINEAR
    with fb.Graph():
        with fb.Graph():  # nested: one set of shortcuts
            assert type(torch.sigmoid) is _core.Shortcut and type(F.linear) is _core.Shortcut
        assert torch.sigmoid.__wrapped__ is SIGMOID and F.linear.__wrapped__ is LINEAR
        assert (torch.sigmoid.__name__, F.linear.__name__) == ("sigmoid", "linear")
        assert torch.sigmoid.__doc__ == SIGMOID.__doc__ and "shortcut" in repr(torch.cat)
    assert torch.sigmoid is SIGMOID and F.linear is LINEAR and torch.cat is CAT


def test_a_shortcut_records_what_torchs_own_route_records():
    torch.manual_seed(0)
    W, b = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(3))
    x_value = torch.randn(4)
    expected = F.linear(x_value, W, b).detach()
    with fb.Graph() as g:
        x = fb.input(x_value)

        def both(call):
            """(the call through the shortcut, through torch's own function), and the nodes
            each added (after a first call, which made the parameters' nodes)."""
            call(lambda f: f.__wrapped__)
            made = []
            for route in (lambda f: f, lambda f: f.__wrapped__):
                start = g.n_nodes
                made.append((call(route), g.n_nodes - start))
            return made

        pairs = [both(lambda r: r(torch.sigmoid)(x)),
                 both(lambda r: r(F.linear)(x, W, b)),
                 both(lambda r: r(torch.cat)([x, x])),
                 both(lambda r: r(torch.cat)([x, x], dim=-1))]
        for (short, short_nodes), (own, own_nodes) in pairs:
            assert isinstance(short, fb.Expression) and isinstance(own, fb.Expression)
            assert short.shape == own.shape and short_nodes == own_nodes
            torch.testing.assert_close(short.value(), own.value(), rtol=0, atol=0)
        torch.testing.assert_close(pairs[1][0][0].value(), expected)


def test_a_shortcut_call_on_plain_tensors_runs_or_records_as_the_mode_decides():
    E = torch.nn.Parameter(torch.randn(5, 2))
    with fb.Graph():
        index = torch.tensor([3])
        assert type(index) is torch.Tensor and index.tolist() == [3]
        assert type(torch.sigmoid(torch.zeros(2))) is torch.Tensor  # no graph in it: runs
        row = F.embedding(index, E)  # a parameter that requires grad: recorded
        assert isinstance(row, fb.Expression)
        torch.testing.assert_close(row.value(), E.detach()[3:4])


def test_a_name_someone_else_rebound_is_left_alone(monkeypatch):
    def tanh(x):
        return "mine"

    monkeypatch.setattr(torch, "tanh", tanh)
    with fb.Graph():
        assert torch.tanh is tanh
    assert torch.tanh is tanh


def test_threads_share_the_shortcuts_until_the_last_graph_closes():
    opened, release, seen = threading.Event(), threading.Event(), {}

    def capture_in_a_thread():
        with fb.Graph():
            opened.set()
            release.wait(10)
            seen["recorded"] = isinstance(torch.sigmoid(fb.input(torch.zeros(2))), fb.Expression)

    worker = threading.Thread(target=capture_in_a_thread)
    worker.start()
    opened.wait(10)
    with fb.Graph():
        pass
    assert type(torch.sigmoid) is _core.Shortcut  # the other thread still captures
    eager = torch.sigmoid(torch.zeros(2))  # this thread does not: torch's own result
    assert type(eager) is torch.Tensor and torch.equal(eager, torch.full((2,), 0.5))
    release.set()
    worker.join()
    assert seen == {"recorded": True} and torch.sigmoid is SIGMOID


def test_a_parameters_indexing_is_a_method_shortcut_only_while_a_graph_captures():
    U = torch.nn.Parameter(torch.randn(2, 3, 3))
    assert "__getitem__" not in vars(torch.nn.Parameter)  # torch.Tensor's slot
    with fb.Graph():
        assert type(vars(torch.nn.Parameter)["__getitem__"]) is _core.MethodShortcut
        x = fb.input(torch.ones(3))
        y = F.linear(x, U[1])
        torch.testing.assert_close(y.value(), U.detach()[1] @ torch.ones(3))
    assert "__getitem__" not in vars(torch.nn.Parameter)
    assert torch.equal(U[0], U.data[0]) and U[0].requires_grad


def test_tensor_methods_of_an_expression_record_as_their_torch_functions():
    assert type(vars(fb.Expression)["chunk"]) is _core.RecordedMethod
    with fb.Graph():
        x = fb.input(torch.arange(6.0))
        parts = x.chunk(3, -1)  # bound as a method: the expression is its first argument
        assert [p.value().tolist() for p in parts] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
        assert x.sum(dim=0).value().item() == 15.0  # keywords too


def test_the_cyclic_collector_pauses_while_a_graph_records_and_runs_after():
    import gc
    import weakref

    class Node:
        pass

    assert gc.isenabled()
    with fb.Graph():
        assert not gc.isenabled()
        cycle = Node()
        cycle.self = cycle
        alive = weakref.ref(cycle)
        del cycle
    assert gc.isenabled()
    gc.collect()
    assert alive() is None  # cyclic garbage made inside the block is collected after it
    seen = []

    class Recording(fb.Graph):
        def close(self, *args, **kwargs):
            seen.append(gc.isenabled())
            super().close(*args, **kwargs)

    with Recording():
        pass
    assert seen == [False] and gc.isenabled()  # paused until the graph has freed its objects
    gc.disable()  # a collector the user turned off stays off
    try:
        with fb.Graph():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_arguments_given_by_keyword_are_recorded_as_torch_binds_them():
    # `F.linear(input=x, weight=W)`: torch takes any parameter by name; so does the capture
    # (the leading ones are put in place; `reduction=`, `inplace=` stay keywords).
    torch.manual_seed(0)
    W, b = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(3))
    x_value = torch.randn(4)
    calls = [
        lambda x: F.linear(input=x, weight=W, bias=b),
        lambda x: F.linear(x, weight=W),
        lambda x: torch.cat(tensors=[x, x], dim=0),
        lambda x: torch.sigmoid(input=x),
        lambda x: x.chunk(chunks=2)[1],
        lambda x: F.cross_entropy(input=F.linear(x, W, b).unsqueeze(0), target=torch.tensor([2]),
                                  reduction="sum"),
    ]
    eager = [call(x_value) for call in calls]
    sum(e.sum() for e in eager).backward()
    grads = (W.grad.clone(), b.grad.clone())
    W.grad = b.grad = None
    with fb.Graph():
        x = fb.input(x_value)
        recorded = [call(x) for call in calls]
        for r, e in zip(recorded, eager):
            assert isinstance(r, fb.Expression)
            torch.testing.assert_close(r.value(), e.detach(), rtol=1e-6, atol=1e-6)
        fb.esum([r.sum() for r in recorded]).backward()
    torch.testing.assert_close((W.grad, b.grad), grads, rtol=1e-6, atol=1e-6)
    with fb.Graph():  # in place by keyword still refused, naming the function
        with pytest.raises(TypeError, match=r"relu\(inplace=True\)"):
            F.relu(input=fb.input(x_value), inplace=True)
