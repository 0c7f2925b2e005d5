"""The `parser` benchmark task: every mode computes the same model on the same Parameters.

Tiny synthetic data (batch 4), so the seven modes (the five of every task, plus the parser's
own `parser-auto` and `parser-seq`) run in a few seconds on a CPU.
"""

from __future__ import annotations

import gc

import pytest
import torch

import flybatch.execution
from flybatch.bench import __main__ as cli
from flybatch.bench import runner
from flybatch.bench.arc_hybrid import oracle_transitions
from flybatch.bench.tasks import EXTRA_MODES, MODES, TASKS, create, task_class
from flybatch.bench.tasks.parser import ParserTask
from flybatch.bench.tasks_data import minibatches, prepare

PARSER_MODES = MODES + ("parser-auto", "parser-seq")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data():
    return prepare("parser", None, seed=0, n_synthetic=40)


@pytest.fixture(scope="module")
def batch(data):
    return next(minibatches(data.train, 4, seed=0))


@pytest.fixture(scope="module")
def task(data):
    return create("parser", data, seed=0)


@pytest.fixture(scope="module")
def results(task, batch):
    """Per mode: the first-minibatch loss and the gradients it leaves (dense copies)."""
    out = {}
    for mode in PARSER_MODES:
        for p in task.params.values():
            p.grad = None
        step = task.step(mode, batch, train=True)
        grads = {n: (p.grad.to_dense() if p.grad.is_sparse else p.grad).clone()
                 for n, p in task.params.items()}
        sparse = {n: task.params[n].grad.is_sparse for n in ("E_word", "E_pos")}
        out[mode] = (step.loss, grads, sparse)
    return out


def test_registered():
    assert task_class("parser") is ParserTask
    assert ParserTask.modes() == PARSER_MODES


def test_extra_modes_are_the_parsers_and_treelstms_only_and_known_to_the_cli():
    own = {"parser": {"parser-auto", "parser-seq"}, "treelstm": {"torch-native", "fb-unfused"}}
    for name in TASKS:
        extra = set(task_class(name).TASK_EXTRA_MODES)
        assert extra <= set(EXTRA_MODES), name
        assert extra == own.get(name, set()), name
    assert cli.MODES == runner.ALL_MODES  # the CLI spells them out; same names, same order
    assert cli.parse_args(["parser", "--modes", "agenda", "parser-auto"]).modes == \
        ["agenda", "parser-auto"]


def test_other_tasks_skip_the_parser_modes(capsys, tmp_path):
    s = runner.Settings(seconds=0.0, eval_seconds=0.0, warmup=0, eval_warmup=0, min_timed=1,
                        n_synthetic=8, out=str(tmp_path / "r.jsonl"))
    try:
        assert runner.run_task("treelstm", ["parser-auto", "parser-seq"], s) == []
    finally:
        gc.unfreeze()  # run_task freezes the objects alive after loading the data
    out = capsys.readouterr().out
    assert "parser-auto: skipped (not a mode of treelstm" in out
    assert "parser-seq: skipped (not a mode of treelstm" in out
    with pytest.raises(ValueError, match="unknown mode"):
        create("treelstm", prepare("treelstm", None, seed=0, n_synthetic=4)).step(
            "parser-auto", [], train=True)


def test_parameters_have_the_spec_names_and_shapes(task, data):
    shapes = {n: tuple(a.shape) for n, a in task.export_spec().items()}
    V, P = data.sizes["words"], data.sizes["pos"]
    expected = {"E_word": (V, 100), "E_pos": (P, 25), "pad": (400,), "M_h": (100, 1600),
                "m_h": (100,), "M_o": (3, 100), "m_o": (3,)}
    for d in ("fwd", "bwd"):
        expected.update({f"lstm1.{d}.W_ih": (800, 125), f"lstm1.{d}.W_hh": (800, 200),
                         f"lstm1.{d}.b": (800,)})
    assert shapes == expected
    assert {id(p) for p in task.sparse_params} == {id(task.E_word), id(task.E_pos)}


def test_all_modes_compute_the_same_loss(results):
    reference = results["eager"][0]
    assert reference > 0
    for mode, (loss, _, _) in results.items():
        assert loss == pytest.approx(reference, rel=1e-5), mode


