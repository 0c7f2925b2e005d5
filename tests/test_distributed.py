"""flybatch.distributed: data-parallel training over torch.distributed (gloo, loopback only).

The multi-process tests start real ranks: this file run as a script (`python
tests/test_distributed.py <scenario> <outdir>`) with torchrun's environment variables (RANK,
WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT=<a free port>), so `fbd.init()` takes the same
path as under torchrun. A process costs seconds (importing torch), so one pair trains with all
three strategies, then passes mismatched parameter lists, then fails on purpose twice (a rank
raising inside a step, then one raising outside), while a second pair (a hanging rank) and a
third (leaving cleanly) run side by side.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch

import flybatch as fb
import flybatch.distributed as fbd

HERE = Path(__file__).resolve()
SRC = HERE.parent.parent / "src"
STRATEGIES = ("none", "depth", "agenda")
N_INSTANCES, BATCH, STEPS = 15, 7, 3  # global minibatches 7, 7, 1: shards 4/3, 4/3, 1/0
VOCAB, TAGS = 12, 4


# ---- the model and the training loop, shared by the ranks and the single-process reference ----
class Tagger(torch.nn.Module):
    """A BiLSTM tagger with a sparse word table, a dense position table and an unused layer."""

    def __init__(self):
        super().__init__()
        self.words = fb.nn.Embedding(VOCAB, 5, sparse=True)
        self.positions = fb.nn.Embedding(6, 5)
        self.lstm = fb.nn.LSTM(5, 4, bidirectional=True)
        self.out = fb.nn.MLP([8, 6, TAGS])
        self.unused = fb.nn.Linear(3, 3)  # no gradient anywhere: must stay None

    def loss(self, sentence):
        words, tags = sentence
        xs = [self.words(w) + self.positions(min(i, 5)) for i, w in enumerate(words)]
        return fb.esum([fb.pick_neg_log_softmax(self.out(h), t)
                        for h, t in zip(self.lstm(xs), tags)])


def make_data():
    g = torch.Generator().manual_seed(1234)
    data = []
    for _ in range(N_INSTANCES):
        n = int(torch.randint(1, 7, (1,), generator=g))
        data.append((torch.randint(0, VOCAB, (n,), generator=g).tolist(),
                     torch.randint(0, TAGS, (n,), generator=g).tolist()))
    return data


BUCKETS = {"none": 1, "depth": 600, "agenda": fbd.DEFAULT_BUCKET_BYTES}  # 1: one per tensor


def train(strategy, rank=None, world_size=None, fail_at=None):
    """STEPS steps; the loss is the sum over the shard divided by the GLOBAL minibatch size."""
    torch.manual_seed(0)
    model = Tagger().double()
    sgd = torch.optim.SGD([model.words.weight], lr=0.5)  # sparse gradients
    adam = torch.optim.Adam([p for n, p in model.named_parameters() if n != "words.weight"],
                            lr=0.05)
    batches = fbd.ShardedBatches(make_data(), BATCH, seed=7, rank=rank, world_size=world_size)
    batches.set_epoch(1)
    seen = []
    for shard in batches:
        sgd.zero_grad()
        adam.zero_grad()
        with fbd.step(model, bucket_bytes=BUCKETS[strategy]):
            if fail_at is not None:
                fail_at(shard.step)
            if shard.items:  # an empty shard still joins the step's collectives
                with fb.Graph(strategy=strategy, dtype=torch.float64):
                    losses = [model.loss(s) for s in shard.items]
                    (fb.esum(losses) / shard.global_size).backward()
        assert model.unused.weight.grad is None  # no rank used it: no gradient, as in one process
        assert shard.items or model.words.weight.grad.is_sparse  # an empty shard gets the sum
        sgd.step()
        adam.step()
        seen.append(shard.indices)
    assert len(seen) == STEPS
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, seen


# ---- in-process tests (no process group: a world of one) -------------------------------------
def test_sharded_batches_give_each_instance_to_exactly_one_rank_per_epoch():
    data = list(range(23))
    for world in (1, 2, 3, 5):
        for epoch in (0, 1):
            views = []
            for rank in range(world):
                batches = fbd.ShardedBatches(data, 4, seed=3, rank=rank, world_size=world)
                batches.set_epoch(epoch)
                views.append(list(batches))
            steps = {len(v) for v in views}
            assert steps == {6} and len(batches) == 6  # every rank runs the same steps
            seen = [i for v in views for shard in v for i in shard.items]
            assert sorted(seen) == data  # each instance once per epoch, over all ranks
            for step in range(6):
                shards = [v[step] for v in views]
                assert len({s.global_size for s in shards}) == 1
                assert sum(len(s.items) for s in shards) == shards[0].global_size
                assert max(len(s.items) for s in shards) - min(len(s.items) for s in shards) <= 1
    # deterministic from the seed, a new order per epoch, DistributedSampler's permutation
    b = fbd.ShardedBatches(data, 4, seed=3, rank=0, world_size=1)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, seed=3)
    for epoch in (0, 1):
        b.set_epoch(epoch)
        sampler.set_epoch(epoch)
        assert b.order() == list(sampler)
        again = fbd.ShardedBatches(data, 4, seed=3, rank=1, world_size=2)
        again.set_epoch(epoch)
        assert again.global_batches() == b.global_batches()  # the same on every rank
    b.set_epoch(0)
    first = b.order()
    b.set_epoch(1)
    assert b.order() != first and sorted(b.order()) == data
    assert fbd.ShardedBatches(data, 4, seed=4).order() != first
    assert fbd.ShardedBatches(data, 4, shuffle=False).order() == data
    dropped = fbd.ShardedBatches(data, 4, drop_last=True, rank=1, world_size=2)
    assert len(dropped) == 5 == len(list(dropped))
    assert all(s.global_size == 4 for s in dropped)


def test_shard_by_cost_balances_and_is_deterministic():
    batch = list(enumerate((9, 1, 1, 8, 2, 7, 3, 1)))  # (position, cost)
    shards = [fbd.shard(batch, r, 3, cost=lambda x: x[1]) for r in range(3)]
    assert sorted(x for s in shards for x in s) == batch
    assert [sum(c for _, c in s) for s in shards] == [11, 11, 10]
    assert shards == [fbd.shard(batch, r, 3, cost=lambda x: x[1]) for r in range(3)]
    assert all(s == sorted(s) for s in shards)  # minibatch order kept within a shard
    assert fbd.shard(list(range(7)), 1, 2) == [1, 3, 5]
    with pytest.raises(ValueError):
        fbd.shard([1, 2], 2, 2)


def test_without_a_process_group_everything_is_local():
    ctx = fbd.context()
    assert (ctx.rank, ctx.world_size, ctx.distributed) == (0, 1, False)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    with fbd.step([p]):
        pass
    assert p.grad.tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(ZeroDivisionError):  # no wrapping without peers
        with fbd.guard():
            1 / 0
    assert fbd.sum_scalars([1.5, 2]) == [1.5, 2.0]
    assert fbd.any_rank(True) and not fbd.any_rank(False)
    tp = fbd.gather_throughput(30, 3.0)
    assert tp.per_process == [10.0] and tp.total == 10.0


def test_init_reads_torchrun_variables(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    try:
        ctx = fbd.init(timeout=5, device="cpu")  # plain `python script.py`: a world of one
        assert (ctx.world_size, ctx.distributed, ctx.timeout.total_seconds()) == (1, False, 5)
        fbd.shutdown()
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(RuntimeError, match="MASTER_ADDR and MASTER_PORT not set"):
            fbd.init(device="cpu")
    finally:
        fbd.shutdown()


def test_gradient_buckets_respect_the_size_and_keep_dtypes_apart():
    ps = [torch.zeros(10), torch.zeros(10), torch.zeros(30), torch.zeros(5, dtype=torch.float64)]
    assert [len(b) for b in fbd._buckets(ps, 80)] == [2, 1, 1]
    assert [len(b) for b in fbd._buckets(ps, 1)] == [1, 1, 1, 1]
    assert [len(b) for b in fbd._buckets(ps, 10**6)] == [3, 1]


# ---- what one rank runs ----------------------------------------------------------------------
def named(**params: torch.nn.Parameter) -> torch.nn.Module:
    """A module whose parameters are `params`, named and ordered as given."""
    module = torch.nn.Module()
    for name, p in params.items():
        module.register_parameter(name, p)
    return module


def check_parameter_lists(rank: int) -> dict:
    """The ranks reduce different parameter lists: what `all_reduce_gradients` raised on this
    rank, and whether it left the gradients alone. Then one matching model, three steps: its
    summed gradients and how many all-gathers of the lists that took."""
    def zeros(*shape, dtype=torch.float32):
        return torch.nn.Parameter(torch.zeros(*shape, dtype=dtype))

    a, b, c = zeros(2), zeros(3), zeros(4)
    mismatches = {  # (rank 0's parameters, rank 1's parameters)
        "order": ([a, b], [b, a]),
        "names": (named(a=zeros(2), b=zeros(2)), named(b=zeros(2), a=zeros(2))),
        "dtype": ([zeros(2)], [zeros(2, dtype=torch.float64)]),
        "count": ([a, b], [a, b, c]),
    }
    def reduce(params) -> dict:
        tensors = list(params.parameters() if isinstance(params, torch.nn.Module) else params)
        for p in tensors:
            p.grad = torch.full_like(p, rank + 1.0)
        try:
            fbd.all_reduce_gradients(params)
            error = None
        except fbd.ParameterMismatchError as exc:
            error = str(exc)
        untouched = all(torch.equal(p.grad, torch.full_like(p, rank + 1.0)) for p in tensors)
        return {"error": error, "untouched": untouched}

    out = {case: reduce(lists[rank]) for case, lists in mismatches.items()}
    # The same module on both ranks, reduced once; then rank 1 alone resizes a parameter of it
    resized = named(a=zeros(2), b=zeros(3))
    reduce(resized)
    if rank == 1:
        resized.a.data = torch.zeros(4)
    out["resized"] = reduce(resized)
    gathers = []
    real = torch.distributed.all_gather_object
    torch.distributed.all_gather_object = lambda *a, **k: (gathers.append(1), real(*a, **k))[1]
    try:
        model = named(a=zeros(2), b=zeros(3))
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.full_like(p, rank + 1.0)
            with fbd.step(model):
                pass
    finally:
        torch.distributed.all_gather_object = real
    out["sums"] = [p.grad.tolist() for p in model.parameters()]
    out["checks"] = len(gathers)
    return out


def gloo_threads() -> list[str]:
    """The names of this process's threads that belong to gloo or its process group."""
    tasks = Path("/proc/self/task")
    names = [(t / "comm").read_text().strip() for t in tasks.iterdir()]
    return sorted(n for n in names if "gloo" in n)


