"""Specifications for the benchmark data layer (flybatch.datasets) and the
arc-hybrid transition system (flybatch.bench.arc_hybrid).

Tests against the real corpora run only when FLYBATCH_DATA_DIR points at a
directory holding sst/, wikiner/ and ud-english/ (see that directory's
README.md for the expected counts).
"""

from __future__ import annotations

import os
import random
import statistics
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flybatch.bench.arc_hybrid import (
    LEFT_ARC,
    RIGHT_ARC,
    SHIFT,
    Config,
    heads_from_conllu,
    heads_to_conllu,
    oracle_transitions,
    static_oracle,
)
from flybatch.datasets import (
    NER_TAGS,
    UNK,
    UPOS_TAGS,
    Sentence,
    Tree,
    Vocab,
    generate_conllu_text,
    generate_sst_text,
    generate_tagged_text,
    is_projective,
    load_conllu,
    load_split,
    load_sst,
    load_tagged,
    parse_conllu,
    parse_sst,
    parse_tagged,
)

NBSP = "\u00a0"


def _data_dir() -> Path | None:
    value = os.environ.get("FLYBATCH_DATA_DIR")
    if not value:
        return None
    path = Path(value)
    if not all((path / sub).is_dir() for sub in ("sst", "wikiner", "ud-english")):
        return None
    return path


DATA_DIR = _data_dir()
needs_data = pytest.mark.skipif(DATA_DIR is None, reason="FLYBATCH_DATA_DIR not set or incomplete")


def parse_with_oracle(conllu_heads: list[int]) -> list[int]:
    """Follow the static oracle from the initial configuration; CoNLL-U heads out."""
    gold = heads_from_conllu(conllu_heads)
    config = Config(len(gold))
    for _ in range(2 * len(gold)):
        config.apply(static_oracle(config, gold))
    assert config.done()
    return heads_to_conllu(config.heads)


# --------------------------------------------------------------------------- SST


def test_sst_tree_structure_and_helpers():
    (tree,) = parse_sst("(3 (2 It) (4 (2 's) (3 good)))\n")
    assert tree.label == 3 and tree.word is None and len(tree.children) == 2
    assert tree.children[0] == Tree(2, (), "It")
    assert tree.words() == ["It", "'s", "good"]
    assert tree.height() == 3
    # post-order: children before parents, root last
    assert [(n.label, n.word) for n in tree.nodes()] == [
        (2, "It"), (2, "'s"), (3, "good"), (4, None), (3, None),
    ]  # fmt: skip


def test_sst_one_tree_per_line_blank_lines_and_crlf_ignored():
    trees = parse_sst("(1 (2 a) (0 b))\r\n\n(4 c)\n")
    assert [t.words() for t in trees] == [["a", "b"], ["c"]]
    assert trees[1].is_leaf and trees[1].height() == 1


def test_sst_nbsp_inside_token_stays_one_token():
    (tree,) = parse_sst(f"(2 (2 8{NBSP}1\\/2) (2 weeks))")
    assert tree.words() == [f"8{NBSP}1/2", "weeks"]


def test_sst_slash_unescaped_and_brackets_kept_as_words():
    (tree,) = parse_sst("(2 (2 -LRB-) (2 (2 and\\/or) (2 -RRB-)))")
    assert tree.words() == ["-LRB-", "and/or", "-RRB-"]


def test_sst_to_ptb_round_trips():
    line = f"(3 (2 (2 -LRB-) (2 1\\/2)) (4 (2 8{NBSP}1\\/2) (3 good)))"
    (tree,) = parse_sst(line)
    assert tree.to_ptb() == line
    assert parse_sst(tree.to_ptb()) == [tree]


@pytest.mark.parametrize("bad", ["(3 (2 a)", "(3 (2 a)))", "(x a)", "(2 a b)", "(2 )", "(2 a) (2 b)"])
def test_sst_malformed_lines_raise(bad):
    with pytest.raises(ValueError):
        parse_sst(bad)


def test_sst_deep_tree_does_not_recurse():
    depth = 5000
    line = "(2 " * depth + "(2 w)" + ")" * depth
    (tree,) = parse_sst(line)
    assert tree.height() == depth + 1
    assert sum(1 for _ in tree.nodes()) == depth + 1


# --------------------------------------------------------------------------- WikiNER


