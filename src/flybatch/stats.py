"""What a graph did: nodes, kernel launches, batch sizes, copies, time, and the best possible.

`lower_bound` is the number of launches no schedule can beat (the bound ED-Batch uses): one
launch runs nodes of one signature, and nodes of the same signature on one dependency path must
run in different launches, so a signature needs at least as many launches as the most nodes of
it on any path. Value requests split a graph into forwards whose nodes cannot share launches,
so the bound is summed over the forwards that computed the nodes (pending nodes: one more).
Computed by the compiled core with the agenda's per-signature ranks (csrc/schedule.cpp), in time
and memory linear in nodes + edges whatever the number of signatures.

`tight_bound` is a bound no schedule can beat either, at least `lower_bound` and tighter where
signatures interleave differently on different paths: with tanh then sigmoid on one path and
sigmoid then tanh on another, each signature alone needs one launch, but together they need
three. Launches read in order form a word of signatures that holds every path's word as a
subsequence; disjoint blocks of two or three signatures each add what the word restricted to
the block must have beyond the signatures' own counts: a pair bound from counts along paths,
and a budgeted exact search of each block's fewest launches with the other signatures made free
(proofs in csrc/schedule.cpp, beside `tight_bound_of`). Only signatures of one strongly
connected component of the signature graph are tried, within a work budget per forward (at
most 2^24 visits, and 4096 per node and edge: milliseconds on small graphs, about 1 us per
node on 100k-node ones), so it is computed only when asked for. Where `launches ==
tight_bound` the schedule is optimal; `launches_over_tight` is the ratio that means something
when signatures interleave.

`splits` says, per signature, why it took more launches than its own bound: the nodes that
missed the first launch of their (signature, rank) group waited on inputs computed at or after
that launch; their signatures are counted (`print(stats)` shows them).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import TYPE_CHECKING, Callable

from . import _core, signatures

if TYPE_CHECKING:
    from .graph import Graph


@dataclass
class Stats:
    strategy: str
    nodes: int
    batches: int                       # kernel launches of non-leaf ops
    batch_sizes: Counter               # size -> launches
    by_signature: Counter              # readable signature -> launches
    gathers: int                       # input copies made (index_select / cat)
    gathers_avoided: int               # inputs read as a view (contiguous run or shared node)
    seconds: dict = field(default_factory=dict)  # build, schedule, forward, backward
    _bound: Callable[[], int] = field(default=lambda: 0, repr=False, compare=False)
    _tight: Callable[[], int] = field(default=lambda: 0, repr=False, compare=False)
    _splits: Callable[[], dict] = field(default=dict, repr=False, compare=False)
    deferred: int = 0                  # scheduled launches left uncomputed (nothing read them)

    @cached_property
    def lower_bound(self) -> int:
        """Launches no schedule can beat; computed on first use (it is a pass over the graph)."""
        return self._bound()

    @cached_property
    def tight_bound(self) -> int:
        """Launches no schedule can beat, counting interleaved signatures; computed on first use
        (passes over the graph per pair or triple of interleaving signatures, within a budget)."""
        return self._tight()

    @cached_property
    def splits(self) -> dict[str, tuple[int, Counter]]:
        """Readable signature -> (its bound, Counter: signature waited on -> inputs), for the
        nodes already run; computed on first use."""
        return self._splits()

    # The ratios are the schedule's: its launches, run or deferred (a deferred concat's nodes
    # are in the bound; skipping its launch says nothing of the schedule's quality).
    @property
    def launches_over_bound(self) -> float:
        return (self.batches + self.deferred) / self.lower_bound if self.lower_bound else 1.0

    @property
    def launches_over_tight(self) -> float:
        return (self.batches + self.deferred) / self.tight_bound if self.tight_bound else 1.0

    def __str__(self) -> str:
        lines = [
            f"strategy {self.strategy}: {self.nodes} nodes, {self.batches} launches "
            + (f"(+{self.deferred} deferred) " if self.deferred else "") +
            f"(lower bound {self.lower_bound}, ratio {self.launches_over_bound:.2f}; "
            f"tight bound {self.tight_bound}, ratio {self.launches_over_tight:.2f})",
            f"gathers {self.gathers} made, {self.gathers_avoided} avoided; time "
            + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.seconds.items()),
            f"{'launches':>9}  {'bound':>5}  signature",
        ]
        for sig, n in self.by_signature.most_common():
            bound, waited = self.splits.get(sig, (0, Counter()))
            why = ", ".join(f"{w} x{k}" for w, k in waited.most_common())
            lines.append(f"{n:9d}  {bound:5d}  {sig}" + (f"  (waited on {why})" if why else ""))
        return "\n".join(lines)


def collect(graph: "Graph") -> Stats:
    sizes = Counter(size for _, size in graph.launches)
    by_sig = Counter()  # each signature described once, not once per launch (~10 us each)
    for sig, launches in Counter(sig for sig, _ in graph.launches).items():
        by_sig[signatures.describe(sig, graph)] += launches
    return Stats(graph.strategy, graph.n_nodes, len(graph.launches), sizes, by_sig,
                 graph.gathers, graph.gathers_avoided, dict(graph.seconds),
                 partial(lower_bound, graph, graph.n_nodes),
                 partial(lower_bound, graph, graph.n_nodes, tight=True),
                 partial(splits, graph, graph.n_done), deferred=len(graph.deferred))


def lower_bound(graph: "Graph", n: int | None = None, tight: bool = False) -> int:
    """The lower bound (with `tight`, the tight bound) over the first `n` nodes (default: all),
    summed over forwards."""
    return _core.lower_bound(
        n=graph.n_nodes if n is None else n, graph=graph, forward_ends=graph.forward_ends,
        tight=tight)


def splits(graph: "Graph", n: int) -> dict[str, tuple[int, Counter]]:
    """Per signature of the first `n` (scheduled) nodes: its bound and what it waited on."""
    found = _core.signature_splits(n=n, graph=graph, forward_ends=graph.forward_ends)
    out: dict[str, tuple[int, Counter]] = {}
    for sig, (bound, waited) in found.items():
        name = signatures.describe(sig, graph)
        total, why = out.get(name, (0, Counter()))
        for w, k in waited.items():
            why[signatures.describe(w, graph)] += k
        out[name] = (total + bound, why)
    return out
