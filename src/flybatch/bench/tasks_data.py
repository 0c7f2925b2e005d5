"""Task data for the benchmarks, shared by every mode (torch, flybatch, DyNet peer).

Pure Python: no torch, no dynet.  :func:`prepare` reads (or generates) a task's
data, builds the vocabularies from the *training* split as ``notes/model_spec.md``
prescribes, and converts every instance to integer ids; :func:`minibatches` is
the deterministic minibatch sampler all modes use, so that with the same seed
and the same initial parameters every mode sees the same first minibatch and
reports the same ``first_loss``.

Instance formats (all ids are ``int``; sequences are tuples):

``bilstm-synthetic``, ``bilstm``
    :class:`Tagged` ``(words, tags, chars=None)``.
``bilstm-char``
    :class:`Tagged` with ``chars``: one tuple of character ids per token,
    present for *every* token.  The model embeds a token from its characters
    exactly when its word id is 0 (the word was seen < 5 times in train, or
    never), and from ``E`` otherwise.
``treelstm``
    :class:`IdTree` ``(label, word, children)``: a preterminal has a word id and
    ``children == ()``; a binary node has ``word is None`` and two children.
``parser``
    :class:`Parse` ``(words, pos, heads)``: ``words``/``pos`` have ``n + 1``
    entries, the ROOT token (word id 1, pos id 1) appended at the END (index
    ``n``); ``heads`` has ``n`` entries, ``heads[i]`` = 0-based index of the head
    of word ``i``, where the ROOT is index ``n``.  Only projective trees are kept
    in train (``stats["train_nonprojective_skipped"]`` counts the others); dev
    keeps every sentence (decoding needs no oracle).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple, Sequence

from flybatch.datasets import Vocab, is_projective, load_split

__all__ = [
    "TASKS",
    "Tagged",
    "IdTree",
    "Parse",
    "TaskData",
    "prepare",
    "synthetic_tagged",
    "minibatches",
    "eval_batches",
    "tree_nodes",
]

TASKS = ("bilstm-synthetic", "bilstm", "bilstm-char", "treelstm", "parser")

# Model-spec constants that decide the vocabularies.
TAGGER_MIN_COUNT = 5  # bilstm / bilstm-char: words seen < 5 times -> id 0
PARSER_MIN_COUNT = 2  # parser: words seen < 2 times -> id 0
ROOT = "<root>"  # parser: word id 1 and pos id 1
SYNTH_LENGTH, SYNTH_VOCAB, SYNTH_TAGS = 40, 1000, 300


class Tagged(NamedTuple):
    words: tuple[int, ...]
    tags: tuple[int, ...]
    chars: tuple[tuple[int, ...], ...] | None = None


class IdTree(NamedTuple):
    label: int
    word: int | None
    children: tuple["IdTree", ...]


class Parse(NamedTuple):
    words: tuple[int, ...]  # n + 1, ROOT (id 1) last
    pos: tuple[int, ...]  # n + 1, ROOT (id 1) last
    heads: tuple[int, ...]  # n, 0-based; ROOT = n


@dataclass
class TaskData:
    """A task's instances as ids, with the sizes the model needs.

    ``sizes`` keys by task: ``words``, ``tags`` (taggers), ``chars``
    (bilstm-char), ``labels`` (treelstm), ``pos`` (parser).  ``vocabs`` holds
    the :class:`~flybatch.datasets.Vocab` objects (tags: a tuple of tag strings,
    index = id).
    """

    task: str
    train: list
    dev: list
    sizes: dict[str, int]
    vocabs: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=dict)


# ---------------------------------------------------------------------------
# Per-task preparation
# ---------------------------------------------------------------------------


def synthetic_tagged(n: int, seed: int) -> list[Tagged]:
    """``n`` sequences of length 40, word ids in [0, 1000), tags in [0, 300)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = tuple(rng.randrange(SYNTH_VOCAB) for _ in range(SYNTH_LENGTH))
        tags = tuple(rng.randrange(SYNTH_TAGS) for _ in range(SYNTH_LENGTH))
        out.append(Tagged(words, tags))
    return out


def _tag_list(sentences) -> tuple[str, ...]:
    """Train tags by descending frequency, ties in string order (no <unk>)."""
    counts = Counter(t for s in sentences for _, t in s)
    return tuple(sorted(counts, key=lambda t: (-counts[t], t)))


