"""Data-parallel training across processes and machines, on PyTorch's own `torch.distributed`.

Every process (rank) takes its shard of every minibatch, builds and autobatches its own
per-instance graph, runs backward, and the gradients are SUMMED across ranks with
`torch.distributed` collectives (gloo on CPU, NCCL on CUDA) before the optimizer step::

    import flybatch as fb
    import flybatch.distributed as fbd

    ctx = fbd.init(timeout=120)                 # reads torchrun's RANK / WORLD_SIZE / MASTER_*
    try:
        batches = fbd.ShardedBatches(dataset, batch_size=32, seed=0)
        for epoch in range(epochs):
            batches.set_epoch(epoch)
            for shard in batches:               # this rank's instances of one global minibatch
                opt.zero_grad()
                with fbd.step(model.parameters()):      # failure check + gradient all-reduce
                    if shard.items:
                        with fb.Graph(strategy="agenda") as g:
                            losses = [model.loss(x) for x in shard.items]
                            (fb.esum(losses) / shard.global_size).backward()
                opt.step()
    finally:
        fbd.shutdown()

Conventions (one, tested): gradients are SUMMED across ranks, never averaged. Each rank's loss
is the sum of its shard's per-instance losses, optionally divided by the GLOBAL minibatch size
(`shard.global_size`, known on every rank). The summed gradient is then exactly the gradient a
single process computes for the same loss over the whole minibatch, whatever the shard sizes
(they differ by one when the world size does not divide the minibatch, and a shard may be
empty). `DistributedDataParallel`'s "average" convention is exact only for equal shards, and
DDP itself does not fit flybatch: its reducer expects `forward` to return tensors, whereas a
flybatch module call returns lazy expressions. Hence `all_reduce_gradients` instead, which
buckets dense gradients like DDP does and keeps sparse embedding gradients sparse.

Failures: a rank that raises inside `step()` / `guard()` still takes part in a tiny all-reduce
of per-rank failure flags, so EVERY rank raises `RankFailedError("rank 1 failed: ...")` at the
same step instead of waiting forever in the gradient all-reduce. A rank that raises outside
the guard leaves at once from its `finally: shutdown()`, with a note in the rendezvous store,
so the peers waiting for it raise `RankFailedError("... rank 1 failed and left: ...")` at once
rather than at the timeout. A rank that dies or hangs is caught by the backstop: every
collective is bounded by the process-group `timeout` given to `init`, and a collective error
is re-raised as a `RankFailedError` that says so. Ranks that reduce different parameter lists
(a model built differently on one rank) all raise `ParameterMismatchError` naming the
difference, found at every reduce by comparing fingerprints of the lists (one tiny
all-reduce). Without a process group (plain `python script.py`, or a world of one) every
function here is a cheap local no-op, so the same script runs single-process unchanged.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import heapq
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_BUCKET_BYTES", "DEFAULT_TIMEOUT", "Context", "ParameterMismatchError",
    "RankFailedError", "Shard",
    "ShardedBatches", "Throughput", "all_reduce_gradients", "any_rank", "context",
    "gather_throughput", "get_rank", "get_world_size", "guard", "init", "is_distributed",
    "shard", "shutdown", "step", "sum_scalars",
]

DEFAULT_TIMEOUT = datetime.timedelta(seconds=180)
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket size

_NONE, _SPARSE, _DENSE = 0, 1, 2  # gradient kinds, ordered so that MAX over ranks picks dense


class RankFailedError(RuntimeError):
    """Raised on EVERY rank when one rank failed (or a peer died or timed out)."""


class ParameterMismatchError(ValueError):
    """Raised on EVERY rank when the ranks reduce different parameter lists."""


@dataclass(frozen=True)
class Context:
    """What `init` set up: this process's place in the world and where its tensors go."""

    rank: int
    world_size: int
    local_rank: int
    backend: str | None       # None without a process group (a world of one)
    device: torch.device      # put the model here: cuda:<local_rank> under NCCL, else cpu
    timeout: datetime.timedelta
    owns_group: bool          # `shutdown` destroys the process group only if `init` made it

    @property
    def distributed(self) -> bool:
        return self.backend is not None and self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_ctx: Context | None = None


def _as_timedelta(timeout: float | datetime.timedelta) -> datetime.timedelta:
    if isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


