"""Signatures: the int that says which nodes may run together as one kernel.

A signature key is a small tuple chosen by the op (see `ops.py`): the op name and whatever the
batched kernel needs to be identical across the batch (input shapes, the shared parameter,
slice bounds...). Each graph interns its keys into dense ints of its own (the node store,
csrc/store.cpp: `graph.sig_ids` key -> int, `graph.sig_keys` int -> key), so that
scheduling compares and sorts plain integers, and the table lives and dies with the graph: a
training loop that meets new shapes in every minibatch keeps none of them. `describe` turns an
int back into something a person can read in `stats()`.

A key names a shared object (a parameter, an embedding table, a fused module) by its `tag` in
the graph, never by `id()`: an object that dies while the graph is open (a module made per
instance) leaves its id to the next one made, and the nodes of the two would batch together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .graph import Graph


def tag(graph: "Graph", obj: object) -> tuple[str, int]:
    """How `graph`'s signature keys name the shared object `obj`: by the order it was met in."""
    entry = graph.tags.get(id(obj))
    if entry is None:
        entry = remember(graph, obj)
    return entry[1]


def remember(graph: "Graph", obj: object, *facts: object) -> tuple:
    """Make `graph`'s entry for `obj`: `(obj, a fresh tag, *facts)`, `facts` being what its owner
    needs once per graph rather than once per call (a fused module's parameter nodes).

    The entry holds `obj`, so no other object can take its id while the graph is open, and the
    graph holds the entry, so `obj` keeps nothing of the graph. `Graph.close` drops the entries
    (no node can be added after)."""
    entry = graph.tags[id(obj)] = (obj, ("P", len(graph.tags)), *facts)
    return entry


def describe(sig: int, graph: "Graph") -> str:
    """A readable form of signature `sig` of `graph` (an int means nothing outside its graph),
    e.g. `matmul[param](64, 96)(96,)`, `tanh(64,)` or `softmax(n,)` (vectors of any length)."""
    name, *rest = graph.sig_keys[sig]
    return name + "".join(_describe(item) for item in rest)


def _describe(item: object) -> str:
    if isinstance(item, tuple):
        if len(item) == 2 and item[0] == "P":
            return "[param]"
        if all(isinstance(d, int) or d == "n" for d in item):  # a shape; "n": any length
            return f"({', '.join(map(str, item))}{',' if len(item) == 1 else ''})"
        return "".join(_describe(i) for i in item)
    if item is None:
        return ""
    if callable(item) and hasattr(item, "__name__"):  # a kernel function: its name, no address
        return f"[{item.__name__}]"
    return f"[{item}]"
