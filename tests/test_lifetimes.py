"""Lifetimes: what a graph keeps alive, what keeps it alive, and what outlives it.

Signatures are interned per graph, and a key names a shared object (a parameter, an embedding
table, a fused module) by a tag that the graph holds together with the object, never by `id()`:
an object that dies leaves its id to the next one. Closing a graph lets go of those objects, and
the modules used in it keep nothing of it.
"""

from __future__ import annotations

import copy
import gc
import tracemalloc
import weakref

import pytest
import torch

import flybatch as fb

# A fused module of each kind, and one step of it on an input vector of size 3.
CELLS = {
    "lstm": (lambda: fb.nn.LSTMCell(3, 4), lambda cell, x: cell(x).h),
    "gru": (lambda: fb.nn.GRUCell(3, 4), lambda cell, x: cell(x)),
    "tree-lstm": (lambda: fb.nn.TreeLSTMCell(3, 4), lambda cell, x: cell.leaf(x).h),
}


def alone(step, cell, x: torch.Tensor) -> torch.Tensor:
    """The value of one step of `cell` in a graph of its own."""
    with fb.Graph():
        return step(cell, x).value().detach()


@pytest.mark.parametrize("kind", CELLS)
def test_fused_modules_made_and_freed_per_instance_compute_with_their_own_parameters(kind):
    # A module freed while the graph is open leaves its id to the next one made: were the
    # signature to name a module by its id, the two would batch and share one set of weights.
    make, step = CELLS[kind]
    x = torch.randn(3)
    with fb.Graph():
        outputs, expected = [], []
        for _ in range(8):
            cell = make()
            expected.append(alone(step, cell, x))
            outputs.append(step(cell, x))
            del cell
        for out, value in zip(outputs, expected):
            torch.testing.assert_close(out.value().detach(), value)


def test_signatures_are_forgotten_with_their_graphs():
    # A training loop may meet new shapes in every minibatch (sentence lengths, tree sizes):
    # what it keeps must not grow with them.
    def minibatch(n: int) -> None:
        with fb.Graph():
            fb.sum_elems(fb.tanh(fb.input(torch.zeros(n))) * 2.0)

    # What a graph keeps grows linearly with the graphs; torch's and CPython's own free lists
    # and caches settle at some tens of KB (seen with a bare TorchFunctionMode too), at a point
    # that varies with what ran before. So: the growth of the second 2000 graphs over the first.
    for n in range(1, 2001):
        minibatch(n)
    gc.collect()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        for n in range(2001, 4001):
            minibatch(n)
        gc.collect()
        first = tracemalloc.get_traced_memory()[0] - start
        for n in range(4001, 6001):
            minibatch(n)
        gc.collect()
        second = tracemalloc.get_traced_memory()[0] - start - first
    finally:
        tracemalloc.stop()
    assert second < 50_000  # with one global table of signatures, 2000 graphs kept 1.3 MB


@pytest.mark.parametrize("kind", CELLS)
def test_a_closed_graph_is_freed_though_fused_modules_were_used_in_it(kind):
    make, step = CELLS[kind]
    cell = make()
    with fb.Graph() as g:
        step(cell, torch.zeros(3)).value()
    closed = weakref.ref(g)
    del g
    gc.collect()
    assert closed() is None


def test_a_fused_module_copied_while_its_graph_is_open_computes_with_its_own_weights():
    make, step = CELLS["gru"]
    cell, x = make(), torch.randn(3)
    with fb.Graph():
        step(cell, x).value()
        twin = copy.deepcopy(cell)
        with torch.no_grad():
            for p in twin.parameters():
                p.mul_(2)
        torch.testing.assert_close(step(twin, x).value().detach(), alone(step, twin, x))
