"""The current graph and torch's grad mode belong to whoever is running: a thread, an asyncio
task, a `map_batched` instance.

Threads and tasks each build in their own graph (`with fb.Graph()` or their own default graph),
a graph entered twice closes at its outermost exit, `fb.new_graph()` cannot pull the graph out
from under a running `map_batched`, and a `torch.no_grad()` region in one instance stays in that
instance. Interleavings are forced with barriers, so each test fails every time when the state it
checks is shared, and never by chance when it is not.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable

import pytest
import torch

import flybatch as fb

TIMEOUT = 10.0  # seconds a barrier waits before a broken interleaving fails the test


def run_in_threads(*workers: Callable[[], Any], barrier: threading.Barrier) -> list[Any]:
    """Run each worker in its own thread; their results, or the first worker's exception (which
    breaks `barrier`, so that the other workers fail at once instead of waiting for it)."""
    results: list[Any] = [None] * len(workers)
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            results[i] = workers[i]()
        except BaseException as error:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


# ---- threads and tasks ---------------------------------------------------------------------------
def test_threads_each_build_in_their_own_graph():
    barrier = threading.Barrier(2, timeout=TIMEOUT)

    def worker(k: float, leaves_first: bool) -> tuple[bool, float]:
        with fb.Graph() as g:
            barrier.wait()                          # both graphs are entered now
            xs = [fb.tanh(fb.input([k])) for _ in range(3)]
            barrier.wait()                          # and both threads have built
            mine = fb.current_graph() is g and all(x.graph is g for x in xs)
            value = fb.esum(xs).item()
            if not leaves_first:
                barrier.wait()                      # the other thread has left its graph
                mine = mine and fb.current_graph() is g and not g.closed
        if leaves_first:
            barrier.wait()
        return mine, value

    outer = fb.current_graph()
    got = run_in_threads(lambda: worker(1.0, True), lambda: worker(2.0, False), barrier=barrier)
    assert [mine for mine, _ in got] == [True, True]
    assert [value for _, value in got] == pytest.approx([3 * torch.tanh(torch.tensor(k)).item()
                                                         for k in (1.0, 2.0)])
    assert fb.current_graph() is outer and not outer.closed


def test_each_thread_has_its_own_default_graph():
    main = fb.new_graph()

    def worker() -> fb.Graph:
        mine = fb.current_graph()
        fb.input([1.0])
        fb.new_graph()                              # closes this thread's default graph only
        return mine

    (theirs,) = run_in_threads(worker, barrier=threading.Barrier(1))
    assert theirs is not main and theirs.closed
    assert fb.current_graph() is main and not main.closed and main.n_nodes == 0


def test_asyncio_tasks_each_build_in_their_own_graph():
    async def task(k: float, barrier: asyncio.Barrier) -> bool:
        with fb.Graph() as g:
            await barrier.wait()                    # both tasks have entered their graph
            x = fb.input([k])
            await barrier.wait()
            return fb.current_graph() is g and x.graph is g and x.item() == k

    async def main() -> list[bool]:
        barrier = asyncio.Barrier(2)
        return await asyncio.wait_for(asyncio.gather(task(1.0, barrier), task(2.0, barrier)),
                                      TIMEOUT)

    assert asyncio.run(main()) == [True, True]


def test_map_batched_in_two_threads_at_once():
    barrier = threading.Barrier(2, timeout=TIMEOUT)

    def worker(k: float) -> list[tuple[float, bool]]:
        with fb.Graph() as g:
            def fn(i: int) -> tuple[float, bool]:
                x = fb.input([k + i])
                if i == 0:
                    barrier.wait()                  # both runs are inside an instance now
                    seen = fb.current_graph()
                    barrier.wait()                  # and both have looked at the current graph
                else:
                    seen = fb.current_graph()
                return x.item(), seen is g and x.graph is g

            return fb.map_batched(fn, range(3))

    got = run_in_threads(lambda: worker(10.0), lambda: worker(20.0), barrier=barrier)
    assert got == [[(10.0, True), (11.0, True), (12.0, True)],
                   [(20.0, True), (21.0, True), (22.0, True)]]


# ---- re-entering a graph -------------------------------------------------------------------------
def test_reentering_a_graph_closes_it_at_the_outermost_exit():
    outer = fb.current_graph()
    with fb.Graph() as g:
        with g:
            x = fb.input([1.0])
        assert not g.closed and fb.current_graph() is g
        assert x.item() == 1.0
    assert g.closed and fb.current_graph() is outer


def test_a_graph_entered_by_two_instances_at_once_closes_at_the_last_exit():
    with fb.Graph() as g:
        shared = fb.Graph()

        def fn(i: int) -> bool:
            with shared:
                fb.input([float(i)], graph=g).item()    # suspends inside `with shared`
                inside = fb.current_graph() is shared
            return inside and fb.current_graph() is g and shared.closed == (i == 1)

        assert fb.map_batched(fn, range(2)) == [True, True]
        assert fb.current_graph() is g


# ---- new_graph under map_batched -----------------------------------------------------------------
@pytest.mark.parametrize("entered", [False, True], ids=["default graph", "with block"])
def test_new_graph_inside_map_batched_raises_and_keeps_the_run_graph(entered):
    def fn(i: int) -> float:
        x = fb.input([float(i)])
        x.item()
        if i == 1:
            fb.new_graph()                          # would pull the graph from under the others
        return fb.tanh(x).item()

    def check(g: fb.Graph) -> None:
        with pytest.raises(fb.MapBatchedError) as info:
            fb.map_batched(fn, range(3))
        assert info.value.index == 1 and isinstance(info.value.original, fb.GraphError)
        assert "new_graph" in str(info.value.original)
        assert "map_batched" in str(info.value.original)
        assert not g.closed and fb.current_graph() is g
        assert fb.map_batched(lambda i: fb.input([float(i)]).item(), range(2)) == [0.0, 1.0]

    if entered:
        with fb.Graph() as g:
            check(g)
    else:
        check(fb.new_graph())


def test_new_graph_after_map_batched_replaces_the_run_graph():
    g = fb.new_graph()
    fb.map_batched(lambda i: fb.input([float(i)]).item(), range(2))
    fresh = fb.new_graph()
    assert g.closed and fb.current_graph() is fresh


# ---- grad mode under map_batched -----------------------------------------------------------------
def test_no_grad_in_one_instance_does_not_leak_into_the_others():
    seen: dict[Any, bool] = {}

    def fn(i: int) -> None:
        if i == 0:
            with torch.no_grad():
                fb.input([0.0]).item()              # suspends inside no_grad
                seen["own, after resuming"] = torch.is_grad_enabled()
        else:
            seen[i, "start"] = torch.is_grad_enabled()
            fb.input([1.0]).item()
            seen[i, "after resuming"] = torch.is_grad_enabled()

    with torch.enable_grad(), fb.Graph():
        fb.map_batched(fn, range(3))
        assert torch.is_grad_enabled()
    assert seen == {"own, after resuming": False, (1, "start"): True, (2, "start"): True,
                    (1, "after resuming"): True, (2, "after resuming"): True}


@pytest.mark.parametrize("caller_grad", [True, False])
def test_grad_mode_after_map_batched_is_the_callers(caller_grad):
    seen = []

    def fn(i: int) -> None:
        seen.append(torch.is_grad_enabled())        # every instance starts in the caller's mode
        torch.set_grad_enabled(i % 2 == 0)          # and changes it for good
        fb.input([1.0]).item()
        seen.append(torch.is_grad_enabled() == (i % 2 == 0))

    with torch.set_grad_enabled(caller_grad), fb.Graph():
        fb.map_batched(fn, range(4))
        after = torch.is_grad_enabled()
    assert after == caller_grad
    assert seen == [caller_grad] * 4 + [True] * 4


def test_grad_mode_is_restored_when_an_instance_raises():
    def fn(i: int) -> None:
        torch.set_grad_enabled(False)
        fb.input([1.0]).item()
        if i == 1:
            raise KeyError(i)

    with torch.enable_grad(), fb.Graph():
        with pytest.raises(fb.MapBatchedError):
            fb.map_batched(fn, range(3))
        assert torch.is_grad_enabled()