def _prepare_tagger(task, data_dir, seed, n_synthetic) -> TaskData:
    train = load_split("tagged", data_dir, "train", n_synthetic, seed)
    dev = load_split("tagged", data_dir, "dev", max(1, n_synthetic // 4), seed)
    wv = Vocab.build((w for s in train for w, _ in s), min_count=TAGGER_MIN_COUNT)
    tag_list = _tag_list(train)
    tid = {t: i for i, t in enumerate(tag_list)}
    vocabs: dict[str, Any] = {"words": wv, "tags": tag_list}
    sizes = {"words": len(wv), "tags": len(tag_list)}
    cv = None
    if task == "bilstm-char":
        cv = Vocab.build(c for s in train for w, _ in s for c in w)
        vocabs["chars"] = cv
        sizes["chars"] = len(cv)

    def convert(sents):
        out = []
        for s in sents:
            words = tuple(wv.lookup(w for w, _ in s))
            tags = tuple(tid.get(t, -1) for _, t in s)  # -1: tag unseen in train (dev only)
            chars = tuple(tuple(cv.lookup(w)) for w, _ in s) if cv is not None else None
            out.append(Tagged(words, tags, chars))
        return out

    return TaskData(task, convert(train), convert(dev), sizes, vocabs,
                    {"train": len(train), "dev": len(dev)})


def _id_tree(tree, vocab: Vocab) -> IdTree:
    """Convert a :class:`flybatch.datasets.Tree` (recursive: SST trees are shallow)."""
    if tree.word is not None:
        return IdTree(tree.label, vocab[tree.word], ())
    return IdTree(tree.label, None, tuple(_id_tree(c, vocab) for c in tree.children))


def tree_nodes(tree: IdTree) -> Iterator[IdTree]:
    """Nodes of an :class:`IdTree` in post-order (children first), iteratively."""
    stack = [(tree, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded or not node.children:
            yield node
        else:
            stack.append((node, True))
            stack.extend((c, False) for c in reversed(node.children))


def _prepare_treelstm(task, data_dir, seed, n_synthetic) -> TaskData:
    train = load_split("sst", data_dir, "train", n_synthetic, seed)
    dev = load_split("sst", data_dir, "dev", max(1, n_synthetic // 4), seed)
    vocab = Vocab.build((w for t in train for w in t.words()), min_count=1)
    return TaskData(task, [_id_tree(t, vocab) for t in train], [_id_tree(t, vocab) for t in dev],
                    {"words": len(vocab), "labels": 5}, {"words": vocab},
                    {"train": len(train), "dev": len(dev)})


def _prepare_parser(task, data_dir, seed, n_synthetic) -> TaskData:
    train = load_split("conllu", data_dir, "train", n_synthetic, seed)
    dev = load_split("conllu", data_dir, "dev", max(1, n_synthetic // 4), seed)
    wv = Vocab.build((w for s in train for w in s.words), min_count=PARSER_MIN_COUNT,
                     specials=(ROOT,))
    pv = Vocab.build((p for s in train for p in s.upos), specials=(ROOT,))
    assert wv[ROOT] == 1 and pv[ROOT] == 1

    def convert(s) -> Parse:
        n = len(s.words)
        heads = tuple(n if h == 0 else h - 1 for h in s.heads)
        return Parse(tuple(wv.lookup(s.words)) + (1,), tuple(pv.lookup(s.upos)) + (1,), heads)

    kept = [convert(s) for s in train if is_projective(s.heads)]
    stats = {"train": len(kept), "dev": len(dev),
             "train_nonprojective_skipped": len(train) - len(kept)}
    return TaskData(task, kept, [convert(s) for s in dev],
                    {"words": len(wv), "pos": len(pv)}, {"words": wv, "pos": pv}, stats)


def prepare(task: str, data_dir=None, seed: int = 0, n_synthetic: int = 2000) -> TaskData:
    """Load/generate ``task``'s train and dev data and convert it to ids.

    Without ``data_dir`` the corpora are synthetic (:func:`flybatch.datasets.load_split`
    with ``n_synthetic`` train items and ``n_synthetic // 4`` dev items).
    ``bilstm-synthetic`` is always generated: ``n_synthetic`` train and
    ``n_synthetic // 4`` dev sequences from ``random.Random(seed)`` and
    ``random.Random(seed + 1)``.
    """
    if task == "bilstm-synthetic":
        train = synthetic_tagged(n_synthetic, seed)
        dev = synthetic_tagged(max(1, n_synthetic // 4), seed + 1)
        return TaskData(task, train, dev, {"words": SYNTH_VOCAB, "tags": SYNTH_TAGS}, {},
                        {"train": len(train), "dev": len(dev)})
    if task in ("bilstm", "bilstm-char"):
        return _prepare_tagger(task, data_dir, seed, n_synthetic)
    if task == "treelstm":
        return _prepare_treelstm(task, data_dir, seed, n_synthetic)
    if task == "parser":
        return _prepare_parser(task, data_dir, seed, n_synthetic)
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")


# ---------------------------------------------------------------------------
# Minibatches
# ---------------------------------------------------------------------------


def minibatches(instances: Sequence, batch_size: int = 64, seed: int = 0) -> Iterator[list]:
    """Endless training minibatches, deterministic in ``seed``.

    Epoch after epoch, the instance indices are shuffled by one
    ``random.Random(seed)`` (``rng.shuffle(list(range(n)))``) and cut into
    consecutive minibatches of ``batch_size``; a last partial minibatch of an
    epoch is dropped (unless the data is smaller than one minibatch, then the
    whole shuffled data is the minibatch).  So the first minibatch is the first
    ``batch_size`` instances after one seeded shuffle.
    """
    n = len(instances)
    if n == 0:
        raise ValueError("no instances")
    rng = random.Random(seed)
    while True:
        order = list(range(n))
        rng.shuffle(order)
        if n < batch_size:
            yield [instances[i] for i in order]
            continue
        for k in range(0, n - batch_size + 1, batch_size):
            yield [instances[i] for i in order[k : k + batch_size]]


def eval_batches(instances: Sequence, batch_size: int = 64) -> Iterator[list]:
    """The instances in order, in chunks of ``batch_size`` (the last may be short)."""
    for k in range(0, len(instances), batch_size):
        yield list(instances[k : k + batch_size])
