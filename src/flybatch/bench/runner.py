"""The timing loop: one task in every mode, measured the same way, checked for the same loss.

For each mode a fresh task is built from the same seed (so every mode starts from the same
parameters) and trained on the same minibatch sequence (``tasks_data.minibatches``):

1. the first minibatch is the correctness probe: its loss (before any update) must agree across
   modes within float32 tolerance, else the run stops with :class:`CorrectnessError`. It also
   serves as warm-up, as do the next ``warmup`` minibatches;
2. then minibatches are timed until ``seconds`` have passed (at least ``min_timed``): each is
   forward + backward (``Task.step``) + the optimizer update (timed here): ``torch.optim.Adam``
   for the dense parameters and ``torch.optim.SparseAdam`` for the embedding tables, which then
   only touches the rows used in the minibatch (DyNet's sparse updates);
3. then dev minibatches are timed, forward only (predictions), for ``eval_seconds``.

A result is the medians of those minibatches: instances/s, seconds per phase, kernel launches
and their lower bound, input copies made and avoided, nodes, plus peak memory (peak RSS of the
process during the mode, the high-water mark reset per mode; on CUDA the peak allocated).
DyNet peers run as subprocesses in ``.venv-peers`` with the same initial parameters
(``--init``, from ``Task.export_spec``). Results go to stdout (a progress bar on stderr) and
are appended as JSON lines to ``out``.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flybatch.bench.tasks import MODES, create
from flybatch.bench.tasks_data import TaskData, eval_batches, minibatches, prepare

PEER_MODES = ("dynet-noauto", "dynet-depth", "dynet-agenda")
ALL_MODES = MODES + PEER_MODES
REPO = Path(__file__).resolve().parents[3]
PEERS_PYTHON = Path(os.environ.get("FLYBATCH_PEERS_PYTHON", REPO / ".venv-peers/bin/python"))
LR = 0.001
RTOL, ATOL = 1e-4, 1e-3  # first-loss agreement: float32 sums of thousands of terms


class CorrectnessError(RuntimeError):
    """Two modes computed different losses on the same first minibatch."""


@dataclass
class Settings:
    batch_size: int = 64
    seconds: float = 10.0          # timed training per mode
    eval_seconds: float | None = None  # default max(1, seconds / 4)
    warmup: int = 1                # untimed minibatches after the first (correctness) one
    eval_warmup: int = 1           # untimed evaluation minibatches
    min_timed: int = 3
    threads: int = 1
    device: str = "cpu"
    seed: int = 0
    n_synthetic: int = 2000
    data_dir: str | None = None
    out: str = "bench-results/results.jsonl"
    run_id: str = field(default_factory=lambda: datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))

    @property
    def eval_budget(self) -> float:
        return self.eval_seconds if self.eval_seconds is not None else max(1.0, self.seconds / 4)


# ---- optimizer ---------------------------------------------------------------------------------
class Optimizer:
    """Adam for dense parameters, SparseAdam (rows used only) for the embedding tables."""

    def __init__(self, task, lr: float = LR):
        self.params = list(task.params.values())
        self.dense = torch.optim.Adam(task.dense_params, lr=lr)
        self.sparse = torch.optim.SparseAdam(task.sparse_params, lr=lr) \
            if task.sparse_params else None

    def step(self) -> None:
        self.dense.step()
        if self.sparse is not None:
            self.sparse.step()
        for p in self.params:
            p.grad = None


# ---- memory --------------------------------------------------------------------------------------
def reset_peak_memory(device: torch.device) -> float:
    """Return freed memory to the OS and reset the peak; returns the RSS now (MB)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:  # glibc keeps freed blocks; give them back so the previous mode's peak does not count
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:  # Linux: "5" resets the peak RSS (VmHWM) of the process to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status_mb("VmRSS:")


def peak_memory_mb(device: torch.device, baseline: float) -> dict[str, float]:
    """Peak RSS during the mode, and its growth over the RSS when the mode started."""
    peak = _status_mb("VmHWM:") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = {"peak_rss_mb": peak, "peak_rss_growth_mb": max(0.0, peak - baseline)}
    if device.type == "cuda":
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def _status_mb(key: str) -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


