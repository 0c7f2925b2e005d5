"""A captured `nn.LSTM` / `nn.GRU` call on one instance's sequence: one node per layer.

Inside a graph block `nn.LSTM(x)` reaches `torch.lstm` (and `nn.GRU` `torch.gru`) with one
instance's sequence `x` of shape (T, 1, I). Each layer (both directions) becomes ONE node whose
batched kernel runs the sequences of every instance of the batch, whatever their lengths, as
ONE call of torch's packed-sequence form of the layer (what cuDNN and oneDNN run for a
`PackedSequence`). Padding instead would make the shorter sequences' final states, and their
whole reverse direction, wrong; packed, each sequence stops at its own end, so the output and
the final states are each instance's own, and each instance starts from its own initial state.

A layer node's value is (T + S, directions * H): the output of each step, then S rows of final
states, `h_n` (and for an LSTM `c_n`), each `[forward; reverse]`. The layer above reads that
node whole (the kernel skips the state rows), and the user gets `output` (T, 1, dirs * H), `h_n`
and `c_n` (layers * dirs, 1, H) in torch's layouts from cheap nodes that batch over every
length: the output rows of the top layer, a pick of each layer's state rows, a reshape.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from . import _core, kernels, ops, signatures
from .graph import Expression, Op


def _directions_first(state: torch.Tensor) -> torch.Tensor:
    """A batch of per-instance initial states [B, dirs, 1, H] in torch's layout (dirs, B, H)."""
    return state.squeeze(2).transpose(0, 1).contiguous()


def _rows_of(finals: Sequence[torch.Tensor]) -> torch.Tensor:
    """Final states (dirs, B, H) each as the row [forward; reverse] per instance: [B, S, W]."""
    return torch.stack([f.transpose(0, 1).reshape(f.shape[1], -1) for f in finals], 1)


def _layer_kernel(xs, attr, shape, lengths):
    """Every instance's sequence through one layer in one torch call: `xs[0]` holds the
    sequences [B, T + skip, ...], padded past each one's length (`skip`: a lower layer's state
    rows), then the initial states if given, then the weights. Equal lengths run as one
    batch-first tensor; different ones as one packed sequence."""
    lstm, bidirectional, has_states, skip, train = attr
    x = xs[0].reshape(xs[0].shape[0], xs[0].shape[1], -1)
    n_states = (2 if lstm else 1) if has_states else 0
    weights = [w[0] for w in xs[1 + n_states:]]
    B, dirs, H = x.shape[0], 2 if bidirectional else 1, weights[1].shape[1]
    states = [_directions_first(s.expand(B, *s.shape[1:])) for s in xs[1:1 + n_states]]
    if not states:
        states = [x.new_zeros(dirs, B, H)] * (2 if lstm else 1)
    hx = tuple(states) if lstm else states[0]
    has_bias = len(weights) // dirs == 4
    run = torch.lstm if lstm else torch.gru
    steps = None if lengths is None else lengths - skip
    _count_products(x, weights, dirs, B * (x.shape[1] - skip) if steps is None else steps.sum())
    if steps is None:
        out, *finals = run(x[:, :x.shape[1] - skip], hx, weights, has_bias, 1, 0.0, train,
                           bidirectional, True)
        return torch.cat([out, _rows_of(finals)], 1)
    packed = pack_padded_sequence(x, torch.from_numpy(steps), batch_first=True,
                                  enforce_sorted=False)
    hx = tuple(s.index_select(1, packed.sorted_indices) for s in states)
    data, *finals = run(packed.data, packed.batch_sizes, hx if lstm else hx[0], weights,
                        has_bias, 1, 0.0, train, bidirectional)
    out, _ = pad_packed_sequence(packed._replace(data=data), batch_first=True)
    finals = _rows_of([f.index_select(1, packed.unsorted_indices) for f in finals])
    # The state rows go right after each sequence's own last step, zeros after them.
    S = finals.shape[1]
    out = torch.cat([out, out.new_zeros(B, S, out.shape[2])], 1)
    rows = torch.from_numpy(steps[:, None] + np.arange(S)[None, :]).to(x.device)
    who = torch.arange(B, device=x.device)[:, None].expand(B, S)
    return out.index_put((who, rows), finals)


