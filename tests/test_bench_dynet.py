"""The DyNet peer: which build runs, that the record says so, and that it computes our loss.

The end-to-end tests run each installed DyNet build (`make peers`) and skip the builds that are
not installed; the others need no DyNet.
"""

import ast
import gc
import inspect
import json

import pytest

from flybatch.bench import __main__ as cli
from flybatch.bench import dynet_peer, report, runner
from flybatch.bench.tasks import TASKS

pytestmark = pytest.mark.usefixtures("one_thread")


def fake_venvs(monkeypatch, tmp_path, releases):
    """A repository root where the venvs of `releases` exist (as empty interpreters)."""
    monkeypatch.setattr(runner, "REPO", tmp_path)
    monkeypatch.delenv("FLYBATCH_PEERS_PYTHON", raising=False)
    for release in releases:
        python = tmp_path / runner.DYNET_VENVS[release] / "bin/python"
        python.parent.mkdir(parents=True)
        python.touch()


@pytest.mark.parametrize("installed, expected", [(("2.1.2", "2.2"), "2.2"),
                                                 (("2.1.2",), "2.1.2"), ((), "2.2")])
def test_default_dynet_is_the_faster_build_when_installed(monkeypatch, tmp_path, installed,
                                                          expected):
    fake_venvs(monkeypatch, tmp_path, installed)
    assert runner.default_dynet() == expected
    assert runner.peer_python() == tmp_path / runner.DYNET_VENVS[expected] / "bin/python"


def test_a_missing_build_says_how_to_install_it(monkeypatch, tmp_path):
    fake_venvs(monkeypatch, tmp_path, ["2.2"])
    assert runner.peers_available("2.1.2") == "DyNet 2.1.2 not installed: run `make peers`"


def test_cli_accepts_every_build_make_peers_installs():
    for release in runner.DYNET_VENVS:
        assert cli.parse_args(["treelstm", "--dynet", release]).dynet == release
    assert cli.parse_args(["treelstm"]).dynet is None  # the runner's default_dynet()


def test_summary_and_report_say_which_dynet_ran():
    rec = {"task": "treelstm", "mode": "dynet-agenda", "dynet": "2.2", "train_per_s": 700.0,
           "eval_per_s": 900.0, "first_loss": 1.0, "batch_size": 64, "threads": 1,
           "device": "cpu", "data": "real"}
    assert "(DyNet 2.2)" in runner._summary(rec)
    assert "dynet-* modes: DyNet 2.2." in report.markdown([rec])


def test_peer_never_puts_a_scalar_left_of_an_expression():
    """The 2.2 wheel's Expression has no reflected operators: `1.0 - e` raises TypeError."""
    tree = ast.parse(inspect.getsource(dynet_peer))
    bad = [ast.unparse(n) for n in ast.walk(tree)
           if isinstance(n, ast.BinOp) and isinstance(n.left, ast.Constant)
           and not isinstance(n.right, ast.Constant)
           and "dy." in ast.unparse(n.right)]
    assert bad == []


@pytest.mark.parametrize("release", sorted(runner.DYNET_VENVS))
@pytest.mark.parametrize("task", TASKS)
def test_installed_dynet_computes_our_first_loss_and_is_recorded(release, task, tmp_path,
                                                                 capsys):
    why = runner.peers_available(release)
    if why:
        pytest.skip(why)
    s = runner.Settings(batch_size=4, seconds=0.0, eval_seconds=0.0, warmup=0, eval_warmup=0,
                        min_timed=1, n_synthetic=8, out=str(tmp_path / "r.jsonl"),
                        dynet=release)
    try:
        recs = runner.run_task(task, ["agenda", "dynet-agenda"], s)  # raises on a loss mismatch
    finally:
        gc.unfreeze()  # run_task freezes the objects alive after loading the data
    assert [r["mode"] for r in recs] == ["agenda", "dynet-agenda"], capsys.readouterr().out
    assert recs[1]["dynet"] == release
    written = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert written[1]["dynet"] == release