def leave(rank: int, outdir: Path) -> None:
    """Import a torch module that binds `group.WORLD` into default arguments (as torch's
    optimizers do, lazily) after `init`, run a collective, leave; rank 1 also keeps a
    reference to the group of its own. Saves the gloo threads alive after `shutdown`."""
    import torch.distributed.nn.functional as dist_functional

    before = gloo_threads()
    fbd.sum_scalars([1.0])
    held = torch.distributed.group.WORLD if rank == 1 else None
    fbd.shutdown()
    defaults = dist_functional.all_reduce.__defaults__
    (outdir / f"leave{rank}.json").write_text(json.dumps({
        "before": before, "after": gloo_threads(),
        "defaults_hold_a_group": any(d is not None and "ProcessGroup" in type(d).__name__
                                     for d in defaults)}))
    del held


def worker(scenario: str, outdir: Path) -> None:
    """"train": the three strategies (results saved), the parameter-list checks (results saved),
    one more run in which rank 1's per-instance code raises at the second step (both ranks
    stop there and go on), then rank 1 raises outside any step while rank 0 starts another
    run. "hang": rank 1's per-instance code hangs. "leave": see `leave`."""
    ctx = fbd.init(timeout=60 if scenario == "train" else 3)  # reads torchrun's variables
    assert ctx.distributed and ctx.backend == "gloo" and ctx.world_size == 2

    def fail_at(step):
        if ctx.rank == 1 and step == 1:
            print(f"FAILING-AT {time.time()}", file=sys.stderr, flush=True)
            if scenario == "train":
                raise ValueError("boom in rank 1's instance")
            time.sleep(60)  # "hang": never reaches the step's collectives

    try:
        if scenario == "leave":
            leave(ctx.rank, outdir)
        elif scenario == "hang":
            train("agenda", fail_at=fail_at)
        else:
            result = {s: train(s) for s in STRATEGIES}
            result["throughput"] = fbd.gather_throughput(10 * (ctx.rank + 1), 2.0)
            result["scalars"] = fbd.sum_scalars([ctx.rank + 1, 0.5])
            result["any"] = [fbd.any_rank(ctx.rank == 1), fbd.any_rank(False)]
            torch.save(result, outdir / f"rank{ctx.rank}.pt")
            checks = check_parameter_lists(ctx.rank)
            (outdir / f"checks{ctx.rank}.json").write_text(json.dumps(checks))
            try:
                train("agenda", fail_at=fail_at)
            except fbd.RankFailedError:  # both ranks stop at this step; the group stays usable
                traceback.print_exc()
                print(f"STOPPED-AT {time.time()}", file=sys.stderr, flush=True)
            if ctx.rank == 1:
                print(f"LEAVING-AT {time.time()}", file=sys.stderr, flush=True)
                raise ValueError("boom outside the step")
            train("agenda")  # rank 0 waits for rank 1 in the first step's failure check
    except BaseException:
        print(f"EXITING-AT {time.time()}", file=sys.stderr, flush=True)
        raise
    finally:
        fbd.shutdown()


