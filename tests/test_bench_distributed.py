"""`python -m flybatch.bench ... --distributed` under two gloo ranks on loopback (tiny, synthetic).

The ranks are started as in tests/test_distributed.py: plain processes with torchrun's
environment variables (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT=<a free port>), so
`fbd.init()` takes the same path as under `torchrun --nproc-per-node 2`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from flybatch.bench.tasks import create
from flybatch.bench.tasks_data import minibatches, prepare

SRC = Path(__file__).resolve().parent.parent / "src"
BATCH, N_SYNTHETIC = 4, 12


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bench_distributed_two_ranks_report_world_size_and_throughput(tmp_path):
    out = tmp_path / "r.jsonl"
    cmd = [sys.executable, "-m", "flybatch.bench", "treelstm", "--modes", "agenda",
           "dynet-agenda", "--distributed", "--quick", "--seconds", "0", "--eval-seconds", "0",
           "--batch-size", str(BATCH), "--n-synthetic", str(N_SYNTHETIC), "--out", str(out)]
    port, world = free_port(), 2
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   CUDA_VISIBLE_DEVICES="",
                   PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
        if any(name == "lo" for _, name in socket.if_nameindex()):
            env["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
        procs.append(subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for p in procs:
            results.append(p.communicate(timeout=90))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for rank, (p, (stdout, stderr)) in enumerate(zip(procs, results)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{stderr[-3000:]}"
    (out0, _), (out1, _) = results
    assert out1 == ""  # only rank 0 prints
    assert "dynet-agenda: skipped (--distributed" in out0
    assert "2 processes: train" in out0 and "**Distributed**" in out0
    assert "| treelstm | agenda | 2 |" in out0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 1  # one record, written by rank 0
    rec = lines[0]
    assert rec["mode"] == "agenda" and rec["world_size"] == 2
    assert len(rec["per_process"]) == 2 and all(x > 0 for x in rec["per_process"])
    assert rec["total"] > 0 and rec["train_per_s"] == rec["total"]
    assert len(rec["eval_per_process"]) == 2 and rec["eval_total"] > 0
    assert "allreduce" in rec["seconds"]
    # The first minibatch's loss, summed over the ranks' shards, is one process's loss on it.
    data = prepare("treelstm", None, seed=0, n_synthetic=N_SYNTHETIC)
    torch.manual_seed(0)
    task = create("treelstm", data, "cpu", seed=0)
    single = task.step("agenda", next(minibatches(data.train, BATCH, 0)), train=True).loss
    assert abs(rec["first_loss"] - single) <= 1e-4 * abs(single), (rec["first_loss"], single)