# ---- set-up and tear-down ------------------------------------------------------------------
def init(backend: str | None = None, timeout: float | datetime.timedelta = DEFAULT_TIMEOUT, *,
         device: str | torch.device | None = None, init_method: str | None = None,
         rank: int | None = None, world_size: int | None = None) -> Context:
    """Join the process group that torchrun (or the caller) describes; return the `Context`.

    `rank` / `world_size` default to torchrun's `RANK` / `WORLD_SIZE` (and `LOCAL_RANK` picks
    the GPU); the rendezvous address comes from `MASTER_ADDR` / `MASTER_PORT` (torchrun sets
    them, also for `--rdzv-backend c10d`) or from `init_method` (e.g. "tcp://host:port").
    `backend` defaults to "nccl" when the device is CUDA, else "gloo"; `device` defaults to
    `cuda:<local_rank>` when CUDA is available and the backend is not gloo, else cpu.
    `timeout` (seconds or a timedelta) bounds EVERY collective: a rank waiting longer than this
    for its peers raises instead of hanging. It must exceed the longest step-time difference
    between ranks (the fastest rank waits for the slowest one in each all-reduce).

    With a world of one (no torchrun, or `--nproc-per-node 1`) no process group is created and
    every collective in this module is a local no-op. Calling `init` when a process group
    already exists reuses it (and `shutdown` then leaves it alone).
    """
    global _ctx
    timeout = _as_timedelta(timeout)
    if dist.is_available() and dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        backend = dist.get_backend()
        owns = _ctx is not None and _ctx.owns_group  # a second `init` keeps the ownership
    else:
        rank = _env_int("RANK", 0) if rank is None else int(rank)
        world_size = _env_int("WORLD_SIZE", 1) if world_size is None else int(world_size)
        owns = world_size > 1
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of size {world_size}")
    local_rank = _env_int("LOCAL_RANK", rank)
    if device is None:
        use_cuda = torch.cuda.is_available() and backend != "gloo"
        device = (torch.device("cuda", local_rank % torch.cuda.device_count()) if use_cuda
                  else torch.device("cpu"))
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if backend is None and world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
    if owns:
        if not dist.is_available():
            raise RuntimeError("torch.distributed is not available in this PyTorch build")
        if init_method is None:
            missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
            if missing:
                raise RuntimeError(f"flybatch.distributed.init: {' and '.join(missing)} not set; "
                                   "launch with torchrun or pass init_method='tcp://host:port'")
            init_method = "env://"
        _bind_torch_defaults_first()
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timeout)
    _ctx = Context(rank=rank, world_size=world_size, local_rank=local_rank,
                   backend=backend if world_size > 1 else None, device=device, timeout=timeout,
                   owns_group=owns)
    return _ctx


def _bind_torch_defaults_first() -> None:
    """Import, before the process group exists, torch's modules whose functions take
    `group=group.WORLD` as a default argument.

    A default argument is evaluated at import: imported after `init_process_group` (torch's
    own optimizers import them lazily), these functions would hold the group for the life of
    the process, `destroy_process_group` would not free it, and its gloo worker threads would
    outlive `shutdown`. A worker that drops a finished collective's tensors after the
    interpreter began to exit then aborts the process ("terminate called without an active
    exception", exit code -6, one run in ~30 on a loaded machine). Imported first, they bind None
    (= the default group at call time).
    """
    import torch.distributed.fsdp.sharded_grad_scaler  # noqa: F401
    import torch.distributed.nn.functional  # noqa: F401
    import torch.distributed.optim.zero_redundancy_optimizer  # noqa: F401


def _destroy_group() -> None:
    """`destroy_process_group`, and a warning if something else still holds the group.

    Freed here, the group joins its worker threads (with the GIL released, so they can drop
    the tensors of their last collectives). Held elsewhere, its threads live until the
    interpreter exits, where a worker still dropping tensors aborts the process; a short
    GIL-free wait lets such a worker finish first, and the warning names the cure.
    """
    group = dist.group.WORLD
    dist.destroy_process_group()
    if sys.getrefcount(group) > 2:  # `group` and getrefcount's argument
        warnings.warn("flybatch.distributed.shutdown: the process group is still referenced "
                      "(a variable or default argument holding dist.group.WORLD, made after "
                      "init); its gloo threads outlive shutdown and can abort the process at "
                      "exit. Drop the reference before shutdown()", RuntimeWarning, stacklevel=3)
        time.sleep(0.05)


