"""Signatures: the int that says which nodes may run together as one kernel.

A signature key is a small tuple chosen by the op (see `ops.py`): the op name and whatever the
batched kernel needs to be identical across the batch (input shapes, the shared parameter's node,
slice bounds...). Keys are interned once into dense ints, so that scheduling compares and sorts
plain integers, and `describe` turns an int back into something a person can read in `stats()`.
"""

from __future__ import annotations

_ids: dict[tuple, int] = {}
_keys: list[tuple] = []


def intern(key: tuple) -> int:
    """The int signature of `key`, allocating a new one the first time a key is seen."""
    sig = _ids.get(key)
    if sig is None:
        sig = _ids[key] = len(_keys)
        _keys.append(key)
    return sig


def parameter_tag(tensor: object) -> tuple[str, int]:
    """How a signature key names a shared parameter: by the tensor's identity, which (unlike
    its node id) is the same in every graph, so the table of signatures does not grow with
    each minibatch."""
    return ("P", id(tensor))


def describe(sig: int) -> str:
    """A readable form of a signature, e.g. `matmul[param](64, 96)(96,)` or `tanh(64,)`."""
    name, *rest = _keys[sig]
    return name + "".join(_describe(item) for item in rest)


def _describe(item: object) -> str:
    if isinstance(item, tuple):
        if len(item) == 2 and item[0] == "P":
            return "[param]"
        if all(isinstance(d, int) for d in item):
            return str(item)
        return "".join(_describe(i) for i in item)
    return "" if item is None else f"[{item}]"
