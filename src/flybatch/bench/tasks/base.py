"""The Task interface: one benchmark model, runnable in every mode on the same parameters.

A task is constructed with ``(data: TaskData, device, seed)``. It owns named torch Parameters
(``self.params``), initialised deterministically from the seed, and implements ONE model of
the model spec (BENCHMARKS.md, "Models") three ways, all reading those same tensors:

``forward_eager(batch, train)``
    plain PyTorch, one instance at a time (what a user writes today);
``forward_flybatch(batch, train)``
    the same per-instance code written with flybatch ops and ``fb.nn`` modules; it runs inside
    a ``fb.Graph`` that :meth:`Task.step` opens with the mode's strategy;
``forward_manual(batch, train)``
    hand-batched PyTorch (padding + masks, packed sequences, level-by-level trees, lockstep).

Each returns, when ``train``: the minibatch loss (sum over instances) as a scalar
``torch.Tensor`` (eager, manual) or ``fb.Expression`` (flybatch), not yet backpropagated;
when not ``train``: the predictions (plain Python, values already computed: e.g. one list of
tag ids per sentence, one label per tree, heads per sentence), forward only.

:meth:`Task.step` runs one of the modes ``"eager" | "none" | "depth" | "agenda" | "auto" | "manual"``
on a minibatch: the forward, and the backward when ``train`` (gradients accumulate into
``p.grad``; the optimizer update is the runner's job), and times it. A task whose modes do not
fit this template (e.g. incremental forwards with its own timing) may override ``step``.

A task may offer flybatch modes of its own: its ``TASK_EXTRA_MODES`` maps each to the strategy
of the graph it runs on, ``forward_mode(mode, batch, train)`` computes it (returning what
``forward_flybatch`` returns) and ``step`` times it like the flybatch modes. Every such mode is
also listed in this module's ``EXTRA_MODES`` (the CLI's choices and the reports' column order);
the runner skips it for the tasks that do not offer it. E.g. the parser's ``parser-auto``
(per-sentence code under ``fb.map_batched``) and ``parser-seq`` (the same code, one sentence
after the other), and the Tree-LSTM's ``torch-native`` (its eager per-instance torch code, run
unchanged inside the graph: the capture layer records it).

Embedding tables are registered with ``sparse=True``: every mode must read them with sparse
gradients (``fb.lookup(E, i, sparse=True)``, ``F.embedding(..., sparse=True)``), because the
runner updates them with ``torch.optim.SparseAdam`` (only the rows used), as DyNet does.
"""

from __future__ import annotations

import math
import time
import zlib
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import numpy as np
import torch

import flybatch as fb
from flybatch.bench.tasks_data import TaskData

MODES = ("eager", "none", "depth", "agenda", "auto", "manual")  # every task implements these
FLYBATCH_MODES = ("none", "depth", "agenda", "auto")
# Modes that only some tasks implement (``Task.TASK_EXTRA_MODES``), in report order.
EXTRA_MODES = ("parser-auto", "parser-seq", "torch-native", "fb-unfused")


@dataclass
class StepResult:
    """What one :meth:`Task.step` did.

    ``loss``: the minibatch loss before the update (``nan`` for evaluation steps).
    ``stats``: the flybatch graph's ``fb.Stats`` (flybatch modes), else ``None``.
    ``seconds``: wall time per phase of this step: flybatch modes ``build``, ``schedule``,
    ``forward``, ``backward`` (from ``stats.seconds``); eager and manual ``forward`` and
    ``backward``. ``wall``: the whole step (excluding ``stats()`` collection).
    ``predictions``: what an evaluation step predicted (``None`` when training).
    """

    loss: float
    stats: fb.Stats | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    wall: float = 0.0
    predictions: Any = None