# ---- launching ranks -----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenario: str, outdir: Path, world_size: int = 2) -> list[subprocess.Popen]:
    """`world_size` processes running `worker(scenario)`, with torchrun's environment."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                   PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
        if any(name == "lo" for _, name in socket.if_nameindex()):
            env["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
        procs.append(subprocess.Popen([sys.executable, str(HERE), scenario, str(outdir)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    return procs


class Pair:
    """Two ranks of one scenario; `results()` waits for them (bounded) once."""

    def __init__(self, scenario: str, outdir: Path):
        self.outdir = outdir
        self.procs = launch(scenario, outdir)
        self._results: list[tuple[int | None, str]] | None = None

    def results(self, limit: float = 120) -> list[tuple[int | None, str]]:
        """(returncode, stderr) per rank; a rank still running after `limit` s is killed and
        reports None."""
        if self._results is None:
            deadline = time.monotonic() + limit
            self._results = []
            for p in self.procs:
                try:
                    _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
                    self._results.append((p.returncode, err))
                except subprocess.TimeoutExpired:
                    p.kill()
                    self._results.append((None, p.communicate()[1]))
        return self._results


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Both scenarios start at once: starting a process (importing torch) is most of the cost."""
    launched = {s: Pair(s, tmp_path_factory.mktemp(s)) for s in ("train", "hang", "leave")}
    yield launched
    for pair in launched.values():
        for p in pair.procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


