"""A shared-weight product of a concat of earlier results, distributed over the concat.

A transition parser scores every state with `affine(W, concat([v_s0, v_s1, v_s2, v_b0]), b)`,
the v being rows of a result of an EARLIER forward (the encoder's states), read again by each of
~100 later forwards. Run as written, every step is one small GEMM ([B, k*d] x [k*d, out], B ~20-64,
~40 GFLOP/s here) and backward two more of its size. But

    W @ concat(x_1, ..., x_k) + b  =  b + sum_i W_i @ x_i        (W_i: the columns of block i)

so the products of EVERY row of the source with every block can be computed once, as one large
GEMM per source and weight (its *projection* P_s = X_s @ [W_1; ...; W_k]^T, a [N_s * k, out]
table), and each later batch becomes one gather of k rows of P per node and a sum: what parsers
do by hand (Chen & Manning 2014's precomputation), found here without the model saying so.
Backward goes through autograd: each gather adds its rows into the table's gradient sink, and
the projection's backward multiplies the whole dP by W (dX) and by X (dW) once: two large GEMMs
instead of two small ones per forward.

When it pays: a projection costs N_s * k row products at a large GEMM's speed; the direct path
costs each row and block it multiplies at a small GEMM's, ~2.5x slower (1 thread, 2026-11-23).
Future reads are unknown, so the rule is rent-or-buy: the sources are projected once the
products run as written by the weight, this forward's included, cost as much as projecting
them would (SMALL_GEMM_SLOWDOWN), which costs at most about twice the better choice in
hindsight. A source computed by this forward, stored padded, or read in another layout is never
projected; the batch then runs as written.

This module plans (which rows of which table, listed by the compiled core's `concat_rows`) and
keeps the tables; execution.py reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from . import _core, kernels

# Sources are projected once (rows times blocks multiplied as written by the weight since its
# last projection) * SMALL_GEMM_SLOWDOWN >= (the sources' rows) * k: the direct path's cost so
# far has reached the projections' (rent-or-buy).
# The slowdown is the direct path's time per row and block over a projection's, forward and
# backward with their gathers and gradient scatters, measured on the benchmark machine (1
# thread, the parser's shapes: 1,132 source rows of 400, k = 4, 100 out): 3.8 at 16 rows per
# batch, 2.5 at 32, 2.0 at 64.
SMALL_GEMM_SLOWDOWN = 2.5
# A projection holds k * out numbers per source row where the source holds d: a weight with many
# more outputs than inputs per block (a vocabulary-sized output layer) would make it many times
# the size of its sources. Such a weight is left as written.
TABLE_MAX_GROWTH = 4

# A projection, its joined table and their autograd nodes are per source: where a batch reads
# from more sources than it has rows over two (one state per forward: strategy `none`, a
# sentence parsed alone), the tables are many and tiny and cost more than the products they
# replace (the parser under `none`: 1,131 one-row projections, its training step 1.1-1.2x
# slower than without them, 2026-11-24). Such a batch is multiplied as written.
MIN_ROWS_PER_SOURCE = 2


@dataclass
class _Projection:
    """P_s of one source by one weight: `table` [N_s * k, out], row n * k + i = W_i @ X_s[n]; valid
    while the weight and source tensors are these, at these versions (an in-place write in
    between, an optimizer step, makes a new one)."""

    table: torch.Tensor
    weight: torch.Tensor  # as stored: [1, out, k * d]
    weight_version: int
    source: torch.Tensor
    source_version: int

    def valid(self, weight: torch.Tensor, source: torch.Tensor) -> bool:
        return (self.weight is weight and self.weight_version == weight._version
                and self.source is source and self.source_version == source._version)


@dataclass
class _Joined:
    """The tables of a batch's sources, concatenated in the order of their batches (the table
    itself for one source), and its gradient sink once execution.py makes one."""

    tables: tuple[torch.Tensor, ...]
    table: torch.Tensor
    sink: object = None


@dataclass
class Projections:
    """A graph's projections and the counts that decide them; `batches` counts the batches served
    by a gather of projected rows, `products` the projection GEMMs run (both for stats and
    tests)."""

    tables: dict[tuple, _Projection] = field(default_factory=dict)
    joined: dict[tuple, _Joined] = field(default_factory=dict)  # (weight, sources, grad mode)
    # weight batch -> rows times blocks it multiplied as written since its last projection
    rent: dict[int, int] = field(default_factory=dict)
    # (weight batch, k, grad mode) -> (the weight, its version, [W_1; ...; W_k]): one copy of
    # the blocks per weight version, shared by all its sources' projections (autograd saves it
    # for their backward once, not per source)
    blocks: dict[tuple, tuple] = field(default_factory=dict)
    batches: int = 0
    products: int = 0

    def blocks_of(self, weight_batch: int, w: torch.Tensor, k: int, grad: bool) -> torch.Tensor:
        """[W_1; ...; W_k] of the weight as stored ([1, out, k * d]): [k * out, d]."""
        found = self.blocks.get((weight_batch, k, grad))
        if found is not None and found[0] is w and found[1] == w._version:
            return found[2]
        out, d = w.shape[1], w.shape[2] // k
        blocks = w[0].reshape(out, k, d).transpose(0, 1).reshape(k * out, d)
        self.blocks[(weight_batch, k, grad)] = (w, w._version, blocks)
        return blocks

    def __repr__(self) -> str:
        return (f"Projections(tables={len(self.tables)}, batches={self.batches}, "
                f"products={self.products})")


def plan(graph, concat_nodes: np.ndarray, rows: slice, weight_batch: int, first_batch: int):
    """The gather that replaces an affine batch over the concat batch of `concat_nodes` whose
    nodes `rows` the affine reads: (the joined tables of projected rows, the rows of it to
    gather per node and block, [n * k], the source tensors), or None when the batch runs as
    written. The rows each node and block read come from the graph's columns, in the compiled
    core (`_core.concat_rows`): numpy over the concat's reads cost ~25 us more per forward,
    ~2.5 ms of the parser's ~45 ms evaluation minibatch (2026-11-24)."""
    found = _core.concat_rows(graph, concat_nodes)
    if found is None:
        return None
    k, sources, source_rows, table_rows = found
    values = graph.values
    weight = values[weight_batch]
    out, width = weight.shape[1], weight.shape[2]
    if width % k or out * k > TABLE_MAX_GROWTH * (width // k):
        return None
    d = width // k
    if len(concat_nodes) < MIN_ROWS_PER_SOURCE * len(sources):
        return None
    if sources[-1] >= first_batch:  # a source computed by this forward
        return None
    for source, n_rows in zip(sources, source_rows):
        value = values[source]
        if source in graph.padded or value.dim() != 2 or value.shape[1] != d \
                or value.shape[0] != n_rows:
            return None
    projections: Projections = graph.projections
    grad = torch.is_grad_enabled()
    tables, missing = [], []
    for source in sources:
        projection = projections.tables.get((weight_batch, source, grad))
        if projection is None or not projection.valid(weight, values[source]):
            missing.append(source)
        tables.append(None if projection is None else projection.table)
    if missing:  # rent or buy: the products run as written since the last projection
        rent = projections.rent.get(weight_batch, 0) + (rows.stop - rows.start) * k
        projections.rent[weight_batch] = rent
        if rent * SMALL_GEMM_SLOWDOWN < sum(values[source].shape[0] for source in missing) * k:
            return None
        projections.rent[weight_batch] = 0
        blocks = projections.blocks_of(weight_batch, weight, k, grad)
        for source in missing:
            projection = _project(weight, blocks, values[source], out)
            projections.tables[(weight_batch, source, grad)] = projection
            tables[sources.index(source)] = projection.table
            projections.products += 1
    tables = tuple(tables)
    joined_key = (weight_batch, sources, grad)
    joined = projections.joined.get(joined_key)
    if joined is None or any(a is not b for a, b in zip(joined.tables, tables)):
        joined = projections.joined[joined_key] = _Joined(
            tables, tables[0] if len(tables) == 1 else torch.cat(tables))
    projections.batches += 1
    gathered = np.frombuffer(table_rows, np.int64)[rows.start * k:rows.stop * k]
    return joined, gathered, [values[s] for s in sources]


def _project(w: torch.Tensor, blocks: torch.Tensor, source: torch.Tensor,
             out: int) -> _Projection:
    """P = X @ [W_1; ...; W_k]^T as ONE GEMM: [N, d] x [d, k * out], viewed [N * k, out]. `w`
    is the weight as stored, [1, out, k * d]; `blocks` its [W_1; ...; W_k], [k * out, d]."""
    table = kernels.linear(source, blocks, model_flops=False).reshape(-1, out)
    return _Projection(table, w, w._version, source, source._version)
