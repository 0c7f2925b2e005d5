"""Lifetimes: what a graph keeps alive, what keeps it alive, and what outlives it.

Signatures are interned per graph, so they go when the graph does.
"""

from __future__ import annotations

import gc
import tracemalloc

import torch

import flybatch as fb


def test_signatures_are_forgotten_with_their_graphs():
    # A training loop may meet new shapes in every minibatch (sentence lengths, tree sizes):
    # what it keeps must not grow with them.
    def minibatch(n: int) -> None:
        with fb.Graph():
            fb.sum_elems(fb.tanh(fb.input(torch.zeros(n))) * 2.0)

    minibatch(1)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(2, 2002):
            minibatch(n)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 50_000  # with one global table of signatures, these 2000 graphs kept 1.3 MB
