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
