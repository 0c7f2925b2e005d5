"""Recurrent cells and layers (torch.lstm_cell..., torch.lstm / gru, packed sequences of
one instance)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from .. import ops, packed_rnn
from ..graph import Expression, Graph, current_graph
from .calls import _Call
from .direct import _Bound, _direct, _record


# ---- recurrent cells and layers -------------------------------------------------------------
def _cell(func: Callable, outputs: int):
    """torch.lstm_cell / gru_cell / rnn_tanh_cell / rnn_relu_cell (what nn.*Cell call): one node
    computing the batch's cells, weights shared; an LSTM's (h, c) are two views of it."""
    def handler(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
        states = tuple(hx) if outputs == 2 else (hx,)
        operands = (input,) + states + (w_ih, w_hh) + tuple(b for b in (b_ih, b_hh)
                                                            if b is not None)
        call = _Call(operands, {})
        shared = call.shared()
        if not all(shared[1 + len(states):]):
            return NotImplemented
        # Input and states are per instance even when they are leaves that require grad (a
        # learned initial state): batched by shape, not by node.
        shared = (False,) * (1 + len(states)) + shared[1 + len(states):]
        g = call.graph
        x_shape = g.shape_of(call.nodes[0])
        if len(x_shape) != 2:
            return NotImplemented
        hidden = w_hh.shape[1]
        packed = (x_shape[0], outputs * hidden)
        fn = _Bound(_cell_batched, func, len(states), b_ih is not None)
        node = _direct(func.__name__, call, fn, (), packed, g.dtype, shared)
        if outputs == 1:
            return node
        h = _direct("narrow", _Call((node,), {}, g), _Bound(_narrow, 0, hidden), (),
                    (x_shape[0], hidden), g.dtype, (False,), cheap=True)
        c = _direct("narrow", _Call((node,), {}, g), _Bound(_narrow, hidden, hidden),
                    (), (x_shape[0], hidden), g.dtype, (False,), cheap=True)
        return h, c

    return handler


def _narrow(start, length, batch):
    return batch[0].narrow(-1, start, length)


def _cell_batched(func, n_states, has_bias, batch):
    x, *rest = batch
    states, weights = rest[:n_states], rest[n_states:]
    size, rows = x.shape[0], x.shape[1]
    flat = [t.reshape(size * rows, t.shape[-1]) for t in [x] + states]
    if not has_bias:
        weights = weights + [None, None]
    if n_states == 2:
        h, c = func(flat[0], (flat[1], flat[2]), *weights)
        out = torch.cat([h, c], -1)
    else:
        out = func(flat[0], flat[1], *weights)
    return out.reshape(size, rows, -1)


def _lstm_step_batched(has_bias, hidden, batch):
    """One LSTM step of a batch: x [B, rows, in], packed state [B, rows, 2H] ([h; c], the
    layout the step returns, so a sequence never slices c out), weights shared."""
    x, hc, w_ih, w_hh, *biases = batch
    size, rows = x.shape[0], x.shape[1]
    hc = hc.reshape(size * rows, 2 * hidden)
    h, c = torch.lstm_cell(x.reshape(size * rows, -1), (hc[:, :hidden], hc[:, hidden:]), w_ih,
                           w_hh, *(biases if has_bias else (None, None)))
    return torch.cat([h, c], -1).reshape(size, rows, 2 * hidden)


def _gru_step_batched(has_bias, batch):
    x, h, w_ih, w_hh, *biases = batch
    size, rows = x.shape[0], x.shape[1]
    out = torch.gru_cell(x.reshape(size * rows, -1), h.reshape(size * rows, -1), w_ih, w_hh,
                         *(biases if has_bias else (None, None)))
    return out.reshape(size, rows, -1)


def _rnn(gates: int):
    """torch.lstm / torch.gru (what nn.LSTM and nn.GRU call) over one instance's sequence:
    one node per layer whose kernel runs every instance's sequence as one packed sequence
    (`packed_rnn`). Where that is not exact (rows > 1 per instance, dropout between layers in
    training), unrolled into one cell node per step, layer and direction: step t of every
    instance runs as one batched cell whatever the lengths. Step inputs are picks of the
    sequence (`x[t]`, the index per node, so they batch across steps too); an LSTM carries its
    state packed as [h; c] and slices h out only where a layer's output is read."""
    lstm = gates == 4

    def step():  # the plans' key for one step node (see `_record`)
        raise AssertionError("a plan key, not called")

    def build_step(call):
        shared = call.weights_shared()
        if shared is None:
            return NotImplemented
        (rows, _), dtype = call.operands[0]
        hidden = call.operands[3][0][1]  # w_hh: (gates * H, H)
        has_bias = len(call.nodes) == 6
        fn = _Bound(_lstm_step_batched, has_bias, hidden) if lstm else \
            _Bound(_gru_step_batched, has_bias)
        return ("lstm_step" if lstm else "gru_step", fn, (rows, (2 if lstm else 1) * hidden),
                dtype, shared, False)

    def handler(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                batch_first):
        if isinstance(has_biases, (list, tuple)):  # the packed overload: (data, batch_sizes, ...)
            return _packed_rnn(handler, input, hx, params, has_biases, num_layers, dropout,
                               train, bidirectional, batch_first)
        if not isinstance(input, (Expression, torch.Tensor)) or len(input.shape) != 3 \
                or not all(isinstance(p, torch.Tensor) and p.requires_grad for p in params):
            return NotImplemented
        per_direction = len(params) // (num_layers * (2 if bidirectional else 1))
        if per_direction != (4 if has_biases else 2):
            raise ValueError(f"torch.{'lstm' if lstm else 'gru'}: {per_direction} weights per "
                             f"layer and direction (an nn.LSTM with proj_size?); flybatch "
                             f"records {4 if has_biases else 2}, without projections")
        if not isinstance(input, Expression):  # a plain sequence into the module's parameters
            g = current_graph()
            input = Expression(g, g._operand(input))
        g = input.graph
        if batch_first:
            input = input.transpose(0, 1)  # (length, rows, features)
        if not (dropout and train and num_layers > 1):  # (dropout between layers: unrolled)
            fused = packed_rnn.layers(lstm, input, _initial_states(g, hx, lstm), params,
                                      has_biases, num_layers, bidirectional, train)
            if fused is not None:
                output, *finals = fused
                return (output.transpose(0, 1) if batch_first else output, *finals)
        length = input.shape[0]
        directions = 2 if bidirectional else 1
        per_layer = 4 if has_biases else 2
        h0, c0 = hx if lstm else (hx, None)
        xs = [input[t] for t in range(length)]  # (rows, features) each
        finals_h, finals_c = [], []
        for layer in range(num_layers):
            outs_by_direction = []
            for direction in range(directions):
                k = layer * directions + direction
                weights = tuple(params[k * per_layer:(k + 1) * per_layer])
                hidden = weights[1].shape[1]
                state = torch.cat([h0[k], c0[k]], -1) if lstm else h0[k]
                order = range(length) if direction == 0 else range(length - 1, -1, -1)
                states = [None] * length
                for t in order:
                    state = _record(step, (xs[t], state) + weights, None, build_step,
                                    (2, 3, 4, 5))
                    states[t] = state
                outs_by_direction.append(states)
                finals_h.append(state[..., :hidden] if lstm else state)
                finals_c.append(state[..., hidden:] if lstm else None)
            last = layer == num_layers - 1
            if last:
                break
            xs = [_hidden_of(outs, lstm) for outs in outs_by_direction]
            xs = xs[0] if directions == 1 else [torch.cat(pair, -1) for pair in zip(*xs)]
            if dropout and train:  # one mask for the layer's whole output, as eagerly
                g = xs[0].graph
                noise = ops.dropout_noise((len(xs),) + tuple(xs[0].shape), dropout,
                                          g.dtype_of(xs[0].id), g.device)
                xs = [ops.dropout(x, dropout, True, noise[t]) for t, x in enumerate(xs)]
        # The top layer's output: one stack per direction, h sliced once for all steps.
        outputs = [torch.stack(states, 0) for states in outs_by_direction]
        if lstm:
            outputs = [out[..., :hidden] for out in outputs]
        output = outputs[0] if directions == 1 else torch.cat(outputs, -1)
        if batch_first:
            output = output.transpose(0, 1)
        h_n = torch.stack(finals_h, 0)
        if lstm:
            return output, h_n, torch.stack(finals_c, 0)  # as torch.lstm: flat
        return output, h_n

    return handler


