"""`map_batched`: batch across instances even when control flow depends on computed values.

A transition parser asks for the scores of one step before it can build the next, so a plain
loop over sentences forwards once per step of every sentence and batches nothing. With

    losses = fb.map_batched(parse, sentences)    # parse(sentence): plain single-instance code

each call of `parse` runs in its own greenlet on one graph. When an instance asks for a value
that is not computed yet (`.value()`, `.item()`, `.numpy()`, `.argmax()`, `int()`, `float()`,
`bool()`, comparisons, `backward()`), the graph's `before_value_request` hook suspends it and
switches back to the driver loop (the caller of `map_batched`). A *round* resumes every suspended
instance once; when all of them are suspended again or finished, ONE batched forward runs over
everything pending (the nodes of all instances) and the next round starts. So the number of
forwards is the largest number of value requests of a single instance, not their sum; a request
for a value that is already computed returns at once and costs no round.

Semantics:
- `fn(item)` is called once per item, results come back in the order of `items`. Instances are
  started in that order and resumed in the order they were suspended; a round never depends on
  values, so the whole run is deterministic.
- Each instance runs in its own `contextvars` context, a copy of the caller's in which the graph
  of the run is current (`fb.current_graph()`), so ops that use the current graph need no
  `graph=` argument. The greenlet keeps that context across suspensions: a `with fb.Graph():` or
  a context variable set inside `fn` stays local to the instance, and the caller's is untouched.
- `fb.new_graph()` inside `fn` while the run's graph is current raises `GraphError` (closing or
  replacing that graph would pull it from under the other instances); start a fresh graph
  before calling `map_batched`, or use `with fb.Graph():` inside `fn` for a graph of its own.
- Torch's grad mode (`torch.no_grad()`, `torch.set_grad_enabled`) is per instance too: each
  starts in the caller's mode, its mode is saved and restored around each suspension, and the
  caller's mode is the same after the call. So is torch's torch-function state (its stack of
  modes, which holds the capture mode; torch takes the mode off for the length of a captured
  call, and a call that runs on values may wait for a round in the middle). Other
  thread-local torch state (inference mode, autocast) is not switched: use it around the
  `map_batched` call, not across a value request inside `fn`.
- Runs in different threads are independent (each thread has its own greenlets and current
  graph); one graph must not be used by two threads at once.
- Nested use works: an `fn` that calls `map_batched` on the same graph becomes the driver of its
  sub-instances, and when they all wait, it waits in turn as an instance of the outer run, so the
  sub-instances of every outer instance share the outer forwards. On another graph the inner run
  simply forwards that graph itself.
- An exception in instance k stops the run: the other started instances are killed (a
  `greenlet.GreenletExit` is thrown in at the point where they wait, so their `finally` blocks
  and context managers run; value requests made while unwinding are served synchronously), the
  hook is removed, and `MapBatchedError` is raised with `.index == k`, chained (`from`) to the
  original exception (BaseExceptions that are not Exceptions, e.g. KeyboardInterrupt, propagate
  unwrapped after the same clean-up). An exception raised by a batched forward between rounds
  belongs to no single instance and propagates unchanged (the graph's forward already rolled
  itself back). In both cases the graph stays usable: nodes created by the instances before the
  failure remain in it as ordinary pending nodes; they are valid, and the next forward computes
  them along with everything else (wasted work, no effect on any other value or gradient). Use a
  fresh graph per minibatch (`fb.new_graph()`) to drop them.
- `Graph.forward()` called explicitly inside `fn` does not suspend (it forwards what is pending
  right now, which is correct but batches less); ask for values instead.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable, Iterable, TypeVar

import greenlet
import torch

from . import capture
from .graph import Graph, _current, current_graph

__all__ = ["MapBatchedError", "map_batched"]

T = TypeVar("T")
R = TypeVar("R")

_SUSPENDED = object()  # what a suspending instance hands to its driver


class MapBatchedError(RuntimeError):
    """`fn(items[index])` raised `original` (also the `__cause__`) inside `map_batched`."""

    def __init__(self, index: int, original: BaseException):
        self.index = index
        self.original = original
        super().__init__(f"map_batched: instance {index} (fn(items[{index}])) raised "
                         f"{type(original).__name__}: {original}")

    def __reduce__(self):
        return type(self), (self.index, self.original)


class _Instance(greenlet.greenlet):
    """The greenlet running `fn(items[index])`; its parent is the driver that created it."""

    def __init__(self, run: "_Run", index: int, fn: Callable[..., Any]):
        super().__init__(fn)
        self.owner = run  # not `run`: greenlet calls `self.run` as its body
        self.index = index
        self.gr_context = run.context.copy()  # its own: the greenlet runs in it from start to end
        self.grad_enabled = run.grad_enabled  # torch keeps grad mode per thread, not per context
        self.torch_function_state = None  # (the driver's until it first suspends)


class _Run:
    """One call of `map_batched`: its graph, its driver greenlet and its instances."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.driver = greenlet.getcurrent()
        self.closing = False
        # Each instance's context is a copy of this one: the caller's, with the run's graph current.
        self.context = contextvars.copy_context()
        self.context.run(_current.set, graph)
        self.grad_enabled = torch.is_grad_enabled()  # the caller's: instances start in it

    def suspend(self, instance: _Instance) -> None:
        """Called in `instance`: wait until the driver has run the next batched forward."""
        self.driver.switch(_SUSPENDED)

    def enter(self, instance: _Instance, method: Callable[..., Any], *args: Any) -> Any:
        """Switch into `instance` (`method`: its switch or throw) in its own grad mode and
        torch-function state; back in the driver, the driver's again (set only on a change)."""
        if instance.grad_enabled != self.grad_enabled:
            torch.set_grad_enabled(instance.grad_enabled)
        driver_state = _torch_function_state()
        if instance.torch_function_state not in (None, driver_state):
            _set_torch_function_state(instance.torch_function_state)
        try:
            return method(*args)
        finally:
            instance.grad_enabled = torch.is_grad_enabled()
            if instance.grad_enabled != self.grad_enabled:
                torch.set_grad_enabled(self.grad_enabled)
            instance.torch_function_state = _torch_function_state()
            if instance.torch_function_state != driver_state:
                _set_torch_function_state(driver_state)