def stamp(err: str, tag: str) -> float:
    return float(next(line for line in err.splitlines() if line.startswith(tag)).split()[1])


# ---- tests ----------------------------------------------------------------------------------
def test_two_ranks_equal_one_process_for_every_strategy(pairs):
    pair = pairs["train"]
    results = pair.results()
    files = [pair.outdir / f"rank{r}.pt" for r in range(2)]
    for rank, (code, err) in enumerate(results):
        assert files[rank].exists(), f"rank {rank} exited with {code}:\n{err[-3000:]}"
    ranks = [torch.load(f, weights_only=False) for f in files]
    for strategy in STRATEGIES:
        reference, batches = train(strategy, rank=0, world_size=1)  # one process, whole batch
        (p0, seen0), (p1, seen1) = ranks[0][strategy], ranks[1][strategy]
        for name, ref in reference.items():
            assert torch.equal(p0[name], p1[name]), f"{strategy}: ranks disagree on {name}"
            torch.testing.assert_close(p0[name], ref, rtol=1e-10, atol=1e-12,
                                       msg=lambda m: f"{strategy} {name}: {m}")
        # every instance of every global minibatch went to exactly one rank
        for full, a, b in zip(batches, seen0, seen1):
            assert sorted(a + b) == sorted(full) and not set(a) & set(b)
        assert seen1[-1] == []  # the last minibatch has one instance: rank 1's shard is empty
    # the training moved the parameters (the comparison is not vacuous)
    torch.manual_seed(0)
    start = Tagger().double().state_dict()
    for name in ("words.weight", "positions.weight", "lstm.forward_cells.0.weight_ih"):
        assert (start[name] - reference[name]).abs().max() > 1e-3, name
    torch.testing.assert_close(start["unused.weight"], reference["unused.weight"])
    for r in ranks:
        assert r["scalars"] == [3.0, 1.0] and r["any"] == [True, False]
    tp = ranks[0]["throughput"]
    assert tp.instances == [10, 20] and tp.per_process == [5.0, 10.0] and tp.total == 15.0


def test_a_raising_rank_stops_every_rank_at_once(pairs):
    # After training, rank 1's per-instance code raises: both ranks raise the same clear error
    # at that step, long before the 60 s collective timeout (and exit non-zero in the end).
    (code0, err0), (code1, err1) = pairs["train"].results()
    for rank, (code, err) in enumerate([(code0, err0), (code1, err1)]):
        assert code not in (0, None), f"rank {rank}: {code}\n{err[-3000:]}"
        assert "RankFailedError: rank 1 failed: ValueError: boom in rank 1's instance" in err, err
    assert stamp(err0, "STOPPED-AT") - stamp(err1, "FAILING-AT") < 10


