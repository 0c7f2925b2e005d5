"""The benchmark instrument: every mode of every task computes the same thing (tiny, synthetic)."""

import json

import numpy as np
import pytest
import torch

import flybatch as fb
from flybatch.bench import overhead, report, runner
from flybatch.bench.tasks import MODES, create
from flybatch.bench.tasks_data import minibatches, prepare, tree_nodes

OWN_TASKS = ("bilstm-synthetic", "bilstm", "bilstm-char", "treelstm")
BATCH = 4


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def datasets():
    out = {t: prepare(t, None, seed=0, n_synthetic=12) for t in OWN_TASKS}
    for t in ("bilstm-synthetic", "bilstm", "bilstm-char"):  # short sentences: a fast test
        d = out[t]
        d.train = [x._replace(**{k: v[:7] for k, v in x._asdict().items() if v is not None})
                   for x in d.train]
        d.dev = [x._replace(**{k: v[:7] for k, v in x._asdict().items() if v is not None})
                 for x in d.dev]
    return out


@pytest.mark.parametrize("task_name", OWN_TASKS)
def test_modes_agree_on_loss_gradients_and_predictions(task_name, datasets):
    data = datasets[task_name]
    batches = minibatches(data.train, BATCH, seed=0)
    first, second = next(batches), next(batches)
    task = create(task_name, data, "cpu", seed=0)
    losses, preds, grads = {}, {}, {}
    for mode in MODES:
        r = task.step(mode, first, train=True)
        losses[mode] = r.loss
        grads[mode] = {n: p.grad.to_dense().clone() for n, p in task.params.items()
                       if p.grad is not None}
        for p in task.params.values():
            p.grad = None
        preds[mode] = task.step(mode, data.dev[:BATCH], train=False).predictions
        assert (r.stats is not None) == (mode in ("none", "depth", "agenda", "auto"))
    print(runner.check_losses(task_name, losses))  # raises on a mismatch
    for mode in MODES[1:]:
        assert preds[mode] == preds["eager"], mode
        assert grads[mode].keys() == grads["eager"].keys()
        for n, g in grads[mode].items():
            torch.testing.assert_close(g, grads["eager"][n], rtol=1e-3, atol=1e-4, msg=n)
    # The optimizer updates embedding tables sparsely: their gradients are sparse.
    r = task.step("agenda", second, train=True)
    assert all(p.grad.is_sparse for p in task.sparse_params)
    runner.Optimizer(task).step()
    assert all(p.grad is None for p in task.params.values())


def test_same_seed_same_parameters_and_spec_round_trip(datasets):
    data = datasets["treelstm"]
    a, b = create("treelstm", data, "cpu", 0), create("treelstm", data, "cpu", 0)
    spec = a.export_spec()
    assert set(spec) == {"E", "W_i", "W_o", "W_u", "U_i", "U_o", "U_u", "U_f1", "U_f2",
                         "b_i", "b_o", "b_u", "b_f", "W_out", "b_out"}
    assert spec["U_i"].shape == (256, 512) and spec["W_out"].shape == (5, 256)
    for n, v in b.export_spec().items():
        np.testing.assert_array_equal(v, spec[n])
    c = create("treelstm", data, "cpu", seed=1)
    assert not np.array_equal(c.export_spec()["W_i"], spec["W_i"])
    c.load_spec(spec)
    for n, v in c.export_spec().items():
        np.testing.assert_array_equal(v, spec[n])


def test_tagger_spec_names(datasets):
    spec = create("bilstm-char", datasets["bilstm-char"], "cpu", 0).export_spec()
    lstm = {f"{p}.{k}" for p in ("lstm1.fwd", "lstm1.bwd", "char.fwd", "char.bwd")
            for k in ("W_ih", "W_hh", "b")}
    assert set(spec) == {"E", "C", "H", "O"} | lstm
    assert spec["char.fwd.W_ih"].shape == (512, 64) and spec["H"].shape == (256, 512)


def test_run_task_writes_results_and_report(tmp_path, datasets, capsys):
    s = runner.Settings(batch_size=BATCH, seconds=0.0, eval_seconds=0.0, warmup=0, min_timed=1,
                        n_synthetic=12, out=str(tmp_path / "r.jsonl"))
    recs = runner.run_task("treelstm", ["eager", "agenda", "manual"], s)
    assert [r["mode"] for r in recs][:3] == ["eager", "agenda", "manual"]
    lines = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert len(lines) == len(recs)
    agenda = recs[1]
    assert agenda["launches"] >= agenda["lower_bound"] > 0 and agenda["train_per_s"] > 0
    assert set(agenda["seconds"]) >= {"build", "schedule", "forward", "backward", "update"}
    # the build split into the task's per-instance Python and flybatch's op calls
    assert agenda["build_split"]["flybatch"] > 0 and agenda["build_split"]["user"] > 0
    assert "build_split" not in recs[0] and "build_split" not in recs[2]
    # which kernels ran the Tree-LSTM cells: the fused ones (the default on CPU), only there
    assert set(agenda["tree_lstm_paths"]) == {"fused"} and agenda["tree_lstm_paths"]["fused"] > 0
    assert "tree_lstm_paths" not in recs[0] and "tree_lstm_paths" not in recs[2]
    out = capsys.readouterr().out
    assert "correctness treelstm" in out and "OK" in out and "Tree-LSTM cells fused x" in out
    table = report.markdown(lines)
    assert "| treelstm |" in table and "agenda" in table and "(user " in table and "% / flybatch" in table
    assert {p.name for p in report.charts(lines, tmp_path)} == {"throughput.png",
                                                                 "breakdown.png"}