# Packed sequences (`nn.utils.rnn.pack_sequence([x])`, `pack_padded_sequence`) of ONE instance's
# sequence: one sequence, so its packed data is the sequence itself and every batch size is 1;
# the layers run as on the (T, 1, I) sequence, which batches across instances anyway.
def _one_sequence(name: str, batch_sizes: Any) -> None:
    if isinstance(batch_sizes, Expression) or not bool((batch_sizes == 1).all()):
        raise ValueError(f"{name}: flybatch batches packed sequences of one sequence per "
                         f"instance (batch sizes all 1), not {batch_sizes!r}")


def _pack_padded(input, lengths, batch_first):
    if not isinstance(input, Expression) or isinstance(lengths, Expression) \
            or lengths.numel() != 1:
        raise ValueError(f"torch._pack_padded_sequence: flybatch packs one sequence per instance, "
                         f"not an input of shape {tuple(input.shape)} with lengths {lengths!r}")
    length = int(lengths[0])
    data = input[0, :length] if batch_first else input[:length, 0]
    return data, torch.ones(length, dtype=torch.int64)


def _pad_packed(data, batch_sizes, batch_first, padding_value, total_length):
    _one_sequence("torch._pad_packed_sequence", batch_sizes)
    length = len(batch_sizes)
    padded = F.pad(data, (0, 0, 0, total_length - length), value=padding_value)
    return padded.unsqueeze(0 if batch_first else 1), torch.tensor([length])


def _packed_rnn(unpacked, data, batch_sizes, hx, params, has_biases, num_layers, dropout, train,
                bidirectional):
    _one_sequence("torch.lstm / torch.gru", batch_sizes)
    output, *finals = unpacked(data.unsqueeze(1), hx, params, has_biases, num_layers, dropout,
                               train, bidirectional, False)
    return (output.squeeze(1), *finals)


def _initial_states(g: Graph, hx: Any, lstm: bool) -> tuple[Expression, ...] | None:
    """The initial states of a captured `torch.lstm` / `torch.gru` as expressions, or None when
    they are plain tensors of zeros (nn.LSTM's default): the layer then starts from zeros
    without reading a copy of them per instance."""
    states = tuple(hx) if lstm else (hx,)
    if all(type(s) is torch.Tensor and id(s) not in g.shadows and not s.requires_grad
           for s in states):
        with torch._C.DisableTorchFunction():
            if not any(bool(s.any()) for s in states):
                return None
    return tuple(s if isinstance(s, Expression) else Expression(g, g._operand(s))
                 for s in states)


def _hidden_of(states, lstm):
    if not lstm:
        return states
    hidden = states[0].shape[-1] // 2
    return [s[..., :hidden] for s in states]