# ---- progress bar --------------------------------------------------------------------------------
class Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, label: str, budget: float, stream=sys.stderr):
        self.label, self.budget, self.stream = label, budget, stream
        self.tty = stream.isatty()
        self.start = time.perf_counter()
        self.last = 0.0

    def update(self, done: int, phase: str) -> None:
        now = time.perf_counter()
        elapsed = now - self.start
        if not self.tty and now - self.last < 5.0:
            return
        self.last = now
        frac = min(1.0, elapsed / self.budget) if self.budget > 0 else 1.0
        bar = "#" * int(20 * frac) + "." * (20 - int(20 * frac))
        line = f"{self.label:32s} [{bar}] {phase:5s} {done:4d} minibatches {elapsed:6.1f}s"
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r" + " " * 90 + "\r")
            self.stream.flush()


# ---- one mode ------------------------------------------------------------------------------------
def _median_phases(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}


def run_mode(task_name: str, mode: str, data: TaskData, s: Settings) -> dict[str, Any]:
    """Train and evaluate one mode; returns its result record (no I/O)."""
    device = torch.device(s.device)
    torch.manual_seed(s.seed)
    task = create(task_name, data, device, s.seed)
    opt = Optimizer(task)
    batches = minibatches(data.train, s.batch_size, s.seed)
    bar = Progress(f"{task_name} {mode}", s.seconds + s.eval_budget)
    baseline = reset_peak_memory(device)

    first = task.step(mode, next(batches), train=True)
    opt.step()
    for _ in range(s.warmup):
        task.step(mode, next(batches), train=True)
        opt.step()
    timed, stats, sizes = [], [], []
    start = time.perf_counter()
    while len(timed) < s.min_timed or time.perf_counter() - start < s.seconds:
        batch = next(batches)
        r = task.step(mode, batch, train=True)
        t0 = time.perf_counter()
        opt.step()
        task.sync()
        update = time.perf_counter() - t0
        timed.append({**r.seconds, "update": update, "total": r.wall + update})
        sizes.append(len(batch))
        if r.stats is not None:
            stats.append(r.stats)
        bar.update(len(timed), "train")

    dev = [b for b in eval_batches(data.dev, s.batch_size) if len(b) == s.batch_size] \
        or [list(data.dev)]
    for k in range(s.eval_warmup):
        task.step(mode, dev[k % len(dev)], train=False)
    etimes, esizes = [], []
    start = time.perf_counter()
    while len(etimes) < s.min_timed or time.perf_counter() - start < s.eval_budget:
        batch = dev[len(etimes) % len(dev)]
        r = task.step(mode, batch, train=False)
        etimes.append(r.wall)
        esizes.append(len(batch))
        bar.update(len(etimes), "eval")
    bar.close()

    med = _median_phases(timed)
    total = med.pop("total")
    rec: dict[str, Any] = {
        "task": task_name, "mode": mode,
        "train_per_s": statistics.median(sizes) / total,
        "eval_per_s": statistics.median(esizes) / statistics.median(etimes),
        "first_loss": first.loss,
        "seconds_per_minibatch": total,
        "seconds": med,
        "timed_minibatches": len(timed), "timed_eval_minibatches": len(etimes),
        **peak_memory_mb(device, baseline),
    }
    if stats:
        def med_of(attr):
            return statistics.median(getattr(st, attr) for st in stats)
        rec.update(launches=med_of("batches"), lower_bound=med_of("lower_bound"),
                   launches_over_bound=med_of("launches_over_bound"),
                   gathers=med_of("gathers"), gathers_avoided=med_of("gathers_avoided"),
                   nodes=med_of("nodes"))
    return rec


