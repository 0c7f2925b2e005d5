"""Data layer for the benchmarks: readers for three text formats, a vocabulary,
and synthetic generators that write the same formats.

The four benchmarks of Neubig et al. (2017) use three corpora:

* Stanford Sentiment Treebank (Tree-LSTM): PTB bracketed trees, one per line.
* WikiNER (BiLSTM taggers): one sentence per line, tokens ``word|TAG``.
* UD English-EWT (transition-based parser): CoNLL-U.

Every reader has a ``parse_*(text)`` form and a ``load_*(path)`` form.  The
synthetic generators produce *text*, not objects, so that a run without the
real data still goes through the same parsing code.  :func:`load_split` picks
real files when given a data directory and generated text otherwise.

The module is pure Python (no torch): the benchmarks turn the results into
tensors themselves.
"""

from __future__ import annotations

import random
import zlib
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence, Union

__all__ = [
    "Tree",
    "parse_sst",
    "load_sst",
    "parse_tagged",
    "load_tagged",
    "Sentence",
    "parse_conllu",
    "load_conllu",
    "is_projective",
    "Vocab",
    "UNK",
    "UPOS_TAGS",
    "NER_TAGS",
    "generate_sst_text",
    "generate_tagged_text",
    "generate_conllu_text",
    "load_split",
]

NBSP = "\u00a0"


def _lines(text: str) -> Iterator[tuple[int, str]]:
    """Yield ``(line_number, line)`` split on ``\\n`` only.

    ``str.splitlines`` would also split on characters such as U+0085 or
    U+2028 that may legitimately sit inside a token, so we avoid it.
    """
    for number, line in enumerate(text.split("\n"), start=1):
        yield number, line.rstrip("\r")


def _is_blank(line: str) -> bool:
    """True for a line with only ASCII whitespace (NBSP is *not* blank)."""
    return line.strip(" \t") == ""