def test_all_modes_compute_the_same_gradients(results):
    _, reference, _ = results["eager"]
    for mode, (_, grads, _) in results.items():
        for name, g in grads.items():
            torch.testing.assert_close(g, reference[name], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{mode} {name}: {m}")


def test_embeddings_get_sparse_gradients_of_the_rows_used(results, batch, data):
    used = {w for inst in batch for w in inst.words}
    for mode, (_, grads, sparse) in results.items():
        assert sparse == {"E_word": True, "E_pos": True}, mode
        touched = set(torch.nonzero(grads["E_word"].abs().sum(1)).flatten().tolist())
        assert touched <= used, mode


def test_all_modes_predict_the_same_heads(task, batch):
    predictions = {mode: task.step(mode, batch, train=False).predictions
                   for mode in PARSER_MODES}
    for inst, heads in zip(batch, predictions["eager"]):
        assert len(heads) == len(inst.heads) and -1 not in heads  # a complete tree
    for mode, heads in predictions.items():
        assert heads == predictions["eager"], mode


@pytest.mark.parametrize("train", [True, False])
def test_flybatch_runs_one_forward_per_lockstep_step(task, batch, monkeypatch, train):
    forwards = []
    run = flybatch.execution.run
    monkeypatch.setattr(flybatch.execution, "run",
                        lambda graph, plan: forwards.append(len(plan)) or run(graph, plan))
    task.step("agenda", batch, train=train)
    # Arc-hybrid takes 2n transitions for n words; the parsers move in lockstep, so there are
    # as many steps as the longest sentence needs. Training adds one forward: the final loss.
    steps = max(len(oracle_transitions(inst.heads)) for inst in batch)
    assert steps == max(2 * len(inst.heads) for inst in batch)
    assert len(forwards) == steps + (1 if train else 0)
    # After the first forward (embeddings + BiLSTMs), a step runs every parser's MLP as one
    # batch per op (concat, affine, tanh, affine) and the previous step's hinge losses likewise
    # (pick, sub, add, relu; plus the constant 1 once): a few batches, not a few per parser.
    assert max(forwards[1:]) <= 9 if train else max(forwards[1:]) == 4


@pytest.mark.parametrize("train", [True, False])
def test_parser_auto_forwards_as_lockstep_and_parser_seq_once_per_request(task, batch,
                                                                         monkeypatch, train):
    """The per-sentence parser: map_batched batches its value requests across sentences."""
    forwards = []
    run = flybatch.execution.run
    monkeypatch.setattr(flybatch.execution, "run",
                        lambda graph, plan: forwards.append(len(plan)) or run(graph, plan))
    requests = [2 * len(inst.heads) for inst in batch]  # one per transition; sentences differ
    assert len(set(requests)) > 1
    final = 1 if train else 0  # the minibatch loss, after every sentence finished
    task.step("parser-auto", batch, train=train)
    assert len(forwards) == max(requests) + final
    assert max(forwards[1:]) <= 9 if train else max(forwards[1:]) == 4  # as lockstep agenda
    forwards.clear()
    task.step("parser-seq", batch, train=train)
    assert len(forwards) == sum(requests) + final


def test_parser_modes_share_one_per_sentence_function(task, batch, monkeypatch):
    calls = []
    parse = ParserTask.parse_sentence
    monkeypatch.setattr(ParserTask, "parse_sentence",
                        lambda self, inst, train: calls.append(inst) or parse(self, inst, train))
    for mode in ("parser-auto", "parser-seq"):
        calls.clear()
        task.step(mode, batch, train=True)
        assert calls == batch, mode


def test_loaded_spec_reaches_every_mode(task, data, batch, results):
    """`load_spec` writes in place, so the nn.LSTM of eager/manual sees the loaded weights too."""
    other = create("parser", data, seed=1)
    assert other.step("manual", batch, train=True).loss != pytest.approx(results["eager"][0])
    other.load_spec(task.export_spec())
    for mode in ("eager", "manual", "agenda", "parser-auto"):
        loss = other.step(mode, batch, train=True).loss
        assert loss == pytest.approx(results["eager"][0], rel=1e-5), mode