# ---- DyNet peers ---------------------------------------------------------------------------------
def peers_available() -> str | None:
    """None when the peer environment can run DyNet, else why not."""
    if not PEERS_PYTHON.exists():
        return "DyNet not installed: run `make peers`"
    probe = subprocess.run([str(PEERS_PYTHON), "-c", "import dynet_config"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return "DyNet not importable in .venv-peers: run `make peers`"
    return None


def run_peer(task_name: str, mode: str, data: TaskData, s: Settings) -> dict[str, Any]:
    """One ``dynet-*`` mode in a subprocess, from the same initial parameters."""
    task = create(task_name, data, "cpu", s.seed)
    with tempfile.TemporaryDirectory() as tmp:
        init = Path(tmp) / "init.npz"
        np.savez(init, **task.export_spec())
        cmd = [str(PEERS_PYTHON), "-m", "flybatch.bench.dynet_peer", task_name,
               "--strategy", mode.split("-", 1)[1], "--batch-size", str(s.batch_size),
               "--seconds", str(s.seconds), "--eval-seconds", str(s.eval_budget),
               "--threads", str(s.threads), "--init", str(init), "--seed", str(s.seed),
               "--n-synthetic", str(s.n_synthetic), "--warmup", str(1 + s.warmup),
               "--min-timed", str(s.min_timed)]
        if s.data_dir:
            cmd += ["--data-dir", s.data_dir]
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
        print(f"{task_name} {mode}: running DyNet peer ...", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"{mode} failed (exit {proc.returncode}):\n{tail}")
    peer = json.loads(lines[-1])
    rec = {"task": task_name, "mode": mode, "train_per_s": peer["train_per_s"],
           "eval_per_s": peer["eval_per_s"], "first_loss": peer["first_loss"],
           "seconds": peer.get("seconds", {}), "peak_rss_mb": peer.get("peak_rss_mb"),
           "timed_minibatches": peer.get("timed_minibatches"),
           "timed_eval_minibatches": peer.get("timed_eval_minibatches")}
    rec["seconds_per_minibatch"] = sum(rec["seconds"].values()) or None
    return rec


# ---- correctness ---------------------------------------------------------------------------------
def check_losses(task_name: str, losses: dict[str, float]) -> str:
    """The correctness line; raises CorrectnessError when a mode disagrees."""
    ref_mode, ref = next(iter(losses.items()))
    bad = {m: v for m, v in losses.items()
           if not (math.isfinite(v) and abs(v - ref) <= ATOL + RTOL * abs(ref))}
    worst = max(abs(v - ref) / max(abs(ref), 1e-12) for v in losses.values())
    line = (f"correctness {task_name}: first-minibatch loss "
            + ", ".join(f"{m} {v:.6g}" for m, v in losses.items())
            + f" -> {'OK' if not bad else 'MISMATCH'} (max rel diff {worst:.1e}"
            + f", tolerance {RTOL:.0e} rel + {ATOL:.0e})")
    if bad:
        raise CorrectnessError(line + f"; {sorted(bad)} differ from {ref_mode}")
    return line


# ---- one task ------------------------------------------------------------------------------------
def environment(s: Settings) -> dict[str, Any]:
    return {"run_id": s.run_id, "date": datetime.date.today().isoformat(),
            "machine": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "threads": s.threads, "device": s.device,
            "torch": torch.__version__, "python": platform.python_version(),
            "batch_size": s.batch_size, "seconds": s.seconds}


def run_task(task_name: str, modes: list[str], s: Settings) -> list[dict[str, Any]]:
    """Every mode of one task; appends each result to ``s.out`` as it is made."""
    data = prepare(task_name, s.data_dir, seed=s.seed, n_synthetic=s.n_synthetic)
    real = s.data_dir is not None and task_name != "bilstm-synthetic"
    meta = {**environment(s), "data": "real" if real else "synthetic",
            "train_size": len(data.train), "dev_size": len(data.dev)}
    why_no_peers = peers_available() if any(m in PEER_MODES for m in modes) else None
    records, losses = [], {}
    for mode in modes:
        if mode in PEER_MODES:
            if why_no_peers:
                print(f"{mode}: skipped ({why_no_peers})", flush=True)
                continue
            if s.device != "cpu":
                print(f"{mode}: skipped (the DyNet peer runs on CPU only)", flush=True)
                continue
            try:
                rec = run_peer(task_name, mode, data, s)
            except RuntimeError as e:
                print(f"{task_name} {mode}: FAILED: {e}", flush=True)
                continue
        else:
            rec = run_mode(task_name, mode, data, s)
        rec = {**meta, **rec}
        losses[mode] = rec["first_loss"]
        _append(s.out, rec)
        records.append(rec)
        print(_summary(rec), flush=True)
        check_losses(task_name, losses)  # fail loudly, as soon as a mode disagrees
    if losses:
        print(check_losses(task_name, losses), flush=True)
    return records


def _summary(r: dict[str, Any]) -> str:
    extra = ""
    if "launches" in r:
        extra = (f", {r['launches']:.0f} launches ({r['launches_over_bound']:.2f}x bound), "
                 f"{r['gathers']:.0f} copies ({r['gathers_avoided']:.0f} avoided)")
    return (f"{r['task']:16s} {r['mode']:13s} train {r['train_per_s']:8.1f}/s  "
            f"eval {r['eval_per_s']:8.1f}/s  loss0 {r['first_loss']:.6g}{extra}")


def _append(path: str, rec: dict[str, Any]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("a") as f:
        f.write(json.dumps(rec) + "\n")
