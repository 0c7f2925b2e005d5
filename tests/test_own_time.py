"""A graph's build time splits into flybatch's op calls and the user's own per-instance Python
(`_core.measure_own_time`, the bench's `build_user`)."""

import inspect
import time

import pytest
import torch

import flybatch as fb
from flybatch import _core


@pytest.fixture
def measuring():
    was = _core.measure_own_time(True)
    yield
    _core.measure_own_time(was)


def test_own_time_wraps_a_function_transparently():
    def scaled(x: float, factor: float = 2.0) -> float:
        """x times factor."""
        return x * factor

    wrapped = _core.own_time(scaled)
    assert wrapped(3) == 6 and wrapped(3, factor=3) == 9
    assert wrapped.__name__ == "scaled" and wrapped.__doc__ == "x times factor."
    assert wrapped.__wrapped__ is scaled
    assert inspect.signature(wrapped) == inspect.signature(scaled)

    class Model:
        __call__ = _core.own_time(lambda self, x: (self, x))

    model = Model()
    assert model(4) == (model, 4)


def test_own_time_passes_errors_through():
    def broken():
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        _core.own_time(broken)()
    with pytest.raises(TypeError, match="callable"):
        _core.own_time(3)


def test_the_users_python_between_ops_is_not_flybatch_time(measuring):
    W = torch.nn.Parameter(torch.randn(3, 4))
    with fb.Graph() as g:
        x = fb.tanh(W @ fb.input(torch.randn(4)))
        time.sleep(0.05)  # the user's own per-instance work
        loss = fb.sum_elems(x)
        loss.value()
    assert g.seconds["build"] >= 0.05
    assert 0 < g.seconds["build_flybatch"] < 0.05


def test_time_inside_an_own_time_function_is_flybatch_time(measuring):
    def slow_op(x):
        time.sleep(0.05)
        return fb.tanh(x)

    with fb.Graph() as g:
        _core.own_time(slow_op)(fb.input(torch.randn(4))).value()
    assert g.seconds["build_flybatch"] >= 0.05


def test_nested_op_calls_are_counted_once(measuring):
    cell = fb.nn.LSTMCell(4, 3)  # its call: own_time, around op calls that are own time too
    with fb.Graph() as g:
        before = _core.own_time_ns()
        start = time.perf_counter_ns()
        cell(fb.input(torch.randn(4)))
        elapsed = time.perf_counter_ns() - start
        assert 0 < _core.own_time_ns() - before <= elapsed


def test_not_measuring_adds_no_build_split():
    assert not _core.measure_own_time(False)  # off unless a benchmark switches it on
    with fb.Graph() as g:
        fb.tanh(fb.input(torch.randn(4))).value()
    assert "build_flybatch" not in g.seconds and g.seconds["build"] > 0