def test_tagged_split_on_last_bar():
    (sent,) = parse_tagged("New|I-LOC York|I-LOC a|b|O x||O\n")
    assert sent == [("New", "I-LOC"), ("York", "I-LOC"), ("a|b", "O"), ("x|", "O")]


def test_tagged_ascii_space_only():
    sents = parse_tagged(f"8{NBSP}1/2|O km|O\n\nsecond|O\n")
    assert sents == [[(f"8{NBSP}1/2", "O"), ("km", "O")], [("second", "O")]]


@pytest.mark.parametrize("bad", ["word", "word|", "|O"])
def test_tagged_malformed_token_raises(bad):
    with pytest.raises(ValueError):
        parse_tagged(bad)


# --------------------------------------------------------------------------- CoNLL-U

CONLLU_SAMPLE = (
    "# sent_id = 1\n"
    "# text = I don't like 8\u00a01/2\n"
    "1\tI\tI\tPRON\tPRP\t_\t3\tnsubj\t3:nsubj\t_\n"
    "2-3\tdon't\t_\t_\t_\t_\t_\t_\t_\t_\n"
    "2\tdo\tdo\tAUX\tVBP\t_\t4\taux\t4:aux\t_\n"
    "3\tn't\tnot\tPART\tRB\t_\t4\tadvmod\t4:advmod\t_\n"
    "4\tlike\tlike\tVERB\tVB\t_\t0\troot\t0:root\t_\n"
    "4.1\tlike\tlike\tVERB\tVB\t_\t_\t_\t4:conj\t_\n"
    f"5\t8{NBSP}1/2\t8{NBSP}1/2\tNUM\tCD\t_\t4\tobj\t4:obj\tSpaceAfter=No\n"
    "\n"
    "1\tHi\thi\tINTJ\tUH\t_\t0\troot\t0:root\t_\n"  # no trailing blank line
)


def test_conllu_skips_comments_ranges_and_empty_nodes():
    first, second = parse_conllu(CONLLU_SAMPLE)
    assert first == Sentence(
        words=["I", "do", "n't", "like", f"8{NBSP}1/2"],
        upos=["PRON", "AUX", "PART", "VERB", "NUM"],
        heads=[3, 4, 4, 0, 4],
        deprels=["nsubj", "aux", "advmod", "root", "obj"],
    )
    assert second.words == ["Hi"] and second.heads == [0] and len(second) == 1


def test_conllu_rejects_wrong_column_count_and_bad_ids():
    with pytest.raises(ValueError):
        parse_conllu("1 I I PRON PRP _ 0 root _ _\n")  # spaces are not column separators
    with pytest.raises(ValueError):
        parse_conllu("2\tI\tI\tPRON\t_\t_\t0\troot\t_\t_\n")


def test_is_projective():
    assert is_projective([0])
    assert is_projective([2, 0, 2])
    assert not is_projective([3, 4, 0, 3])  # arcs 1<-3 and 2<-4 cross
    # No crossing among word arcs, but the arc 1->3 covers the root word 2.
    assert not is_projective([2, 0, 1])


# --------------------------------------------------------------------------- Vocab


def test_vocab_ids_min_count_specials_and_counts():
    tokens = "the cat the dog the cat bird".split(" ")
    vocab = Vocab.build(tokens, min_count=2, specials=("<s>", "</s>"))
    assert vocab.itos == [UNK, "<s>", "</s>", "the", "cat"]
    assert vocab[UNK] == 0 and vocab["<s>"] == 1 and vocab["</s>"] == 2
    assert vocab["the"] == 3 and vocab["cat"] == 4
    assert vocab["dog"] == 0 and vocab["zebra"] == 0  # rare and unseen both map to <unk>
    assert len(vocab) == 5
    assert vocab.counts["dog"] == 1 and vocab.counts["the"] == 3 and vocab.counts["zebra"] == 0
    assert vocab.lookup(["cat", "zebra"]) == [4, 0]
    assert "cat" in vocab and "dog" not in vocab


# --------------------------------------------------------------------------- synthetic data


def test_generators_are_deterministic():
    for generate in (generate_sst_text, generate_tagged_text, generate_conllu_text):
        assert generate(50, 7) == generate(50, 7)
        assert generate(50, 7) != generate(50, 8)