def test_a_rank_raising_outside_the_step_stops_every_rank_at_once(pairs):
    # Last, rank 1 raises between steps, where no guard sees it, while rank 0 enters a step.
    # Rank 1's `finally: fbd.shutdown()` leaves at once (no barrier: rank 0 will never reach
    # it) and rank 0's pending failure check raises, naming rank 1's error: both ranks exit
    # within seconds, not after the 60 s collective timeout.
    (code0, err0), (code1, err1) = pairs["train"].results()
    assert code1 not in (0, None) and "ValueError: boom outside the step" in err1, err1
    assert code0 not in (0, None), err0
    assert "RankFailedError: rank 0: the failure check failed: rank 1 failed and left: " \
           "ValueError: boom outside the step" in err0, err0
    exited = max(stamp(err0, "EXITED-AT"), stamp(err1, "EXITED-AT"))
    assert exited - stamp(err1, "LEAVING-AT") < 20


def test_ranks_passing_different_parameters_all_raise_the_same_clear_error(pairs):
    # Swapped order, swapped names, another dtype, one parameter more, and a parameter resized
    # on one rank after the list was first reduced: every rank raises the same error naming
    # the difference, before any gradient moves (no mixed sums, no abort of
    # gloo, no wait for the timeout); the process group stays usable.
    pair = pairs["train"]
    files = [pair.outdir / f"checks{r}.json" for r in range(2)]
    for rank, (code, err) in enumerate(pair.results()):
        assert files[rank].exists(), f"rank {rank} exited with {code}:\n{err[-3000:]}"
    rank0, rank1 = [json.loads(f.read_text()) for f in files]
    assert rank0 == rank1
    differences = {
        "order": "rank 1: parameter 0 is (3,) float32 cpu, rank 0 has (2,) float32 cpu",
        "names": "rank 1: parameter 0 is 'b' (2,) float32 cpu, rank 0 has 'a' (2,) float32 cpu",
        "dtype": "rank 1: parameter 0 is (2,) float64 cpu, rank 0 has (2,) float32 cpu",
        "count": "rank 1: parameter 2 is (4,) float32 cpu, rank 0 has only 2 parameters",
        "resized": "rank 1: parameter 0 is 'a' (4,) float32 cpu, rank 0 has 'a' (2,) float32 "
                   "cpu",
    }
    for case, difference in differences.items():
        assert rank0[case]["untouched"], case
        assert rank0[case]["error"] == (
            f"the ranks reduce different parameters: {difference}; every rank must pass the "
            "same parameters in the same order"), case
    # a matching model's lists are never gathered (their fingerprints agree at every step);
    # its gradients are summed
    assert rank0["checks"] == 0 and rank0["sums"] == [[3.0, 3.0], [3.0, 3.0, 3.0]]


def test_a_hanging_rank_is_caught_by_the_collective_timeout(pairs):
    # Rank 1 hangs in its per-instance code: rank 0 gives up after the 3 s collective timeout
    # with a clear error (the backstop) instead of waiting forever.
    rank0, rank1 = pairs["hang"].procs
    _, err0 = rank0.communicate(timeout=60)
    rank1.kill()  # still asleep in its per-instance code (torchrun would kill it likewise)
    _, err1 = rank1.communicate()
    assert rank0.returncode != 0, err0
    assert "RankFailedError: rank 0: the failure check failed: a peer process died or did not " \
           "reach it within the timeout (3 s)" in err0, err0
    waited = stamp(err0, "EXITING-AT") - stamp(err1, "FAILING-AT")
    assert 2.5 < waited < 20, waited


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_shutdown_frees_the_group_and_its_threads_or_warns_who_holds_it(pairs):
    # A process group that outlives `shutdown` keeps gloo's worker threads running into the
    # interpreter's exit, where a worker still dropping a collective's tensors aborts the
    # process (one run in ~30 under load). torch modules imported after `init` that bind
    # group.WORLD as a default argument must not keep it alive (init imports them first);
    # a reference the user kept gets a warning that names it.
    pair = pairs["leave"]
    results = pair.results()
    for rank, (code, err) in enumerate(results):
        assert code == 0, f"rank {rank} exited with {code}:\n{err[-3000:]}"
    rank0, rank1 = (json.loads((pair.outdir / f"leave{r}.json").read_text()) for r in range(2))
    assert rank0["before"] and rank0["after"] == [], rank0
    assert not rank0["defaults_hold_a_group"] and not rank1["defaults_hold_a_group"]
    assert "shutdown: the process group is still referenced" not in results[0][1]
    assert "shutdown: the process group is still referenced" in results[1][1], results[1][1]
    assert rank1["after"], rank1  # the warning is true: its threads are still there


if __name__ == "__main__":
    code = 0
    try:
        worker(sys.argv[1], Path(sys.argv[2]))
    except BaseException:
        traceback.print_exc()
        code = 1
    print(f"EXITED-AT {time.time()}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the interpreter's teardown of torch: seconds on a loaded machine
