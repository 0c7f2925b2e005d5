"""The fewest launches of any schedule of a small graph, by A* search (for tests and studies of
the schedulers and bounds on graphs of up to a few hundred nodes and small state spaces).

A schedule is a sequence of launches, each running ready nodes of one signature. A launch of
signature s may as well take EVERY ready node of s: more computed nodes never delay a later
launch (any schedule taking a subset can be turned into one taking all, launch for launch). So
a state is the set of computed nodes, and it has one move per signature with ready nodes.

Search: A* over states (bit sets), with the lower bound of the remaining nodes as heuristic
(for each signature, the most of its remaining nodes on one path: admissible, since the
remaining nodes are a graph of their own and no schedule beats its bound). One more rule cuts
the branching without losing the optimum: if every remaining node of a signature is ready, a
launch of it now is in some optimal schedule (an optimal schedule runs them in one or more
later launches; running them all now instead only makes inputs available earlier), so that
move alone is expanded.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass
class Problem:
    """A DAG in topological order: per node its signature, its inputs (earlier nodes of the
    problem) and whether it is a leaf (computed from the start, no launch)."""

    sigs: list[int]
    inputs: list[list[int]]
    leaf: list[bool]


def problem_of_graph(graph, start: int = 0, end: int | None = None) -> Problem:
    """Nodes start..end-1 of an fb.Graph (one forward); inputs before `start` count as done."""
    end = graph.n_nodes if end is None else end
    sigs, inputs, leaf = [], [], []
    for v in range(start, end):
        sigs.append(int(graph.sig_of(v)))
        inputs.append([int(u) - start for u in graph.args_of(v) if start <= int(u) < end])
        leaf.append(bool(graph.op_of(v).leaf))
    return Problem(sigs, inputs, leaf)


def problem_of_lists(sigs: list[int], arg_end: list[int], arg_flat: list[int],
                     leaf: list[bool]) -> Problem:
    ends = [0] + list(arg_end)
    return Problem(list(sigs), [list(arg_flat[ends[v]:ends[v + 1]]) for v in range(len(sigs))],
                   list(leaf))


class _Search:
    def __init__(self, p: Problem):
        n = len(p.sigs)
        self.n = n
        sig_ids = {s: i for i, s in enumerate(sorted(set(p.sigs)))}
        self.sig = [sig_ids[s] for s in p.sigs]
        self.n_sigs = len(sig_ids)
        self.inputs = [sorted(set(i)) for i in p.inputs]
        self.need = [sum(1 << u for u in ins) for ins in self.inputs]
        self.consumers: list[list[int]] = [[] for _ in range(n)]
        for v, ins in enumerate(self.inputs):
            for u in ins:
                self.consumers[u].append(v)
        self.kernel = [not leaf for leaf in p.leaf]
        self.of_sig = [0] * self.n_sigs
        for v in range(n):
            if self.kernel[v]:
                self.of_sig[self.sig[v]] |= 1 << v
        self.all = (1 << n) - 1
        self.start = sum(1 << v for v in range(n) if not self.kernel[v])

    def ready(self, done: int) -> int:
        bits = 0
        for v in range(self.n):
            if not done >> v & 1 and self.need[v] & done == self.need[v]:
                bits |= 1 << v
        return bits

    def heuristic(self, done: int) -> int:
        """Per signature, the most remaining nodes of it on one path, summed."""
        count: list[dict[int, int] | None] = [None] * self.n
        most = [0] * self.n_sigs
        for v in range(self.n):
            if done >> v & 1:
                continue
            c: dict[int, int] = {}
            for u in self.inputs[v]:
                cu = count[u]
                if cu:
                    for s, k in cu.items():
                        if k > c.get(s, 0):
                            c[s] = k
            s = self.sig[v]
            c[s] = c.get(s, 0) + 1
            if c[s] > most[s]:
                most[s] = c[s]
            count[v] = c
        return sum(most)

    def moves(self, done: int) -> list[int]:
        ready = self.ready(done)
        left = self.all & ~done
        by_sig: dict[int, int] = {}
        for v in range(self.n):
            if ready >> v & 1:
                by_sig[self.sig[v]] = by_sig.get(self.sig[v], 0) | 1 << v
        for s, bits in by_sig.items():
            if left & self.of_sig[s] == bits:  # all of s is ready: this move is safe
                return [done | bits]
        return [done | bits for bits in by_sig.values()]


def optimum(p: Problem, max_states: int = 2_000_000) -> int:
    """The fewest launches of any schedule of `p`; raises RuntimeError past `max_states`."""
    search = _Search(p)
    start = search.start
    if start == search.all:
        return 0
    g_of = {start: 0}
    heap = [(search.heuristic(start), 0, start)]  # (f, -g: deeper first on ties, state)
    closed = set()
    while heap:
        f, neg_g, done = heapq.heappop(heap)
        g = -neg_g
        if done == search.all:
            return g
        if done in closed:
            continue
        closed.add(done)
        if len(closed) > max_states:
            raise RuntimeError(f"more than {max_states} states")
        for after in search.moves(done):
            if g + 1 < g_of.get(after, 1 << 30):
                g_of[after] = g + 1
                heapq.heappush(heap, (g + 1 + search.heuristic(after), -(g + 1), after))
    raise AssertionError("unreachable: every state has a move")


def graph_optimum(graph, max_states: int = 2_000_000) -> int:
    """The fewest launches of any schedule of an fb.Graph's nodes, summed over its forwards."""
    ends = list(graph.forward_ends)
    if not ends or ends[-1] < graph.n_nodes:
        ends.append(graph.n_nodes)
    total, begin = 0, 0
    for end in ends:
        total += optimum(problem_of_graph(graph, begin, end), max_states)
        begin = end
    return total