# ---------------------------------------------------------------------------
# Stanford Sentiment Treebank: PTB bracketed trees
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tree:
    """A sentiment tree node.

    A preterminal has a ``word`` and no children; an internal node has
    children (two in SST) and ``word is None``.  Every node carries a
    sentiment ``label`` in 0..4.  Trees are immutable and compare by value.
    """

    label: int
    children: tuple[Tree, ...] = ()
    word: str | None = None

    @property
    def is_leaf(self) -> bool:
        """True for a preterminal (a node that holds a word)."""
        return not self.children

    def nodes(self) -> Iterator[Tree]:
        """Iterate over all nodes in post-order (children before parents).

        Post-order is the order a Tree-LSTM must compute in.  Iterative, so
        deep trees do not hit Python's recursion limit.
        """
        stack: list[tuple[Tree, bool]] = [(self, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded or not node.children:
                yield node
            else:
                stack.append((node, True))
                for child in reversed(node.children):
                    stack.append((child, False))

    def height(self) -> int:
        """Number of nodes on the longest root-to-leaf path (a leaf has 1)."""
        heights: dict[int, int] = {}
        for node in self.nodes():
            heights[id(node)] = 1 + max((heights[id(c)] for c in node.children), default=0)
        return heights[id(self)]

    def words(self) -> list[str]:
        """The sentence: leaf words from left to right."""
        return [node.word for node in self.nodes() if node.word is not None]

    def to_ptb(self) -> str:
        """Write the tree back in SST's bracketed format (``/`` escaped)."""
        if self.word is not None:
            return f"({self.label} {self.word.replace('/', chr(92) + '/')})"
        return f"({self.label} {' '.join(c.to_ptb() for c in self.children)})"


def _sst_tokens(line: str) -> list[str]:
    """Split a bracketed line into ``(``, ``)`` and atoms.

    Atoms are separated by ASCII space only (``split(" ")``, never
    ``split()``), so a token such as ``8<NBSP>1\\/2`` stays one atom.
    """
    spaced = line.replace("\t", " ").replace("(", " ( ").replace(")", " ) ")
    return [tok for tok in spaced.split(" ") if tok]


def _parse_tree_line(line: str, number: int) -> Tree:
    """Parse one bracketed tree with an explicit stack (no recursion)."""
    tokens = _sst_tokens(line)

    def fail(why: str) -> ValueError:
        return ValueError(f"SST line {number}: {why}: {line[:80]!r}")

    # Each open frame is [label, children, word].
    frames: list[list] = []
    result: Tree | None = None
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "(":
            if result is not None:
                raise fail("text after the end of the tree")
            if i + 1 >= len(tokens) or tokens[i + 1] in "()":
                raise fail("missing label")
            try:
                label = int(tokens[i + 1])
            except ValueError:
                raise fail(f"label {tokens[i + 1]!r} is not an integer") from None
            frames.append([label, [], None])
            i += 2
        elif tok == ")":
            if not frames:
                raise fail("unbalanced ')'")
            label, children, word = frames.pop()
            if word is None and not children:
                raise fail("empty node")
            node = Tree(label, tuple(children), word)
            if frames:
                frames[-1][1].append(node)
            else:
                result = node
            i += 1
        else:
            if not frames or frames[-1][1] or frames[-1][2] is not None:
                raise fail(f"unexpected word {tok!r}")
            frames[-1][2] = tok.replace("\\/", "/")
            i += 1
    if frames or result is None:
        raise fail("unbalanced '('")
    return result


def parse_sst(text: str) -> list[Tree]:
    """Parse SST text: one bracketed tree per non-blank line.

    ``\\/`` becomes ``/``; ``-LRB-``/``-RRB-`` are kept as words.
    """
    return [_parse_tree_line(line, n) for n, line in _lines(text) if not _is_blank(line)]


def load_sst(path: str | Path) -> list[Tree]:
    """Read an SST file (UTF-8) with :func:`parse_sst`."""
    return parse_sst(Path(path).read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------
# WikiNER: word|TAG lines
# ---------------------------------------------------------------------------

TaggedSentence = list[tuple[str, str]]


def parse_tagged(text: str) -> list[TaggedSentence]:
    """Parse ``word|TAG`` lines into lists of ``(word, tag)``.

    Tokens are separated by ASCII space; each token is split on its *last*
    ``|`` so a word may itself contain ``|``.
    """
    sentences: list[TaggedSentence] = []
    for number, line in _lines(text):
        if _is_blank(line):
            continue
        sentence: TaggedSentence = []
        for token in line.split(" "):
            if not token:
                continue  # doubled or trailing space
            word, bar, tag = token.rpartition("|")
            if not bar or not word or not tag:
                raise ValueError(f"tagged line {number}: token {token!r} is not word|TAG")
            sentence.append((word, tag))
        sentences.append(sentence)
    return sentences


def load_tagged(path: str | Path) -> list[TaggedSentence]:
    """Read a WikiNER-style file (UTF-8) with :func:`parse_tagged`."""
    return parse_tagged(Path(path).read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------
# CoNLL-U
# ---------------------------------------------------------------------------


@dataclass(slots=True)
class Sentence:
    """One dependency-parsed sentence (basic tree only).

    ``heads[i]`` is the head of word ``i + 1`` in CoNLL-U numbering:
    1-based, with 0 meaning the artificial root.
    """

    words: list[str]
    upos: list[str]
    heads: list[int]
    deprels: list[str]

    def __len__(self) -> int:
        return len(self.words)


def parse_conllu(text: str) -> list[Sentence]:
    """Parse CoNLL-U text into :class:`Sentence` objects.

    Columns are split on TAB only (a FORM may contain a no-break space).
    Comment lines, multiword range lines (ID ``n-m``) and empty nodes
    (ID ``n.k``) are skipped; a blank line ends a sentence.
    """
    sentences: list[Sentence] = []
    current = Sentence([], [], [], [])

    def flush() -> None:
        nonlocal current
        if current.words:
            sentences.append(current)
        current = Sentence([], [], [], [])

    for number, line in _lines(text):
        if _is_blank(line):
            flush()
            continue
        if line.startswith("#"):
            continue
        cols = line.split("\t")
        if len(cols) != 10:
            raise ValueError(f"CoNLL-U line {number}: expected 10 columns, got {len(cols)}")
        ident = cols[0]
        if "-" in ident or "." in ident:
            continue  # multiword token range or empty node
        if int(ident) != len(current.words) + 1:
            raise ValueError(f"CoNLL-U line {number}: word ID {ident} out of sequence")
        current.words.append(cols[1])
        current.upos.append(cols[3])
        current.heads.append(int(cols[6]))
        current.deprels.append(cols[7])
    flush()
    return sentences


def load_conllu(path: str | Path) -> list[Sentence]:
    """Read a CoNLL-U file (UTF-8) with :func:`parse_conllu`."""
    return parse_conllu(Path(path).read_text(encoding="utf-8"))


def is_projective(heads: Sequence[int]) -> bool:
    """True if no two arcs cross, counting the arc from the root (position 0).

    ``heads`` uses CoNLL-U numbering (``heads[i]`` is the head of word
    ``i + 1``; 0 is the root).  Arc-standard/arc-hybrid systems can only
    build projective trees, so their oracles need this test.
    """
    arcs = sorted((min(h, d), max(h, d)) for d, h in enumerate(heads, start=1))
    for a, (i, j) in enumerate(arcs):
        for k, l in arcs[a + 1 :]:
            if k >= j:
                break  # sorted by left end: no later arc starts inside (i, j)
            if i < k and j < l:
                return False
    return True


# ---------------------------------------------------------------------------
# Vocabulary
# ---------------------------------------------------------------------------

UNK = "<unk>"


class Vocab:
    """A string-to-id map with id 0 reserved for unknown strings.

    ``counts`` keeps the training frequency of every token seen by
    :meth:`build` (including those dropped by ``min_count``), so callers can
    ask whether a word is rare, e.g. for word dropout.
    """

    def __init__(self, itos: Sequence[str], counts: Counter[str] | None = None) -> None:
        if not itos or itos[0] != UNK:
            raise ValueError(f"id 0 must be {UNK!r}")
        self.itos: list[str] = list(itos)
        self.stoi: dict[str, int] = {s: i for i, s in enumerate(self.itos)}
        if len(self.stoi) != len(self.itos):
            raise ValueError("duplicate entries in vocabulary")
        self.counts: Counter[str] = counts if counts is not None else Counter()

    @classmethod
    def build(
        cls, tokens: Iterable[str], min_count: int = 1, specials: Sequence[str] = ()
    ) -> Vocab:
        """Count ``tokens`` and keep those seen at least ``min_count`` times.

        Ids: 0 is ``<unk>``, then ``specials`` as 1..k, then kept tokens by
        descending frequency (ties in string order, so the result is
        deterministic).
        """
        counts = Counter(tokens)
        reserved = {UNK, *specials}
        kept = sorted(
            (t for t, c in counts.items() if c >= min_count and t not in reserved),
            key=lambda t: (-counts[t], t),
        )
        return cls([UNK, *dict.fromkeys(specials), *kept], counts)

    def __getitem__(self, token: str) -> int:
        return self.stoi.get(token, 0)

    def __contains__(self, token: object) -> bool:
        return token in self.stoi

    def __len__(self) -> int:
        return len(self.itos)

    def lookup(self, tokens: Iterable[str]) -> list[int]:
        """Ids for a sequence of tokens (unknown ones map to 0)."""
        get = self.stoi.get
        return [get(t, 0) for t in tokens]

    def __repr__(self) -> str:
        return f"Vocab(size={len(self)})"


# ---------------------------------------------------------------------------
# Synthetic data, written in the real formats
# ---------------------------------------------------------------------------

UPOS_TAGS = (
    "ADJ", "ADP", "ADV", "AUX", "CCONJ", "DET", "INTJ", "NOUN", "NUM",
    "PART", "PRON", "PROPN", "PUNCT", "SCONJ", "SYM", "VERB", "X",
)  # fmt: skip
NER_TAGS = ("O", "I-PER", "I-LOC", "I-ORG", "I-MISC")
_DEPRELS = (
    "nsubj", "obj", "iobj", "obl", "advmod", "amod", "nmod", "det", "case",
    "mark", "cc", "conj", "aux", "cop", "punct", "compound", "flat", "appos",
    "acl", "advcl", "xcomp", "ccomp", "nummod", "parataxis", "dep",
)  # fmt: skip
_SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")  # 70


def _synthetic_word(rank: int) -> str:
    """Word number ``rank`` of the synthetic language: base-70 syllables,
    so frequent (low-rank) words are short, as in natural text."""
    parts = []
    rank += 1
    while rank:
        rank, digit = divmod(rank - 1, len(_SYLLABLES))
        parts.append(_SYLLABLES[digit])
    return "".join(reversed(parts))


@lru_cache(maxsize=8)
def _zipf_table(size: int, exponent: float = 1.0) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """Words and cumulative Zipf weights ``1 / rank**exponent``."""
    words = tuple(_synthetic_word(r) for r in range(size))
    cum, total = [], 0.0
    for r in range(1, size + 1):
        total += 1.0 / r**exponent
        cum.append(total)
    return words, tuple(cum)


def _zipf_words(rng: random.Random, k: int, size: int) -> list[str]:
    words, cum = _zipf_table(size)
    return rng.choices(words, cum_weights=cum, k=k)


def _length(rng: random.Random, mean: float, shape: float, lo: int, hi: int) -> int:
    """A gamma-distributed sentence length, clipped to ``[lo, hi]``."""
    return min(hi, max(lo, round(rng.gammavariate(shape, mean / shape))))


# SST-specific tokens that the loaders must handle (mostly rare).
_SST_ODD_WORDS = ("-LRB-", "-RRB-", "1/2", "and/or", "8" + NBSP + "1/2")


def _random_sst_tree(rng: random.Random, words: list[str]) -> Tree:
    """A random binary tree over ``words``; split points are uniform."""

    def label(leaf: bool) -> int:
        if leaf and rng.random() < 0.8:
            return 2  # most SST words are neutral
        return rng.choices(range(5), weights=(1, 2, 2, 2, 1))[0]

    def build(lo: int, hi: int) -> Tree:
        if hi - lo == 1:
            return Tree(label(True), (), words[lo])
        mid = rng.randint(lo + 1, hi - 1)
        return Tree(label(False), (build(lo, mid), build(mid, hi)))

    return build(0, len(words))


def generate_sst_text(n_trees: int, seed: int = 0) -> str:
    """SST-like bracketed trees as text, one per line.

    Sentence lengths follow a gamma law with mean ~19, clipped to 1..55
    (SST train: mean 19.1, max 52); 5000-word Zipf vocabulary; labels 0-4.
    Occasional ``-LRB-``, ``/`` (written ``\\/``) and NBSP-bearing tokens
    exercise the same quirks as the real files.
    """
    rng = random.Random(seed)
    lines = []
    for _ in range(n_trees):
        n = _length(rng, mean=19.5, shape=3.0, lo=1, hi=55)
        words = _zipf_words(rng, n, 5000)
        for i in range(n):
            if rng.random() < 0.003:
                words[i] = rng.choice(_SST_ODD_WORDS)
        lines.append(_random_sst_tree(rng, words).to_ptb())
    return "\n".join(lines) + "\n"


def generate_tagged_text(n_sentences: int, seed: int = 0) -> str:
    """WikiNER-like ``word|TAG`` lines.

    Lengths: gamma, mean ~25, clipped to 1..120.  About 14% of tokens are in
    entity spans (1-3 capitalised words tagged ``I-PER``/``I-LOC``/
    ``I-ORG``/``I-MISC``); the rest are ``O``.  A rare word contains ``|``
    to exercise the split-on-last-bar rule.
    """
    rng = random.Random(seed)
    entity_tags = NER_TAGS[1:]
    lines = []
    for _ in range(n_sentences):
        n = _length(rng, mean=25.0, shape=3.0, lo=1, hi=120)
        words = _zipf_words(rng, n, 6000)
        tokens: list[str] = []
        i = 0
        while i < n:
            if rng.random() < 0.07:
                tag = rng.choices(entity_tags, weights=(11, 9, 4, 9))[0]
                span = min(n - i, rng.choice((1, 1, 2, 2, 3)))
                tokens.extend(f"{w.capitalize()}|{tag}" for w in words[i : i + span])
                i += span
            else:
                word = words[i] if rng.random() > 0.002 else f"{words[i]}|{words[i]}"
                tokens.append(f"{word}|O")
                i += 1
        lines.append(" ".join(tokens))
    return "\n".join(lines) + "\n"


def _random_projective_heads(rng: random.Random, n: int) -> list[int]:
    """Random projective tree, CoNLL-U heads (``heads[i]`` heads word i+1).

    Each span picks a head word uniformly, then cuts the words to its left
    and to its right into contiguous chunks, each a dependent subtree.
    """
    heads = [0] * n
    todo = [(1, n, 0)]  # (first word, last word, parent), 1-based inclusive
    while todo:
        lo, hi, parent = todo.pop()
        h = rng.randint(lo, hi)
        heads[h - 1] = parent
        for a, b in ((lo, h - 1), (h + 1, hi)):
            start = a
            for pos in range(a, b + 1):
                if pos == b or rng.random() < 0.5:
                    todo.append((start, pos, h))
                    start = pos + 1
    return heads


def _make_non_projective(rng: random.Random, heads: list[int], tries: int = 20) -> bool:
    """Re-attach one word so that arcs cross while staying a tree."""
    n = len(heads)
    for _ in range(tries):
        d = rng.randint(1, n)
        h = rng.randint(1, n)
        if heads[d - 1] == 0 or h == d:
            continue
        a = h  # reject h inside d's subtree (would make a cycle)
        while a and a != d:
            a = heads[a - 1]
        if a == d:
            continue
        old, heads[d - 1] = heads[d - 1], h
        if not is_projective(heads):
            return True
        heads[d - 1] = old
    return False


def generate_conllu_text(n_sentences: int, seed: int = 0) -> str:
    """UD-like CoNLL-U text with 10 TAB-separated columns.

    Lengths: gamma, mean ~17, clipped to 1..100.  Trees are projective
    except ~3% with one re-attached crossing arc.  About 15% of sentences
    carry a multiword range line and ~2% an empty node, which readers must
    skip.  Each sentence has ``# sent_id`` and ``# text`` comments.
    """
    rng = random.Random(seed)
    out: list[str] = []
    for s in range(n_sentences):
        n = _length(rng, mean=17.0, shape=2.0, lo=1, hi=100)
        words = _zipf_words(rng, n, 4000)
        heads = _random_projective_heads(rng, n)
        if n >= 4 and rng.random() < 0.03:
            _make_non_projective(rng, heads)
        ranges = {rng.randint(1, n - 1)} if n >= 2 and rng.random() < 0.15 else set()
        empties = {rng.randint(1, n)} if rng.random() < 0.02 else set()
        out.append(f"# sent_id = synthetic-{seed}-{s + 1}")
        out.append(f"# text = {' '.join(words)}")
        for i, (word, head) in enumerate(zip(words, heads), start=1):
            if i in ranges:
                out.append(f"{i}-{i + 1}\t{word}{words[i]}\t_\t_\t_\t_\t_\t_\t_\t_")
            upos = rng.choice(UPOS_TAGS)
            rel = "root" if head == 0 else rng.choice(_DEPRELS)
            out.append(f"{i}\t{word}\t{word}\t{upos}\t_\t_\t{head}\t{rel}\t{head}:{rel}\t_")
            if i in empties:
                out.append(f"{i}.1\t{word}\t{word}\tVERB\t_\t_\t_\t_\t{i}:conj\t_")
        out.append("")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------
# One entry point for the benchmarks
# ---------------------------------------------------------------------------

_KINDS: dict[str, tuple[str, str, Callable[[str], list], Callable[[int, int], str]]] = {
    "sst": ("sst", ".txt", parse_sst, generate_sst_text),
    "tagged": ("wikiner", ".txt", parse_tagged, generate_tagged_text),
    "conllu": ("ud-english", ".conllu", parse_conllu, generate_conllu_text),
}

Dataset = Union[list[Tree], list[TaggedSentence], list[Sentence]]


def load_split(
    kind: str, data_dir: str | Path | None, split: str, n_synthetic: int = 2000, seed: int = 0
) -> Dataset:
    """Load one split of a benchmark corpus.

    ``kind`` is ``"sst"``, ``"tagged"`` or ``"conllu"``.  With ``data_dir``
    the real file is read (``sst/{split}.txt``, ``wikiner/{split}.txt`` or
    ``ud-english/{split}.conllu`` under it).  Without it, ``n_synthetic``
    items are generated and parsed; the seed is mixed with the split name
    so train/dev/test differ but each is reproducible.
    """
    if kind not in _KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {sorted(_KINDS)}")
    folder, suffix, parse, generate = _KINDS[kind]
    if data_dir is not None:
        path = Path(data_dir) / folder / f"{split}{suffix}"
        return parse(path.read_text(encoding="utf-8"))
    split_seed = seed * 1_000_003 + zlib.crc32(split.encode("utf-8"))
    return parse(generate(n_synthetic, split_seed))