def _seeded_uniform(shape: Sequence[int], bound: float, seed: int, name: str) -> torch.Tensor:
    """Uniform(-bound, bound) from a generator seeded by (seed, name): order-independent."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return (torch.rand(tuple(shape), generator=gen, dtype=torch.float32) * 2 - 1) * bound


class Task:
    """Base class of the benchmark tasks; see the module docstring for the contract."""

    name: ClassVar[str] = ""
    # This task's own modes (a subset of EXTRA_MODES) -> the strategy of their flybatch graph.
    TASK_EXTRA_MODES: ClassVar[dict[str, str]] = {}

    @classmethod
    def modes(cls) -> tuple[str, ...]:
        """Every mode this task runs: MODES, then its own extra modes."""
        return MODES + tuple(cls.TASK_EXTRA_MODES)

    def __init__(self, data: TaskData, device: str | torch.device = "cpu", seed: int = 0):
        self.data = data
        self.device = torch.device(device)
        self.seed = seed
        self.params: dict[str, torch.nn.Parameter] = {}
        self._sparse: set[str] = set()

    # ---- parameters -------------------------------------------------------------------------
    def param(self, name: str, shape: Sequence[int], *, sparse: bool = False,
              bound: float | None = None) -> torch.nn.Parameter:
        """Register (and deterministically initialise) the Parameter ``name``.

        Default init: Glorot uniform for matrices, U(-0.1, 0.1) for vectors and embedding
        tables; ``bound`` overrides. ``sparse=True`` marks an embedding table.
        """
        if name in self.params:
            raise ValueError(f"parameter {name!r} registered twice")
        if bound is None:
            if sparse or len(shape) == 1:
                bound = 0.1
            else:
                bound = math.sqrt(6.0 / (shape[-2] + shape[-1]))
        p = torch.nn.Parameter(_seeded_uniform(shape, bound, self.seed, name).to(self.device))
        self.params[name] = p
        if sparse:
            self._sparse.add(name)
        return p

    def adopt(self, name: str, p: torch.nn.Parameter, *, sparse: bool = False,
              bound: float | None = None) -> torch.nn.Parameter:
        """Register an existing Parameter (e.g. of an ``fb.nn`` module) under ``name``,
        overwriting its values with this task's deterministic init (and moving it to device)."""
        fresh = self.param(name, tuple(p.shape), sparse=sparse, bound=bound)
        with torch.no_grad():
            p.data = fresh.data
        self.params[name] = p
        return p

    def lstm_cell(self, prefix: str, input_size: int, hidden: int) -> fb.nn.LSTMCell:
        """An ``fb.nn.LSTMCell`` whose tensors are this task's ``{prefix}.W_ih``,
        ``{prefix}.W_hh``, ``{prefix}.b`` (PyTorch layout and gate order, as the spec)."""
        cell = fb.nn.LSTMCell(input_size, hidden)
        self.adopt(f"{prefix}.W_ih", cell.weight_ih)
        self.adopt(f"{prefix}.W_hh", cell.weight_hh)
        self.adopt(f"{prefix}.b", cell.bias)
        return cell

    def torch_lstm(self, layers: Sequence[Sequence[fb.nn.LSTMCell]]) -> torch.nn.LSTM:
        """A ``torch.nn.LSTM`` reading the SAME tensors as the given ``fb.nn.LSTMCell``s.

        ``layers``: per layer ``(forward_cell,)`` or ``(forward_cell, backward_cell)``. The
        module's ``bias_hh`` are constant zeros (the spec has one bias), so it computes exactly
        the cells' function, with cuDNN / PyTorch's fused loops, for eager and manual modes.
        """
        bidirectional = len(layers[0]) == 2
        first = layers[0][0]
        lstm = torch.nn.LSTM(first.input_size, first.hidden_size, num_layers=len(layers),
                             bidirectional=bidirectional)
        for k, cells in enumerate(layers):
            for cell, suffix in zip(cells, ("", "_reverse")):
                zero = torch.nn.Parameter(torch.zeros_like(cell.bias), requires_grad=False)
                setattr(lstm, f"weight_ih_l{k}{suffix}", cell.weight_ih)
                setattr(lstm, f"weight_hh_l{k}{suffix}", cell.weight_hh)
                setattr(lstm, f"bias_ih_l{k}{suffix}", cell.bias)
                setattr(lstm, f"bias_hh_l{k}{suffix}", zero)
        return lstm.to(self.device)

    @property
    def sparse_params(self) -> list[torch.nn.Parameter]:
        """The embedding tables (updated sparsely: SparseAdam)."""
        return [p for n, p in self.params.items() if n in self._sparse]

    @property
    def dense_params(self) -> list[torch.nn.Parameter]:
        return [p for n, p in self.params.items() if n not in self._sparse]

    def export_spec(self) -> dict[str, np.ndarray]:
        """Every parameter under the spec's names and layouts (float32), for DyNet's --init.

        The default exports ``self.params`` as they are; a task whose tensors are fused
        differently from the spec (e.g. Tree-LSTM's W_iou = [W_i; W_o; W_u]) overrides this
        and :meth:`load_spec`.
        """
        return {n: p.detach().cpu().numpy().astype(np.float32) for n, p in self.params.items()}

    def load_spec(self, arrays: dict[str, np.ndarray]) -> None:
        """Set every parameter from spec-named arrays (the inverse of :meth:`export_spec`)."""
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(torch.as_tensor(np.asarray(arrays[n]), dtype=p.dtype))

    # ---- the model, three ways --------------------------------------------------------------
    def forward_eager(self, batch: list, train: bool) -> Any:
        raise NotImplementedError

    def forward_flybatch(self, batch: list, train: bool) -> Any:
        raise NotImplementedError

    def forward_manual(self, batch: list, train: bool) -> Any:
        raise NotImplementedError

    def forward_mode(self, mode: str, batch: list, train: bool) -> Any:
        """One of this task's ``TASK_EXTRA_MODES``, inside the graph ``step`` opened for it."""
        raise NotImplementedError

    # ---- one minibatch ----------------------------------------------------------------------
    def sync(self) -> None:
        """Wait for the device, so that wall-clock phases are honest on CUDA."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self, mode: str, batch: list, train: bool) -> StepResult:
        """Forward (+ backward when ``train``) of ``batch`` in ``mode``; no optimizer update."""
        extra = self.TASK_EXTRA_MODES.get(mode)
        if mode not in MODES and extra is None:
            raise ValueError(f"unknown mode {mode!r} for task {self.name!r}; expected one of "
                             f"{self.modes()}")
        grad = nullcontext() if train else torch.no_grad()
        t0 = time.perf_counter()
        if mode in FLYBATCH_MODES or extra is not None:
            with fb.Graph(strategy=extra or mode, device=self.device) as g, grad:
                out = self.forward_flybatch(batch, train) if extra is None else \
                    self.forward_mode(mode, batch, train)
                if train:
                    loss = out.item()
                    out.backward()
                    ts = time.perf_counter()
                    self.sync()  # the graph times backward() without waiting for the device
                    g.seconds["backward"] += time.perf_counter() - ts
                else:
                    loss = float("nan")
                wall = time.perf_counter() - t0
                stats = g.stats()
            return StepResult(loss, stats, dict(stats.seconds), wall,
                              None if train else out)
        forward = self.forward_eager if mode == "eager" else self.forward_manual
        with grad:
            out = forward(batch, train)
            if train:
                loss = out.item()  # synchronises
                t1 = time.perf_counter()
                out.backward()
                self.sync()
                t2 = time.perf_counter()
                seconds = {"forward": t1 - t0, "backward": t2 - t1}
                return StepResult(loss, None, seconds, t2 - t0)
            self.sync()
            t1 = time.perf_counter()
            return StepResult(float("nan"), None, {"forward": t1 - t0}, t1 - t0, out)