_LEFT = "flybatch/left"  # rendezvous-store key: why failing ranks left, one line each


def shutdown() -> None:
    """Leave the process group (if `init` created it). Safe to call twice.

    On success the ranks leave together (a barrier). Called while an exception propagates
    (the `finally:` of a failing script, or an `except` block), this rank failed, and its
    peers may be waiting for it in a collective it will never join: it writes why to the
    rendezvous store and leaves at once. Closing its connections wakes the waiting peers, whose
    collective raises `RankFailedError("rank 0: ... failed: rank 1 failed and left: ...")`.
    """
    global _ctx
    ctx, _ctx = _ctx, None
    if ctx is None or not ctx.owns_group or not dist.is_initialized():
        return
    error = sys.exc_info()[1]
    if error is None or (isinstance(error, SystemExit) and error.code in (0, None)):
        # Leave together: a rank that tears its connections down while a peer still talks to
        # it makes gloo abort that peer. The barrier fails at once if a failing peer left
        # first (closed connections), or after the group's timeout if a peer hangs.
        try:
            dist.barrier()
        except RuntimeError:
            pass
    else:
        try:
            dist.distributed_c10d._get_default_store().append(
                _LEFT, f"rank {ctx.rank} failed and left: {_summary(error)}\n")
        except RuntimeError:  # the store lives in rank 0, which may have left already
            pass
    _destroy_group()


def context() -> Context:
    """The current `Context` (a world of one on cpu if `init` was not called)."""
    if _ctx is not None:
        return _ctx
    if dist.is_available() and dist.is_initialized():  # a group made by someone else
        return init()
    return Context(0, 1, 0, None, torch.device("cpu"), DEFAULT_TIMEOUT, False)


def is_distributed() -> bool:
    return context().distributed


def get_rank() -> int:
    return context().rank


def get_world_size() -> int:
    return context().world_size


def _comm_device() -> torch.device:
    """Where small control tensors live: NCCL only moves CUDA tensors, gloo prefers CPU."""
    ctx = context()
    return ctx.device if ctx.backend == "nccl" else torch.device("cpu")


def _summary(exc: BaseException) -> str:
    """"Type: first line of the message", on one line."""
    text = str(exc).strip()
    return type(exc).__name__ + (f": {text.splitlines()[0]}" if text else "")


def _left_notes() -> str:
    """Why failed peers left, as their `shutdown` wrote it; "" if none did (it died, or hangs)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        return "; ".join(store.get(_LEFT).decode().splitlines()) if store.check([_LEFT]) else ""
    except RuntimeError:  # the store lives in rank 0, which may be gone
        return ""


def _collective(what: str, fn: Callable[[], Any]) -> Any:
    """Run a collective; a peer that failed, died or timed out becomes a clear
    `RankFailedError`: the peer's own reason when it left one, else what gloo / NCCL said."""
    try:
        return fn()
    except RankFailedError:
        raise
    except RuntimeError as exc:  # gloo / NCCL errors (DistBackendError is a RuntimeError)
        ctx = context()
        why = _left_notes() or (
            f"a peer process died or did not reach it within the timeout "
            f"({ctx.timeout.total_seconds():g} s); see the other ranks' logs. "
            f"Cause: {_summary(exc)}")
        raise RankFailedError(f"rank {ctx.rank}: {what} failed: {why}") from exc


