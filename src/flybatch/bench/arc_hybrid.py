"""Unlabeled arc-hybrid transition system with ROOT at the end of the buffer.

This is the parser of the transition-based benchmark (Kuhlmann et al. 2011;
root placement after Ballesteros & Nivre 2013).  For a sentence of ``n``
words the tokens are numbered ``0..n-1`` and ROOT is token ``n``, the last
buffer item.  Placing ROOT last means the root attachment is decided at the
very end, when the whole sentence has been seen.

Heads here are *token indices* (ROOT = ``n``), not CoNLL-U numbers; use
:func:`heads_from_conllu` / :func:`heads_to_conllu` to convert.

Transitions (``s0`` = stack top, ``s1`` = below it, ``b0`` = buffer front):

* ``SHIFT``     (0): move ``b0`` onto the stack.
* ``LEFT_ARC``  (1): ``s0`` gets head ``b0``; pop.
* ``RIGHT_ARC`` (2): ``s0`` gets head ``s1``; pop.

Constraints: ROOT is never shifted; LEFT-ARC onto ROOT needs the stack to
hold exactly one word, so the finished tree has exactly one word attached to
ROOT.  The parse ends when the stack is empty and only ROOT is left.
"""

from __future__ import annotations

from typing import Sequence

__all__ = [
    "SHIFT",
    "LEFT_ARC",
    "RIGHT_ARC",
    "N_TRANSITIONS",
    "Config",
    "static_oracle",
    "oracle_transitions",
    "heads_from_conllu",
    "heads_to_conllu",
]

SHIFT, LEFT_ARC, RIGHT_ARC = 0, 1, 2
N_TRANSITIONS = 3


def heads_from_conllu(heads: Sequence[int]) -> list[int]:
    """CoNLL-U heads (1-based, 0 = root) to token indices (ROOT = n)."""
    n = len(heads)
    return [h - 1 if h > 0 else n for h in heads]


def heads_to_conllu(heads: Sequence[int]) -> list[int]:
    """Token-index heads (ROOT = n) back to CoNLL-U numbering."""
    n = len(heads)
    return [0 if h == n else h + 1 for h in heads]


class Config:
    """A parser configuration for a sentence of ``n`` words.

    ``stack`` lists token indices (top last); ``buf`` is the index of the
    buffer front, so the buffer is ``range(buf, n + 1)`` and never needs
    list pops from the front; ``heads[i]`` is the head assigned to word
    ``i`` so far (``-1`` while unattached).
    """

    __slots__ = ("n", "stack", "buf", "heads")

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError("a sentence needs at least one word")
        self.n = n
        self.stack: list[int] = []
        self.buf = 0
        self.heads = [-1] * n

    @property
    def root(self) -> int:
        """Token index of ROOT."""
        return self.n

    @property
    def buffer(self) -> range:
        """The remaining buffer; its last item is always ROOT."""
        return range(self.buf, self.n + 1)

    def is_legal(self, t: int) -> bool:
        """Whether transition ``t`` may be applied now."""
        if t == SHIFT:
            return self.buf < self.n
        if t == LEFT_ARC:
            return bool(self.stack) and (self.buf < self.n or len(self.stack) == 1)
        if t == RIGHT_ARC:
            return len(self.stack) >= 2
        return False

    def legal(self) -> list[int]:
        """The legal transitions, in id order (empty once :meth:`done`)."""
        return [t for t in (SHIFT, LEFT_ARC, RIGHT_ARC) if self.is_legal(t)]

    def apply(self, t: int) -> None:
        """Apply transition ``t`` in place; raises ``ValueError`` if illegal."""
        if not self.is_legal(t):
            raise ValueError(f"transition {t} is illegal in {self!r}")
        if t == SHIFT:
            self.stack.append(self.buf)
            self.buf += 1
        elif t == LEFT_ARC:
            self.heads[self.stack.pop()] = self.buf
        else:
            s0 = self.stack.pop()
            self.heads[s0] = self.stack[-1]

    def done(self) -> bool:
        """Terminal: stack empty and only ROOT left in the buffer."""
        return not self.stack and self.buf == self.n

    def __repr__(self) -> str:
        return f"Config(n={self.n}, stack={self.stack}, buf={self.buf})"


def static_oracle(config: Config, gold_heads: Sequence[int]) -> int:
    """The gold transition for ``config`` (token-index heads, ROOT = n).

    Standard static arc-hybrid oracle: LEFT-ARC if ``b0`` is the gold head
    of ``s0``; else RIGHT-ARC if ``s1`` is its gold head and ``s0`` has no
    dependents left in the buffer; else SHIFT.  Following it from the
    initial configuration reproduces every projective single-root tree
    exactly.  On other trees it still returns a legal transition, so the
    parse terminates (with some projective tree that differs from gold).
    """
    stack, b = config.stack, config.buf
    if stack:
        s0 = stack[-1]
        if gold_heads[s0] == b and config.is_legal(LEFT_ARC):
            return LEFT_ARC
        if (
            len(stack) >= 2
            and gold_heads[s0] == stack[-2]
            and all(gold_heads[d] != s0 for d in range(b, config.n))
        ):
            return RIGHT_ARC
    if config.is_legal(SHIFT):
        return SHIFT
    return RIGHT_ARC if len(stack) >= 2 else LEFT_ARC  # only ROOT left


def oracle_transitions(gold_heads: Sequence[int]) -> list[int]:
    """The oracle's full transition sequence for a sentence (2n steps)."""
    config = Config(len(gold_heads))
    out = []
    while not config.done():
        t = static_oracle(config, gold_heads)
        config.apply(t)
        out.append(t)
    return out
