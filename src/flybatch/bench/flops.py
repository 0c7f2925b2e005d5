"""Achieved GFLOP/s next to the machine's GEMM peak: how far each mode is from the ceiling.

Model FLOPs are those of the model's matrix products, counted exactly where flybatch runs them
(:data:`flybatch.kernels.flops`: 2k per dot product of length k; a product autograd records
counts again once per operand gradient, since backward runs dX = dY W and dW = dY^T X, two
products of the forward's size; elementwise work is not counted). A flybatch mode's training
steps count their own. The eager, manual and DyNet modes run kernels flybatch does not see:
they are given the FLOPs flybatch counts on the same minibatches (same model, same data; a
minibatch is named by its position in the task's sequence, ``tasks_data.minibatches``, which
every mode and the DyNet peer draw alike), from the flybatch modes of the run or, for a
minibatch none of them timed, from an untimed flybatch forward (agenda) of it.

Achieved GFLOP/s = median FLOPs per timed minibatch / median seconds per minibatch (the
medians instances/s uses). The peak: the machine's fastest product on 1024^3 and on the tasks'
typical products: ``F.linear`` (MKL here, cuBLAS on CUDA) and, on a CPU with oneDNN, the
oneDNN product the kernels may take (flybatch/kernels.py), the best of a few repetitions per
shape and path, the best of all, measured once per process with the thread count the bench
set (the oneDNN path whatever the GEMM mode: the ceiling is the machine's, not a mode's).
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

import flybatch as fb
from flybatch import kernels
from flybatch.bench.tasks import create
from flybatch.bench.tasks_data import TaskData, minibatches

# (m, k, n) of x [m, k] @ W.T [k, n]: a square reference and the tasks' products at batch 64.
PEAK_SHAPES = (
    (1024, 1024, 1024),
    (1200, 256, 768),   # treelstm: the leaves' W_iou
    (300, 512, 768),    # treelstm: a level of internal nodes' U_iou
    (1500, 256, 1024),  # taggers: the input projections of all tokens
    (64, 256, 1024),    # taggers: one recurrent step's W_hh over 64 sentences
)
PEAK_REPEATS = 10


@dataclass(frozen=True)
class GemmPeak:
    """The best product GFLOP/s over :data:`PEAK_SHAPES` and the GEMM paths on one device and
    thread count; `by_shape`: each shape's best, `path`: the path of the best."""

    gflop_per_s: float
    shape: tuple[int, int, int]
    path: str
    by_shape: dict[str, float]
    threads: int
    device: str

    def __str__(self) -> str:
        shapes = ", ".join(f"{s} {v:.0f}" for s, v in self.by_shape.items())
        return (f"GEMM peak {self.gflop_per_s:.1f} GFLOP/s ({self.path}, best of "
                f"{PEAK_REPEATS}, {self.threads} thread(s), {self.device}; m x k x n: {shapes})")

    def record(self) -> dict[str, Any]:
        return {"gemm_peak_gflop_per_s": self.gflop_per_s, "gemm_peak_shape": list(self.shape),
                "gemm_peak_path": self.path, "gemm_peak_by_shape": self.by_shape}


@functools.cache
def _peak(device: str, threads: int) -> GemmPeak:
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    paths: dict[str, Callable] = {"F.linear": F.linear}
    if dev.type == "cpu" and torch.backends.mkldnn.is_available():
        paths["oneDNN"] = lambda x, w: kernels._onednn(x, w, None)
    by_shape, best_path = {}, {}
    with torch.no_grad():
        for m, k, n in PEAK_SHAPES:
            x = torch.randn(m, k, generator=gen).to(dev)
            w = torch.randn(n, k, generator=gen).to(dev)
            for path, run in paths.items():
                run(x, w)  # warm-up (oneDNN: its primitive)
                best = float("inf")
                for _ in range(PEAK_REPEATS):
                    sync()
                    start = time.perf_counter()
                    run(x, w)
                    sync()
                    best = min(best, time.perf_counter() - start)
                name = f"{m}x{k}x{n}"
                if 2 * m * k * n / best / 1e9 > by_shape.get(name, 0.0):
                    by_shape[name], best_path[name] = 2 * m * k * n / best / 1e9, path
    name = max(by_shape, key=by_shape.get)
    return GemmPeak(by_shape[name], tuple(int(d) for d in name.split("x")), best_path[name],
                    by_shape, threads, device)


def gemm_peak(device: str | torch.device = "cpu") -> GemmPeak:
    """The machine's measured GEMM peak with the current thread count (once per process)."""
    return _peak(str(device), torch.get_num_threads())


class MinibatchFlops:
    """Model FLOPs of one task's training minibatches, by position in its minibatch sequence:
    recorded by the flybatch modes' own steps, counted on demand for the others."""

    def __init__(self, task_name: str, data: TaskData, batch_size: int, seed: int, warmup: int,
                 device: str | torch.device = "cpu",
                 shard: Callable[[list], list] = lambda batch: batch):
        self.task_name, self.data, self.device, self.shard = task_name, data, device, shard
        self.seed, self.first_timed = seed, 1 + warmup  # the correctness probe, then warm-up
        self.known: dict[int, int] = {}
        self.recorded_by: set[str] = set()
        self._source = minibatches(data.train, batch_size, seed)
        self._batches: list[list] = []
        self._task = None

    def __repr__(self) -> str:
        return (f"MinibatchFlops({self.task_name!r}, {len(self.known)} minibatches known, "
                f"recorded by {sorted(self.recorded_by)})")

    def record(self, mode: str, index: int, flops: int) -> None:
        """A flybatch step of `mode` counted `flops` on minibatch `index`."""
        self.known[index] = flops
        self.recorded_by.add(mode)

    def of(self, index: int) -> int:
        if index not in self.known:
            self.known[index] = self._count(self.shard(self._batch(index)))
        return self.known[index]

    def result(self, rec: dict[str, Any], peak: GemmPeak) -> dict[str, Any]:
        """A mode's achieved GFLOP/s and % of `peak`, from its record's timed minibatches."""
        timed, seconds = rec.get("timed_minibatches"), rec.get("seconds_per_minibatch")
        if not timed or not seconds:
            return {}
        flops = statistics.median(self.of(i) for i in range(self.first_timed,
                                                            self.first_timed + timed))
        gflop_per_s = flops / seconds / 1e9
        return {"flops_per_minibatch": flops, "gflop_per_s": gflop_per_s,
                "percent_of_peak": 100 * gflop_per_s / peak.gflop_per_s,
                "flops_counted_by": "own steps" if rec["mode"] in self.recorded_by
                else "flybatch, same minibatches"}

    def _batch(self, index: int) -> list:
        while len(self._batches) <= index:
            self._batches.append(next(self._source))
        return self._batches[index]

    def _count(self, batch: list) -> int:
        """The FLOPs of a training step on `batch`: its flybatch forward (agenda) with grad
        recording on, which counts the backward's products too; nothing is backpropagated."""
        if not batch:  # a rank's empty shard
            return 0
        if self._task is None:
            self._task = create(self.task_name, self.data, self.device, self.seed)
        kernels.flops.reset()
        with fb.Graph(strategy="agenda", device=self._task.device):
            self._task.forward_flybatch(batch, True).value()
        return kernels.flops.total
