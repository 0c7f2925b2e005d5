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


def key_of(sig: int) -> tuple:
    return _keys[sig]


def describe(sig: int) -> str:
    """A readable form of a signature, e.g. `matmul[P3](64, 96)@(96,)` or `tanh(64,)`."""
    name, *rest = _keys[sig]
    parts = []
    for item in rest:
        if isinstance(item, str) and item.startswith("T"):
            item = "table"  # a lookup table's id() says nothing to a reader
        if isinstance(item, tuple) and all(isinstance(d, int) for d in item):
            parts.append(str(item))
        elif isinstance(item, tuple):
            parts.append("".join(str(s) for s in item))
        else:
            parts.append(f"[{item}]")
    return name + "".join(parts)