def _count_products(x, weights, dirs, steps) -> None:
    """The layer's products at each valid step, per direction: the input's and the state's."""
    w_ih, w_hh = weights[0], weights[1]
    for _ in range(dirs):
        kernels.flops.add(int(steps) * w_ih.shape[0], w_ih.shape[1], x, w_ih)
        kernels.flops.add(int(steps) * w_hh.shape[0], w_hh.shape[1], w_hh)


def _output_kernel(xs, attr, shape, lengths):
    """The output rows of a layer's result [B, T + S, W], as torch's (T, 1, W) per instance;
    the rows past a shorter sequence's end (its state rows among them) zeroed."""
    x, S = xs[0], attr
    if lengths is None:
        return x[:, :x.shape[1] - S].unsqueeze(2)
    steps = lengths - S
    out = x[:, :int(steps.max())]
    padding = torch.from_numpy(np.arange(out.shape[1])[None, :] >= steps[:, None])
    return out.masked_fill(padding.to(x.device).unsqueeze(-1), 0.0).unsqueeze(2)


# One layer over sequences of any length: (sequence, [h0, [c0]], weights...) -> (T + S, W).
LAYER = Op("packed_rnn", _layer_kernel, padded=True)
OUTPUT = Op("rnn_output", _output_kernel, padded=True, cheap=True)
# Row i of a layer's result, read in place: its final states (`x[T]`, `x[T + 1]`).
STATE_ROW = Op("rnn_state",
               lambda xs, attr, shape, lengths=None: ops._pick_kernel(xs, attr, shape),
               per_node_attrs=True, cheap=True, padded=True, rule="pick", picks_from_input=True)
_state_row = _core.Rule(STATE_ROW)


def layers(lstm: bool, x: Expression, states: tuple[Expression, ...] | None,
           params: Sequence[torch.Tensor], has_biases: bool, num_layers: int,
           bidirectional: bool, train: bool) -> tuple | None:
    """`torch.lstm` / `torch.gru` of one instance's sequence `x` (T, 1, I) from `states` (h0
    [and c0], each (layers * dirs, 1, H); None: zeros), as one node per layer: torch's
    `(output, h_n[, c_n])`. None where the call is not one this computes exactly as torch does
    (more than one row per instance, weights that are not parameters): the caller then
    unrolls it."""
    g = x.graph
    dirs, per_layer = 2 if bidirectional else 1, 4 if has_biases else 2
    T, rows = x.shape[0], x.shape[1]
    if rows != 1 or T == 0 or not all(p.is_leaf for p in params):
        return None
    H = params[1].shape[1]
    if states is not None and any(s.shape != (num_layers * dirs, 1, H) for s in states):
        return None
    S, W = (2 if lstm else 1), dirs * H
    name = "packed_lstm" if lstm else "packed_gru"
    finals = []
    for layer in range(num_layers):
        weights = params[layer * dirs * per_layer:(layer + 1) * dirs * per_layer]
        nodes = [g.parameter_node(w) for w in weights]
        given = () if states is None else tuple(
            s if num_layers == 1 else s[layer * dirs:(layer + 1) * dirs] for s in states)
        skip = 0 if layer == 0 else S
        key = (name, ("n",) + x.shape[1:], "h0" if given else "zero h0", skip, train,
               tuple(signatures.tag(g, w) for w in weights))
        x = g.add(LAYER, (g.node_of(x), *(g.node_of(s) for s in given), *nodes), (T + S, W),
                  key, (lstm, bidirectional, bool(given), skip, train))
        finals.append([_state_row(x, T + i) for i in range(S)])
    output = g.add(OUTPUT, (x.id,), (T, 1, W), ("rnn_output", ("n", W), S), S)
    final_states = tuple(_layout(rows, num_layers * dirs, H) for rows in zip(*finals))
    return (output,) + final_states


def _layout(rows: Sequence[Expression], directions: int, H: int) -> Expression:
    """The final states of every layer, each `[forward; reverse]`, as torch's (layers * dirs,
    1, H)."""
    joined = rows[0] if len(rows) == 1 else ops.concat(list(rows))
    return ops.reshape(joined, (directions, 1, H))