def test_every_mode_reports_gflops_next_to_the_gemm_peak(tmp_path, datasets, capsys):
    s = runner.Settings(batch_size=BATCH, seconds=0.0, eval_seconds=0.0, warmup=0, min_timed=1,
                        n_synthetic=12, out=str(tmp_path / "r.jsonl"))
    recs = runner.run_task("treelstm", ["eager", "agenda", "manual", "torch-native"], s)
    lines = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    for r in lines:
        assert r["gemm_peak_gflop_per_s"] > 0
        assert r["gflop_per_s"] > 0 and r["percent_of_peak"] > 0
    eager, agenda, manual, native = recs
    assert agenda["flops_counted_by"] == native["flops_counted_by"] == "own steps"
    assert eager["flops_counted_by"] == manual["flops_counted_by"] == "flybatch, same minibatches"
    # Each mode timed one minibatch, the same one (the second): its exact count, in every mode.
    batches = minibatches(datasets["treelstm"].train, BATCH, seed=0)
    next(batches)
    nodes = [n for tree in next(batches) for n in tree_nodes(tree)]
    leaves = sum(not n.children for n in nodes)
    H, labels = 256, datasets["treelstm"].sizes["labels"]
    # leaves: W_iou; inner nodes: U_iou and U_f1, U_f2; every node: W_out. Each product runs
    # forward, dX and dW: three of its size.
    expected = 3 * 2 * (leaves * H * 3 * H + (len(nodes) - leaves) * (2 * H * 3 * H + 2 * H * H)
                        + len(nodes) * H * labels)
    assert [r["flops_per_minibatch"] for r in recs] == [expected] * 4
    assert "GFLOP/s" in capsys.readouterr().out
    table = report.markdown(lines)
    assert "GFLOP/s vs peak" in table
    row = next(ln for ln in table.split("**GFLOP/s vs peak**")[1].splitlines()
               if ln.startswith("| treelstm |"))
    assert row.count("%)") == 4


def test_overhead_forward_splits_its_time_into_kernels_and_fixed_cost():
    row = overhead.measure_forward("agenda", steps=10, scattered=False)
    assert row["nodes"] == overhead.PARSERS * 5  # concat, affine, tanh, matmul, loss
    assert 0 < row["kernel_us"] < row["forward_us"]
    assert 0 < row["fixed_us"] < row["forward_us"]


def test_kernel_time_is_counted_only_when_asked():
    with fb.Graph() as graph:
        x = fb.tanh(fb.input(torch.ones(3)))
        graph.forward()
        assert graph.kernel_seconds is None  # off by default: no clock read per batch
        graph.kernel_seconds = 0.0
        fb.tanh(x).value()
        assert graph.kernel_seconds > 0


def test_mismatched_losses_fail_loudly():
    with pytest.raises(runner.CorrectnessError, match="MISMATCH"):
        runner.check_losses("x", {"eager": 10.0, "agenda": 10.5})


@pytest.mark.parametrize("mode", ["torch-native", "fb-unfused"])
def test_treelstm_torch_native_and_unfused_modes_train_like_eager(datasets, mode):
    """The Tree-LSTM's eager code, unchanged inside a graph (torch-native) or transcribed op for
    op into fb ops (fb-unfused): same loss, gradients, predictions as eagerly."""
    data = datasets["treelstm"]
    batch = next(minibatches(data.train, BATCH, seed=0))
    task = create("treelstm", data, "cpu", seed=0)
    assert mode in task.modes()
    runs = {}
    for m in ("eager", mode):
        r = task.step(m, batch, train=True)
        grads = {n: p.grad.to_dense().clone() for n, p in task.params.items()}
        for p in task.params.values():
            p.grad = None
        runs[m] = (r, grads, task.step(m, data.dev[:BATCH], train=False).predictions)
    (eager, eager_grads, eager_preds), (other, other_grads, other_preds) = runs.values()
    assert other.loss == pytest.approx(eager.loss, rel=1e-5)
    assert other.stats.batches < other.stats.nodes / 4
    assert other_preds == eager_preds
    for n, g in other_grads.items():
        torch.testing.assert_close(g, eager_grads[n], rtol=1e-3, atol=1e-4, msg=n)