def test_generated_sst_round_trips_with_sst_like_statistics():
    text = generate_sst_text(1000, seed=1)
    trees = parse_sst(text)
    assert len(trees) == 1000
    assert "\n".join(t.to_ptb() for t in trees) + "\n" == text
    lengths = [len(t.words()) for t in trees]
    assert 16 <= statistics.mean(lengths) <= 22
    assert min(lengths) >= 1 and 40 <= max(lengths) <= 60
    for tree in trees:
        for node in tree.nodes():
            assert node.label in range(5)
            assert (node.word is None) == (len(node.children) == 2)
    vocab = Vocab.build(w for t in trees for w in t.words())
    assert 1000 <= len(vocab) <= 6000
    assert {t.label for t in trees} == set(range(5))
    # the quirks of the real files are exercised
    assert "\\/" in text and "-LRB-" in text and NBSP in text
    assert any(NBSP in w for t in trees for w in t.words())


def test_generated_tagged_round_trips_with_wikiner_like_statistics():
    text = generate_tagged_text(1000, seed=2)
    sents = parse_tagged(text)
    assert len(sents) == 1000
    assert statistics.mean(len(s) for s in sents) == pytest.approx(25, abs=3)
    tags = Counter(tag for s in sents for _, tag in s)
    assert set(tags) == set(NER_TAGS)
    assert 0.75 < tags["O"] / sum(tags.values()) < 0.95
    assert any("|" in word for s in sents for word, _ in s)


def test_generated_conllu_round_trips_with_valid_trees():
    text = generate_conllu_text(1000, seed=3)
    sents = parse_conllu(text)
    assert len(sents) == 1000
    lines = text.split("\n")
    assert any(line.split("\t")[0].count("-") == 1 for line in lines)  # range lines present
    assert any("." in line.split("\t")[0] for line in lines if line and line[0].isdigit())
    assert all(len(line.split("\t")) == 10 for line in lines if line and not line.startswith("#"))
    assert {p for s in sents for p in s.upos} == set(UPOS_TAGS)
    for s in sents:
        n = len(s)
        assert len(s.upos) == len(s.heads) == len(s.deprels) == n
        assert s.heads.count(0) == 1 and s.deprels[s.heads.index(0)] == "root"
        assert all(0 <= h <= n and h != d for d, h in enumerate(s.heads, start=1))
        for d in range(1, n + 1):  # every word reaches the root: no cycles
            seen = set()
            while d:
                assert d not in seen
                seen.add(d)
                d = s.heads[d - 1]
    non_proj = sum(not is_projective(s.heads) for s in sents)
    assert 5 <= non_proj <= 80  # mostly projective, a few not
    assert 12 <= statistics.mean(len(s) for s in sents) <= 22


def test_load_split_synthetic():
    train = load_split("conllu", None, "train", n_synthetic=100, seed=0)
    dev = load_split("conllu", None, "dev", n_synthetic=100, seed=0)
    assert len(train) == len(dev) == 100 and train != dev
    assert train == load_split("conllu", None, "train", n_synthetic=100, seed=0)
    assert isinstance(load_split("sst", None, "train", n_synthetic=5)[0], Tree)
    assert isinstance(load_split("tagged", None, "train", n_synthetic=5)[0], list)
    with pytest.raises(ValueError):
        load_split("nope", None, "train")


def test_load_split_reads_the_documented_layout(tmp_path):
    (tmp_path / "sst").mkdir()
    (tmp_path / "sst" / "dev.txt").write_text("(2 (2 a) (2 b))\n", encoding="utf-8")
    (tmp_path / "wikiner").mkdir()
    (tmp_path / "wikiner" / "dev.txt").write_text("a|O\n", encoding="utf-8")
    (tmp_path / "ud-english").mkdir()
    (tmp_path / "ud-english" / "dev.conllu").write_text(CONLLU_SAMPLE, encoding="utf-8")
    assert load_split("sst", str(tmp_path), "dev")[0].words() == ["a", "b"]
    assert load_split("tagged", tmp_path, "dev") == [[("a", "O")]]
    assert len(load_split("conllu", tmp_path, "dev")) == 2
    assert load_sst(tmp_path / "sst" / "dev.txt") == load_split("sst", tmp_path, "dev")