# Torch keeps its torch-function modes and switch per thread too. A value request can suspend an
# instance inside a torch call that the capture mode handles (`torch.nonzero(x)`, a sample of a
# distribution), where torch has taken the mode off its stack for the call: the instances that
# run meanwhile must still be captured, and the suspended one resumes as it left.
def _torch_function_state() -> tuple:
    stack = tuple(torch._C._get_function_stack_at(i)
                  for i in range(torch._C._len_torch_function_stack()))
    return torch._C._get_torch_function_state(), stack


def _set_torch_function_state(state: tuple) -> None:
    switch, stack = state
    while torch._C._len_torch_function_stack():
        torch._C._pop_torch_function_stack()
    for mode in stack:
        torch._C._push_on_torch_function_stack(mode)
    torch._C._set_torch_function_state(switch)


class _Hook:
    """A graph's `before_value_request` while runs on it are active (shared by nested runs)."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.previous = graph.before_value_request  # someone else's hook: chained, restored
        self.runs = 0

    def __call__(self) -> None:
        me = greenlet.getcurrent()
        if isinstance(me, _Instance) and me.owner.graph is self.graph and not me.owner.closing:
            me.owner.suspend(me)
        elif self.previous is not None:
            self.previous()


def _install(graph: Graph) -> _Hook:
    graph.map_batched_runs += 1
    hook = graph.before_value_request
    if not (isinstance(hook, _Hook) and hook.graph is graph):
        hook = _Hook(graph)
        graph.before_value_request = hook
    hook.runs += 1
    return hook


def _uninstall(graph: Graph, hook: _Hook) -> None:
    graph.map_batched_runs -= 1
    hook.runs -= 1
    if hook.runs == 0 and graph.before_value_request is hook:
        graph.before_value_request = hook.previous


def _forward(graph: Graph) -> None:
    """The driver's batched forward; a nested driver first waits as an instance of its own run.

    Like `Graph.value_of`: the suspended instances wait for nodes below `needed`; if the hook
    suspended this (nested) driver, the outer forward computed them, and nodes that other outer
    instances have created since are left for the next outer round.
    """
    needed = graph.n_nodes
    if graph.n_done < needed:
        hook = graph.before_value_request
        if hook is not None:
            hook()
        if graph.n_done < needed:
            graph.forward()


def map_batched(fn: Callable[[T], R], items: Iterable[T], graph: Graph | None = None) -> list[R]:
    """`[fn(item) for item in items]`, run concurrently so that value requests batch.

    `fn` is plain single-instance code; value-dependent `if`, `while` and recursion work
    unchanged. Every instance that asks for an uncomputed value is suspended until all live
    instances are suspended or finished; then one batched forward serves them all. `graph` is
    the graph to run on (default: the current graph); it is the current graph inside `fn`.
    Raises `MapBatchedError(index, original)` (chained to `original`) if `fn(items[index])`
    raises; see the module docstring for the exact semantics.
    """
    items = list(items)
    g = graph if graph is not None else current_graph()
    g._check_open()
    if not items:
        return []
    run = _Run(g)
    instances = [_Instance(run, i, fn) for i in range(len(items))]
    results: list[Any] = [None] * len(items)
    hook = _install(g)
    capture.push()  # torch calls in `fn` on expressions and parameters become nodes of `g`
    try:
        waiting: list[_Instance] = []

        def step(instance: _Instance, method: Callable[..., Any], *args: Any) -> None:
            try:
                out = run.enter(instance, method, *args)
            except Exception as error:
                raise MapBatchedError(instance.index, error) from error
            if instance.dead:
                results[instance.index] = out
            elif out is _SUSPENDED:
                waiting.append(instance)
            else:
                raise RuntimeError(f"map_batched: instance {instance.index} switched to its "
                                   "driver without waiting for a value")

        for instance, item in zip(instances, items):
            step(instance, instance.switch, item)
        while waiting:
            _forward(g)
            resumed, waiting = waiting, []
            for instance in resumed:
                step(instance, instance.switch)
    except BaseException:
        run.closing = True
        for instance in instances:
            if instance:  # started and not finished: throw GreenletExit in where it waits
                try:
                    run.enter(instance, instance.throw)
                except BaseException:  # noqa: S110 - it failed while dying; the first error wins
                    pass
        raise
    finally:
        capture.pop()
        _uninstall(g, hook)
        instances.clear()
    return results