# ---- sharding --------------------------------------------------------------------------------
def shard(minibatch: Sequence[Any], rank: int | None = None, world_size: int | None = None,
          cost: Callable[[Any], float] | None = None) -> list:
    """This rank's instances of one (global) minibatch; deterministic, each instance once.

    Without `cost` the split is strided (`minibatch[rank::world_size]`): shard sizes differ by
    at most one. With `cost` (e.g. `len` of a sentence, nodes of a tree) instances go greedily
    to the least-loaded rank, largest first (LPT), so ranks finish a step at about the same
    time; ties break by position, so every rank computes the same split. Within a shard the
    minibatch order is kept.
    """
    rank = get_rank() if rank is None else int(rank)
    world_size = get_world_size() if world_size is None else int(world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of size {world_size}")
    items = list(minibatch)
    if cost is None:
        return items[rank::world_size]
    order = sorted(range(len(items)), key=lambda i: (-float(cost(items[i])), i))
    loads = [(0.0, r) for r in range(world_size)]  # a heap of (load, rank)
    mine = []
    for i in order:
        load, r = heapq.heappop(loads)
        if r == rank:
            mine.append(i)
        heapq.heappush(loads, (load + float(cost(items[i])), r))
    return [items[i] for i in sorted(mine)]


class Shard(NamedTuple):
    """This rank's part of one global minibatch."""

    items: list          # the instances (may be empty at the end of an epoch)
    indices: list[int]   # their positions in the dataset
    global_size: int     # instances in the whole minibatch, over all ranks
    step: int            # the minibatch's number within the epoch


class ShardedBatches:
    """Global minibatches of a dataset, each split over the ranks; every rank iterates in step.

    Per epoch the dataset order is the permutation `torch.utils.data.DistributedSampler` uses
    (`torch.randperm(n)` from a generator seeded with `seed + epoch`; the identity without
    `shuffle`), identical on every rank. It is cut into global minibatches of `batch_size`, and
    each minibatch is split with `shard`. Unlike a per-rank `DistributedSampler`, which pads
    (repeats instances) or drops the tail so every rank gets as many, this gives every instance
    to EXACTLY one rank per epoch, and every rank runs the same number of steps (a rank whose
    shard is empty still joins the gradient all-reduce with no gradient). `drop_last=True` drops
    the final incomplete global minibatch, as `DataLoader` does.

    Iterating yields `Shard`s. A single process with `world_size=1` sees the same global
    minibatches in the same order: that is the reference the distributed run equals.
    """

    def __init__(self, dataset: Sequence[Any], batch_size: int, *, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False, rank: int | None = None,
                 world_size: int | None = None, cost: Callable[[Any], float] | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.dataset, self.batch_size = dataset, int(batch_size)
        self.seed, self.shuffle, self.drop_last = int(seed), shuffle, drop_last
        self._rank, self._world_size, self.cost = rank, world_size, cost
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (its permutation), as `DistributedSampler.set_epoch` does."""
        self.epoch = int(epoch)

    @property
    def rank(self) -> int:
        return get_rank() if self._rank is None else self._rank

    @property
    def world_size(self) -> int:
        return get_world_size() if self._world_size is None else self._world_size

    def order(self) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def global_batches(self) -> list[list[int]]:
        """The dataset indices of every global minibatch of the current epoch."""
        order, b = self.order(), self.batch_size
        batches = [order[i:i + b] for i in range(0, len(order), b)]
        if self.drop_last and batches and len(batches[-1]) < b:
            batches.pop()
        return batches

    def __len__(self) -> int:
        n, b = len(self.dataset), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def __iter__(self) -> Iterator[Shard]:
        rank, world = self.rank, self.world_size
        cost = None if self.cost is None else (lambda i: self.cost(self.dataset[i]))
        for number, batch in enumerate(self.global_batches()):
            mine = shard(batch, rank, world, cost)
            yield Shard([self.dataset[i] for i in mine], mine, len(batch), number)


# ---- failure agreement -------------------------------------------------------------------------
def _agree(failure: str | None) -> RankFailedError | None:
    """Every rank says whether it failed; all learn who did and why (two tiny collectives)."""
    ctx = context()
    flags = torch.zeros(ctx.world_size, dtype=torch.int64, device=_comm_device())
    if failure is not None:
        flags[ctx.rank] = 1
    _collective("the failure check", lambda: dist.all_reduce(flags))
    failed = [r for r, f in enumerate(flags.tolist()) if f]
    if not failed:
        return None
    messages: list[Any] = [None] * ctx.world_size
    _collective("the failure report", lambda: dist.all_gather_object(messages, failure))
    text = "; ".join(f"rank {r} failed: {messages[r]}" for r in failed)
    return RankFailedError(f"{text} (every rank stops at this step)")


@contextlib.contextmanager
def guard() -> Iterator[None]:
    """Run one step's per-instance code; if ANY rank raises in it, every rank raises.

    On leaving the block every rank joins one small all-reduce of "failed" flags (the failing
    rank too, from its `except`), so the others learn of the failure here rather than waiting
    for it in the gradient all-reduce; all raise `RankFailedError("rank R failed: Type: msg")`
    (chained to the original exception on rank R). Every rank must enter the guard once per
    step, also with an empty shard. Without a process group it only runs the block.
    """
    if not is_distributed():
        yield
        return
    try:
        yield
    except Exception as exc:  # KeyboardInterrupt & co. end the process; the timeout catches that
        error = _agree(f"{type(exc).__name__}: {exc}")
        raise error from exc
    error = _agree(None)
    if error is not None:
        raise error


# ---- gradients -----------------------------------------------------------------------------
def _params(params: Iterable[torch.Tensor] | torch.nn.Module
            ) -> list[tuple[str | None, torch.Tensor]]:
    """(name, parameter) of each trainable parameter, once; names only a Module knows."""
    pairs = (params.named_parameters() if isinstance(params, torch.nn.Module)
             else ((None, p) for p in params))
    seen, out = set(), []
    for name, p in pairs:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def _describe(p: torch.Tensor) -> str:
    """What must agree across ranks for the gradient sums to line up: "(2, 3) float32 cpu"."""
    layout = "" if p.layout == torch.strided else " " + str(p.layout).removeprefix("torch.")
    return (f"{tuple(p.shape)} {str(p.dtype).removeprefix('torch.')} "
            f"{p.device.type}{layout}")


def _show(entry: tuple[str | None, str]) -> str:
    name, description = entry
    return description if name is None else f"{name!r} {description}"


def _difference(rank: int, theirs: list, ours: list) -> str | None:
    """How rank `rank`'s parameter list differs from rank 0's, or None. Names count only where
    both ranks know them (both passed a Module)."""
    for i, (t, o) in enumerate(zip(theirs, ours)):
        if t[1] != o[1] or (t[0] != o[0] and None not in (t[0], o[0])):
            return f"rank {rank}: parameter {i} is {_show(t)}, rank 0 has {_show(o)}"
    n = min(len(theirs), len(ours))
    if len(theirs) > n:
        return f"rank {rank}: parameter {n} is {_show(theirs[n])}, rank 0 has only {n} parameters"
    if len(ours) > n:
        return f"rank {rank} has only {n} parameters, rank 0's parameter {n} is {_show(ours[n])}"
    return None


def _fingerprint(named: list[tuple[str | None, torch.Tensor]]) -> int:
    """A 62-bit digest of what the ranks must agree on (names, shapes, dtypes, devices,
    layouts), the same in every process (unlike Python's salted `hash`)."""
    facts = repr([(name, tuple(p.shape), p.dtype, p.device.type, p.layout) for name, p in named])
    return int.from_bytes(hashlib.blake2b(facts.encode(), digest_size=8).digest(), "little") >> 2


def _check_same_parameters(named: list[tuple[str | None, torch.Tensor]]) -> None:
    """Raise `ParameterMismatchError` on every rank unless all ranks pass the same list: count,
    names (where known), shapes, dtypes, device types and layouts. A mismatch would otherwise
    sum unrelated gradients, abort gloo (sizes differ) or wait for the timeout (counts differ).

    Checked at every reduce, so that a parameter resized or cast in place on one rank after the
    first step is caught too, and by all ranks together (a rank that alone decided to check
    would wait in a collective its peers never join): one all-reduce of two ints, the largest
    and the negated smallest fingerprint; only where they differ are the lists all-gathered
    and compared (names count only where both ranks know them, so a rank that passes a Module
    where another passes its parameters is gathered each time, and goes on)."""
    mine = _fingerprint(named)
    bounds = torch.tensor([mine, -mine], dtype=torch.int64, device=_comm_device())
    _collective("the parameter check",
                lambda: dist.all_reduce(bounds, op=dist.ReduceOp.MAX))
    highest, negated_lowest = bounds.tolist()
    if highest == -negated_lowest:
        return
    described = [(name, _describe(p)) for name, p in named]
    everyone: list[Any] = [None] * context().world_size
    _collective("the parameter check", lambda: dist.all_gather_object(everyone, described))
    problems = [d for r in range(1, len(everyone))
                if (d := _difference(r, everyone[r], everyone[0])) is not None]
    if problems:
        more = f"; and {len(problems) - 3} more ranks" if len(problems) > 3 else ""
        raise ParameterMismatchError(
            f"the ranks reduce different parameters: {'; '.join(problems[:3])}{more}; every "
            "rank must pass the same parameters in the same order")


def _kind(p: torch.Tensor) -> int:
    if p.grad is None:
        return _NONE
    return _SPARSE if p.grad.is_sparse else _DENSE


def all_reduce_gradients(params: Iterable[torch.Tensor] | torch.nn.Module, *,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """SUM every parameter's `.grad` over all ranks, in place; call after backward, before step.

    Every rank must pass the same parameters in the same order (`model.parameters()`; pass the
    Module itself to have the names checked too).
    0. The ranks compare fingerprints of their lists (count, names, shapes, dtypes, device
       types: one all-reduce of two ints); where they differ, the lists are all-gathered and
       any difference raises `ParameterMismatchError` on every rank, before a gradient moves.
    1. One all-reduce (MAX) of each parameter's gradient kind (none / sparse / dense) so that
       all ranks agree even when a rank has no gradient for a parameter (an empty shard, an
       embedding row set it never touched): such a rank contributes zero. A parameter with
       no gradient on any rank keeps `.grad = None`, as in one process.
    2. Dense gradients are flattened into buckets of at most `bucket_bytes` (per device and
       dtype) and each bucket is all-reduced with `torch.distributed.all_reduce` (launched
       asynchronously, then awaited), then copied back.
    3. Sparse gradients (`fb.lookup(..., sparse=True)`, `fb.nn.Embedding(sparse=True)`) are
       NOT densified: each rank's coalesced (indices, values) are all-gathered (padded to the
       largest row count) and summed by `coalesce`. The result is the same sparse gradient one
       process computes over the whole minibatch, so sparse-only optimizers (`SparseAdam`) and
       lazy ones keep working, and traffic is proportional to the rows used, not to the vocab
       (a densified 100k x 300 fp32 table would be 120 MB per step per rank). A parameter
       that is sparse on one rank and dense on another (mixed lookups) is treated as dense.
    Every collective is bounded by the process-group timeout; errors become `RankFailedError`.
    """
    if not is_distributed():
        return
    named = _params(params)
    _check_same_parameters(named)  # also when the list is empty: a peer's may not be
    params = [p for _, p in named]
    if not params:
        return
    kinds = torch.tensor([_kind(p) for p in params], dtype=torch.int64, device=_comm_device())
    _collective("the gradient-kind all-reduce",
                lambda: dist.all_reduce(kinds, op=dist.ReduceOp.MAX))
    kinds = kinds.tolist()
    dense = [p for p, k in zip(params, kinds) if k == _DENSE]
    sparse = [p for p, k in zip(params, kinds) if k == _SPARSE]
    _all_reduce_dense(dense, bucket_bytes)
    _all_gather_sparse(sparse)


def _buckets(params: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive parameters of one device and dtype, up to `bucket_bytes` each (at least one)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault((p.device, p.dtype), []).append(p)
    out = []
    for group in groups.values():
        bucket, size = [], 0
        for p in group:
            nbytes = p.numel() * p.element_size()
            if bucket and size + nbytes > bucket_bytes:
                out.append(bucket)
                bucket, size = [], 0
            bucket.append(p)
            size += nbytes
        if bucket:
            out.append(bucket)
    return out


def _dense_grad(p: torch.Tensor) -> torch.Tensor:
    if p.grad is None:
        return torch.zeros_like(p)
    return p.grad.to_dense() if p.grad.is_sparse else p.grad


def _all_reduce_dense(params: list[torch.Tensor], bucket_bytes: int) -> None:
    pending = []
    for bucket in _buckets(params, bucket_bytes):
        flat = torch.cat([_dense_grad(p).reshape(-1) for p in bucket])
        work = _collective("the gradient all-reduce",
                           lambda flat=flat: dist.all_reduce(flat, async_op=True))
        pending.append((bucket, flat, work))
    for bucket, flat, work in pending:
        _collective("the gradient all-reduce", work.wait)
        offset = 0
        for p in bucket:
            n = p.numel()
            summed = flat[offset:offset + n].view_as(p)
            offset += n
            if p.grad is not None and not p.grad.is_sparse:
                p.grad.copy_(summed)
            else:
                p.grad = summed.clone()


def _all_gather_sparse(params: list[torch.Tensor]) -> None:
    if not params:
        return
    ctx = context()
    device = _comm_device()
    grads = []
    for p in params:
        if p.grad is None:  # another rank has rows for it; this one contributes none
            grads.append(torch.sparse_coo_tensor(
                torch.zeros(1, 0, dtype=torch.int64, device=p.device),
                torch.zeros(0, *p.shape[1:], dtype=p.dtype, device=p.device), p.shape,
                check_invariants=False))
        else:
            grads.append(p.grad.coalesce())
    counts = torch.tensor([g._nnz() for g in grads], dtype=torch.int64, device=device)
    all_counts = [torch.empty_like(counts) for _ in range(ctx.world_size)]
    _collective("the sparse-gradient size exchange", lambda: dist.all_gather(all_counts, counts))
    all_counts = torch.stack(all_counts).tolist()  # [rank][param]
    for j, (p, g) in enumerate(zip(params, grads)):
        sizes = [all_counts[r][j] for r in range(ctx.world_size)]
        width = max(sizes)
        indices, values = g._indices(), g._values()
        if width == 0:
            p.grad = torch.sparse_coo_tensor(indices, values, p.shape,
                                             check_invariants=False).coalesce()
            continue
        pad = width - indices.shape[1]
        indices = torch.nn.functional.pad(indices.to(device), (0, pad))
        values = torch.cat([values.to(device),
                            values.new_zeros((pad, *values.shape[1:]), device=device)])
        got_i = [torch.empty_like(indices) for _ in range(ctx.world_size)]
        got_v = [torch.empty_like(values) for _ in range(ctx.world_size)]
        _collective("the sparse-gradient all-gather", lambda: dist.all_gather(got_i, indices))
        _collective("the sparse-gradient all-gather", lambda: dist.all_gather(got_v, values))
        summed = torch.sparse_coo_tensor(
            torch.cat([i[:, :n] for i, n in zip(got_i, sizes)], 1),
            torch.cat([v[:n] for v, n in zip(got_v, sizes)]), p.shape,
            check_invariants=False).coalesce()  # rows of valid gradients of this shape
        p.grad = summed.to(p.device)


@contextlib.contextmanager
def step(params: Iterable[torch.Tensor] | torch.nn.Module, *,
         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[None]:
    """`guard()` around the block, then `all_reduce_gradients(params)`: one training step's
    synchronisation. Put the graph building and `backward()` inside, `opt.step()` after."""
    with guard():
        yield
    all_reduce_gradients(params, bucket_bytes=bucket_bytes)


# ---- reporting -------------------------------------------------------------------------------
def sum_scalars(values: Sequence[float]) -> list[float]:
    """Sum a few Python numbers over all ranks (float64; e.g. losses or instance counts)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_comm_device())
    if is_distributed():
        _collective("the scalar all-reduce", lambda: dist.all_reduce(t))
    return t.tolist()


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is true on at least one: a collective decision, e.g. to
    stop a time-bounded loop (ranks that stopped on their own clocks would run different
    numbers of steps and wait for each other in the all-reduce until the timeout)."""
    return sum_scalars([1.0 if flag else 0.0])[0] > 0


@dataclass(frozen=True)
class Throughput:
    """Instances per second of each rank and of the whole job."""

    instances: list[int]    # per rank
    seconds: list[float]    # per rank (that rank's own timed span)

    @property
    def per_process(self) -> list[float]:
        return [n / s if s > 0 else 0.0 for n, s in zip(self.instances, self.seconds)]

    @property
    def total(self) -> float:
        """All instances over the slowest rank's time (ranks run in lockstep)."""
        slowest = max(self.seconds)
        return sum(self.instances) / slowest if slowest > 0 else 0.0


def gather_throughput(instances: int, seconds: float) -> Throughput:
    """Collect every rank's (instances processed, seconds taken); every rank gets the result."""
    ctx = context()
    mine = torch.tensor([float(instances), float(seconds)], dtype=torch.float64,
                        device=_comm_device())
    if not ctx.distributed:
        return Throughput([int(instances)], [float(seconds)])
    everyone = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    _collective("the throughput all-gather", lambda: dist.all_gather(everyone, mine))
    rows = [t.tolist() for t in everyone]
    return Throughput([int(n) for n, _ in rows], [s for _, s in rows])