# --------------------------------------------------------------------------- arc-hybrid


def test_arc_hybrid_legality_with_root_at_end():
    config = Config(2)
    assert config.buffer == range(0, 3) and config.root == 2
    assert config.legal() == [SHIFT]
    config.apply(SHIFT)
    assert config.legal() == [SHIFT, LEFT_ARC]
    config.apply(SHIFT)  # buffer now holds only ROOT: it can never be shifted
    assert config.legal() == [RIGHT_ARC]  # LEFT-ARC to ROOT needs a single word on the stack
    with pytest.raises(ValueError):
        config.apply(SHIFT)
    config.apply(RIGHT_ARC)
    assert config.heads == [-1, 0] and config.legal() == [LEFT_ARC]
    config.apply(LEFT_ARC)
    assert config.done() and config.legal() == [] and config.heads == [2, 0]


def test_head_conversion_round_trips():
    assert heads_from_conllu([2, 0, 2]) == [1, 3, 1]
    assert heads_to_conllu([1, 3, 1]) == [2, 0, 2]


def test_oracle_reproduces_projective_synthetic_trees():
    sents = parse_conllu(generate_conllu_text(500, seed=4))
    projective = [s for s in sents if is_projective(s.heads)]
    assert len(projective) < len(sents)
    for s in projective:
        assert parse_with_oracle(s.heads) == s.heads
        assert len(oracle_transitions(heads_from_conllu(s.heads))) == 2 * len(s)


def test_oracle_cannot_reproduce_non_projective_trees():
    sents = parse_conllu(generate_conllu_text(500, seed=4))
    for s in sents:
        if not is_projective(s.heads):
            result = parse_with_oracle(s.heads)
            assert result != s.heads and is_projective(result)


@st.composite
def random_trees(draw):
    """Any single-rooted dependency tree (CoNLL-U heads), projective or not."""
    n = draw(st.integers(1, 12))
    rng = random.Random(draw(st.integers(0, 2**32)))
    order = list(range(1, n + 1))
    rng.shuffle(order)
    heads = [0] * n
    for i, word in enumerate(order[1:], start=1):
        heads[word - 1] = order[rng.randrange(i)]  # attach to an earlier word
    return heads


@settings(max_examples=300, deadline=None)
@given(random_trees())
def test_oracle_reproduces_a_tree_iff_it_is_projective(heads):
    assert (parse_with_oracle(heads) == heads) == is_projective(heads)


# --------------------------------------------------------------------------- real data


@needs_data
def test_real_sst_counts():
    trees = load_sst(DATA_DIR / "sst" / "train.txt")
    assert len(trees) == 8544
    assert sum(len(t.words()) for t in trees) == 163563
    assert sum(1 for t in trees for _ in t.nodes()) == 318582
    assert Counter(t.label for t in trees) == {0: 1092, 1: 2218, 2: 1624, 3: 2322, 4: 1288}
    assert sum(NBSP in w for t in trees for w in t.words()) == 3
    dev = load_split("sst", str(DATA_DIR), "dev")
    assert (len(dev), sum(len(t.words()) for t in dev)) == (1101, 21274)


@needs_data
def test_real_wikiner_counts():
    sents = load_tagged(DATA_DIR / "wikiner" / "train.txt")
    assert len(sents) == 10000
    assert sum(map(len, sents)) == 248038
    tags = Counter(tag for s in sents for _, tag in s)
    assert tags["O"] == 213949 and tags["I-PER"] == 11318
    dev = load_split("tagged", str(DATA_DIR), "dev")
    assert (len(dev), sum(map(len, dev))) == (1696, 39007)


@needs_data
def test_real_ud_counts_and_oracle():
    sents = load_conllu(DATA_DIR / "ud-english" / "train.conllu")
    assert len(sents) == 12544
    assert sum(map(len, sents)) == 204577
    assert len({p for s in sents for p in s.upos}) == 17
    projective = [s for s in sents if is_projective(s.heads)]
    assert len(sents) - len(projective) == 288
    for s in projective:
        assert parse_with_oracle(s.heads) == s.heads
    dev = load_split("conllu", str(DATA_DIR), "dev")
    assert (len(dev), sum(map(len, dev)), sum(not is_projective(s.heads) for s in dev)) == (
        2001,
        25147,
        31,
    )
