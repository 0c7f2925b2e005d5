"""Building blocks: `torch.nn.Module`s whose calls take and return flybatch expressions.

They own ordinary torch Parameters, so `state_dict`, optimizers and checkpoints work unchanged.
A recurrent cell application is ONE fused node whose batched kernel computes the whole cell
(sharing the cell's parameters in its signature); its `State` is that node's `[h; c]`, sliced
only where the model reads `h` or `c` (an LSTM step adds its input projection: two nodes).
Graph size is what the user pays for in Python, so a cell must not cost 15 nodes.
Module calls skip `torch.nn.Module.__call__`'s hook machinery because they only build graph
nodes, and they are called once per instance per step: `__call__ = _core.own_time(forward)`,
which also counts their time as flybatch's part of a build (the bench's `build_user`). For the
same reason a call reads its parameters from `self._parameters`, not as `self.weight`, which goes
through `nn.Module.__getattr__` (~0.7 us a read).
"""

from __future__ import annotations

import math
import re
from typing import Sequence

import torch
from torch import nn

from . import _core, kernels, lstm_layer, ops, signatures, tree_lstm
from .errors import ShapeError
from .graph import Expression, Graph, Op
from .ops import Operand


def _uniform(module: nn.Module, hidden_size: int) -> None:
    bound = 1.0 / math.sqrt(hidden_size)
    for p in module.parameters():
        nn.init.uniform_(p, -bound, bound)


def _check_twin(ours: type, module: nn.Module, theirs: type, **options: object) -> None:
    """`module` must be a `theirs` whose `options` have the values `ours` computes."""
    if not isinstance(module, theirs):
        raise TypeError(f"fb.nn.{ours.__name__}.from_torch takes a torch.nn.{theirs.__name__}, "
                        f"not {type(module).__name__}")
    for name, value in options.items():
        if getattr(module, name) != value:
            raise ValueError(f"fb.nn.{ours.__name__} computes torch.nn.{theirs.__name__}"
                             f"({name}={value!r}) only, not {name}={getattr(module, name)!r}")


def _with_weights_of(ours: nn.Module, theirs: nn.Module) -> nn.Module:
    """`ours` on the dtype and device of torch module `theirs`, holding a copy of its weights."""
    p = next(theirs.parameters())
    ours = ours.to(device=p.device, dtype=p.dtype)
    ours.load_state_dict(theirs.state_dict())
    return ours


class FusedModule(nn.Module):
    """A module whose calls create fused nodes.

    Each kind of node it makes is described once, as a `_core.FusedSpec` (op, parameters,
    input and output shapes, attr), and a call is one C call, `_core.fused(module, spec,
    inputs)`. Its parameters' nodes are looked up once per graph (not once per call), and its
    signature names the module (by its tag in the graph, `signatures.tag`): nodes of one module
    with equal input shapes share its parameters and batch together.
    """

    def _in_graph(self, g: Graph) -> tuple:
        """This module's entry in `g`: (the module, its tag, its parameters' nodes by name,
        and a cache: a tuple of parameter names -> the list of their nodes).

        The graph keeps it, not the module: a closed graph is freed however long the module
        lives, and a copy of the module is a module of its own.
        """
        entry = g.tags.get(id(self))
        if entry is None:
            nodes = {name: g.parameter_node(p) for name, p in self._parameters.items()
                     if p is not None}
            entry = signatures.remember(g, self, nodes, {})
        return entry


class State(_core.State):
    """A recurrent cell's state: its output `state.h` and its memory cell `state.c`, held as ONE
    node `[h; c]`.

    Read it by name: a State does not unpack (`h, c = state` and `state[0]` raise TypeError),
    because per-instance code orders the pair both ways (`(h, c)` in torch.nn.LSTMCell, `(c, h)`
    in many Tree-LSTMs) and a swap would silently train another model. The slices for h and c
    become nodes only when asked for: a cell given a State reads `[h; c]` directly, so the
    recurrence itself costs no slice nodes (an RNN step is two nodes, a Tree-LSTM node one, plus
    the `h` the model reads). `State.of(h=..., c=...)` makes one from vectors of your own.
    """

    # `State(hc, hidden)`, its fields `hc` and `hidden` and the properties `h` (the output, or
    # hidden state) and `c` (the memory cell) are the compiled core's (csrc/fused.cpp): a cell
    # call makes its State in C, and reading `h` or `c` makes the slice node once.
    __slots__ = ()

    @classmethod
    def of(cls, *, h: Operand, c: Operand) -> "State":
        """The State whose output is `h` and whose memory cell is `c` (one concat node)."""
        if len(h.shape) != 1 or tuple(h.shape) != tuple(c.shape):
            raise ShapeError(f"State.of: h {tuple(h.shape)} and c {tuple(c.shape)} must be "
                             f"vectors of one size")
        return cls(ops.concat([h, c]), h.shape[0])

    def __iter__(self):
        raise TypeError(_BY_NAME)

    def __getitem__(self, i: object):
        raise TypeError(_BY_NAME)

    def __repr__(self) -> str:
        return f"State({self.hc!r})"


_BY_NAME = ("an fb.nn.State is read by name, not position: use state.h and state.c (code that "
            "orders the pair (c, h) would silently swap them)")


def _previous(state: "State | tuple[Operand, Operand]") -> Operand:
    """An LSTM cell's previous `[h; c]`: a State, or `(h, c)` in torch.nn.LSTMCell's order."""
    if isinstance(state, State):
        return state.hc
    if isinstance(state, (tuple, list)) and len(state) == 2:
        return State.of(h=state[0], c=state[1]).hc
    raise TypeError(f"LSTMCell: the previous state must be an fb.nn.State or an (h, c) pair, "
                    f"not {type(state).__name__}")


def _split(hc: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """h and c from a batch of `[h; c]` (split: its backward is one concatenation)."""
    h, c = hc.split(hidden, 1)
    return h, c


class Linear(nn.Module):
    """`W x + b` (an `affine` node) or `W x` without bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        _uniform(self, in_features)

    def forward(self, x: Operand) -> Expression:
        params = self._parameters  # not self.weight: see the module's docstring
        weight, bias = params["weight"], params.get("bias")  # no bias: not registered
        if bias is None:
            return ops.matmul(weight, x)
        return ops.affine(weight, x, bias)

    __call__ = _core.own_time(forward)


class Embedding(nn.Module):
    """A lookup table; `sparse=True` gives sparse gradients (only the rows used)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, sparse: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_embeddings, embedding_dim) * 0.1)
        self.sparse = sparse

    def forward(self, index: int) -> Expression:
        return ops.lookup(self._parameters["weight"], index, sparse=self.sparse)

    __call__ = _core.own_time(forward)


class MLP(nn.Module):
    """Linear layers with an activation between them (not after the last)."""

    def __init__(self, sizes: Sequence[int], activation=ops.tanh):
        super().__init__()
        self.layers = nn.ModuleList(Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        self.activation = activation

    def forward(self, x: Operand) -> Expression:
        layers = self._modules["layers"]
        for i, layer in enumerate(layers):
            x = layer(x)
            if i + 1 < len(layers):
                x = self.activation(x)
        return x

    __call__ = _core.own_time(forward)


# ---- LSTM ----------------------------------------------------------------------------------------
def _lstm_kernel(xs, attr, shape):
    projected, hc, w_hh = xs
    h, c = _split(hc, shape[0] // 2)
    gates = projected + kernels.linear(h, w_hh.squeeze(0))
    i, f, g, o = gates.chunk(4, 1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.cat([torch.sigmoid(o) * torch.tanh(c), c], 1)


LSTM_CELL = Op("lstm_cell", _lstm_kernel)


# A cell over a whole sequence: (stacked inputs (n, D), weight_ih, weight_hh, bias) -> the h of
# every step (n, H). Signature ("lstm_layer", the cell's tag): sequences of any length, padded.
LSTM_LAYER = Op("lstm_layer", lstm_layer.kernel, padded=True)
# Step t's h of a layer's result: `x[t]` of a sequence of any length, read in place (only the
# row picked is copied, not each sequence's whole (n, H)).
LSTM_STEP = Op("lstm_step",
               lambda xs, attr, shape, lengths=None: ops._pick_kernel(xs, attr, shape),
               per_node_attrs=True, cheap=True, padded=True, rule="pick", picks_from_input=True)
_lstm_step = _core.Rule(LSTM_STEP)
_TORCH_LSTM_KEY = re.compile(r"(weight_ih|weight_hh|bias_ih|bias_hh)_l(\d+)(_reverse)?")


class LSTMCell(FusedModule):
    """A standard LSTM cell: torch.nn.LSTMCell's equations, gate order (i, f, g, o) and weights,
    with ONE bias where torch has two that are only ever added (`bias = bias_ih + bias_hh`).

    `cell(x, state=None)` returns a `State`; the previous state is a State or an `(h, c)` pair
    in torch.nn.LSTMCell's order (None: zeros). `load_state_dict` takes torch.nn.LSTMCell's
    state_dicts (summing the two biases) as well as its own, and `from_torch` copies a torch
    cell. Per instance the outputs are torch's, and `bias.grad` equals the gradient torch gives
    each of its two biases (they receive the same one).

    A step is two nodes: the input projection `W_ih x + b`, which depends on x only, and the
    recurrent cell. The agenda therefore runs the projections of ALL steps of all sequences as
    one large matrix product (as cuDNN does), and only `W_hh h` stays in the sequential loop.
    """

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.input_size, self.hidden_size = input_size, hidden_size
        self.weight_ih = nn.Parameter(torch.empty(4 * hidden_size, input_size))
        self.weight_hh = nn.Parameter(torch.empty(4 * hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.empty(4 * hidden_size))
        _uniform(self, hidden_size)
        H = hidden_size
        self._cell = _core.FusedSpec(LSTM_CELL, ("weight_hh",), ((4 * H,), (2 * H,)), (2 * H,),
                                     state=State)

    @classmethod
    def from_torch(cls, module: nn.LSTMCell) -> "LSTMCell":
        """The cell of a `torch.nn.LSTMCell` (with bias): its weights (copied), dtype, device."""
        _check_twin(cls, module, nn.LSTMCell, bias=True)
        return _with_weights_of(cls(module.input_size, module.hidden_size), module)

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        ih, hh = prefix + "bias_ih", prefix + "bias_hh"
        if ih in state_dict and hh in state_dict and prefix + "bias" not in state_dict:
            state_dict[prefix + "bias"] = state_dict.pop(ih) + state_dict.pop(hh)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}"

    def forward(self, x: Operand, state: State | tuple[Operand, Operand] | None = None) -> State:
        H = self.hidden_size
        hc = (ops.zeros(2 * H, graph=ops.graph_of(x)) if state is None else _previous(state))
        params = self._parameters
        weight_ih, bias = params["weight_ih"], params["bias"]
        projected = ops.affine(weight_ih, x, bias)
        return _core.fused(self, self._cell, (projected, hc))

    __call__ = _core.own_time(forward)


class LSTM(nn.Module):
    """Runs LSTM cells over a list of expressions; returns the top layer's outputs.

    Each layer and direction over the sequence is one `lstm_layer` node (see `run`): the
    batch of every instance's sequence is one kernel call (torch's LSTM, or flybatch's
    stepwise layer where lengths differ: flybatch/lstm_layer.py), not one launch per step.
    With `bidirectional=True` each output is `[forward h_t; backward h_t]`, and a layer above
    reads those concatenations: torch.nn.LSTM's output for one sequence, step by step.
    `load_state_dict` takes torch.nn.LSTM's state_dicts (`weight_ih_l{k}` is
    `forward_cells[k].weight_ih`, `..._l{k}_reverse` a backward cell's, the two biases summed as
    in `LSTMCell`) as well as its own, and `from_torch` copies a torch LSTM.
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 bidirectional: bool = False):
        super().__init__()
        directions = 2 if bidirectional else 1
        self.bidirectional = bidirectional
        self.forward_cells = nn.ModuleList()
        self.backward_cells = nn.ModuleList()
        for layer in range(num_layers):
            size = input_size if layer == 0 else hidden_size * directions
            self.forward_cells.append(LSTMCell(size, hidden_size))
            if bidirectional:
                self.backward_cells.append(LSTMCell(size, hidden_size))

    @classmethod
    def from_torch(cls, module: nn.LSTM) -> "LSTM":
        """The LSTM of a `torch.nn.LSTM`: its weights copied, its dtype and device. Its
        `batch_first` means nothing here (the input is one instance's list of steps); options
        fb.nn.LSTM does not compute (no bias, `proj_size`, dropout between layers) raise."""
        _check_twin(cls, module, nn.LSTM, bias=True, proj_size=0, dropout=0.0)
        ours = cls(module.input_size, module.hidden_size, module.num_layers, module.bidirectional)
        return _with_weights_of(ours, module)

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        for key in [k for k in state_dict if k.startswith(prefix)]:
            torch_name = _TORCH_LSTM_KEY.fullmatch(key[len(prefix):])
            if torch_name:
                name, layer, reverse = torch_name.groups()
                cells = "backward_cells" if reverse else "forward_cells"
                state_dict[f"{prefix}{cells}.{layer}.{name}"] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, *args)

    @staticmethod
    @_core.own_time
    def run(cell: LSTMCell, xs: Sequence[Operand]) -> list[Expression]:
        """The `h` of each step of `cell` over `xs` from a zero state, as calling the cell step
        by step computes them, in ONE node for the whole sequence (`LSTM_LAYER`: its batched
        kernel runs every sequence of the batch at once, `lstm_layer.kernel`) and a node per step
        reading its `h` (`lstm_step`, batched across steps and sequences)."""
        xs = list(xs)
        if not xs:
            return []
        X = ops.stack(xs)
        if X.shape[1:] != (cell.input_size,):
            raise ShapeError(f"LSTM: the cell takes inputs of shape ({cell.input_size},), got "
                             f"{X.shape[1:]}")
        g = X.graph
        _, tag, table, _ = cell._in_graph(g)
        n = len(xs)
        out = g.add(LSTM_LAYER, (X.id, table["weight_ih"], table["weight_hh"], table["bias"]),
                    (n, cell.hidden_size), ("lstm_layer", tag))
        return [_lstm_step(out, t) for t in range(n)]

    def forward(self, xs: Sequence[Operand]) -> list[Expression]:
        xs = list(xs)
        for layer, cell in enumerate(self.forward_cells):
            fwd = self.run(cell, xs)
            if not self.bidirectional:
                xs = fwd
                continue
            bwd = self.run(self.backward_cells[layer], xs[::-1])[::-1]
            xs = [ops.concat([f, b]) for f, b in zip(fwd, bwd)]
        return xs

    __call__ = _core.own_time(forward)


# ---- GRU -----------------------------------------------------------------------------------------
def _gru_kernel(xs, attr, shape):
    x, h, w_ih, w_hh, b_ih, b_hh = xs
    gx = kernels.linear(x, w_ih.squeeze(0), b_ih.squeeze(0))
    gh = kernels.linear(h, w_hh.squeeze(0), b_hh.squeeze(0))
    rx, zx, nx = gx.chunk(3, 1)
    rh, zh, nh = gh.chunk(3, 1)
    r, z = torch.sigmoid(rx + rh), torch.sigmoid(zx + zh)
    n = torch.tanh(nx + r * nh)
    return (1 - z) * n + z * h


GRU_CELL = Op("gru_cell", _gru_kernel)


class GRUCell(FusedModule):
    """A GRU cell with torch.nn.GRUCell's equations and parameters (gates r, z, n; two biases,
    as `bias_hn` sits inside `r * (W_hn h + b_hn)`): its state_dicts load either way, and
    `from_torch` copies a torch cell. `cell(x, h=None)` returns the new `h` (None: zeros)."""

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.input_size, self.hidden_size = input_size, hidden_size
        self.weight_ih = nn.Parameter(torch.empty(3 * hidden_size, input_size))
        self.weight_hh = nn.Parameter(torch.empty(3 * hidden_size, hidden_size))
        self.bias_ih = nn.Parameter(torch.empty(3 * hidden_size))
        self.bias_hh = nn.Parameter(torch.empty(3 * hidden_size))
        _uniform(self, hidden_size)
        self._cell = _core.FusedSpec(GRU_CELL, ("weight_ih", "weight_hh", "bias_ih", "bias_hh"),
                                     ((input_size,), (hidden_size,)), (hidden_size,))

    @classmethod
    def from_torch(cls, module: nn.GRUCell) -> "GRUCell":
        """The cell of a `torch.nn.GRUCell` (with bias): its weights (copied), dtype, device."""
        _check_twin(cls, module, nn.GRUCell, bias=True)
        return _with_weights_of(cls(module.input_size, module.hidden_size), module)

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}"

    def forward(self, x: Operand, h: Expression | None = None) -> Expression:
        if h is None:
            h = ops.zeros(self.hidden_size, graph=ops.graph_of(x))
        return _core.fused(self, self._cell, (x, h))

    __call__ = _core.own_time(forward)


# ---- Tree-LSTM -------------------------------------------------------------------------------------
def _finish(iou: torch.Tensor, c: torch.Tensor | None) -> torch.Tensor:
    """From the i, o, u pre-activations and the forget-gated children's cells, [h; c]."""
    i, o, u = iou.chunk(3, 1)
    cell = torch.sigmoid(i) * torch.tanh(u)
    if c is not None:
        cell = cell + c
    return torch.cat([torch.sigmoid(o) * torch.tanh(cell), cell], 1)


def _tree_leaf_kernel(xs, attr, shape):
    x, w, b = xs
    if tree_lstm.fused(x, w, b):
        return tree_lstm.leaf(x, w, b)
    return _finish(kernels.linear(x, w.squeeze(0), b.squeeze(0)), None)


def _nary_kernel(xs, attr, shape):
    n, has_x = attr
    x = xs[n] if has_x else None
    u_iou, u_f, b_iou, b_f = xs[n + has_x:n + has_x + 4]
    if tree_lstm.fused(*xs):
        return tree_lstm.nary(xs[:n], x, u_iou, u_f, b_iou, b_f, xs[-1] if has_x else None)
    size = max(t.shape[0] for t in xs[:n])
    # A child every node reads is one row; expanded only then (an expand is an autograd node).
    hcs = [hc if hc.shape[0] == size else hc.expand(size, -1) for hc in xs[:n]]
    hs, cs = zip(*[_split(hc, shape[0] // 2) for hc in hcs])
    children = torch.cat(hs, 1)
    iou = kernels.linear(children, u_iou.squeeze(0), b_iou.squeeze(0))
    if has_x:
        iou = iou + kernels.linear(x, xs[-1].squeeze(0))
    u_fs = u_f.squeeze(0).unbind(0)  # unbind: its backward stacks, no zero-filled copies
    b_f = b_f.squeeze(0)
    fcs = []  # f_k * c_k
    for k, (h, ck) in enumerate(zip(hs, cs)):
        fcs.append(torch.sigmoid(kernels.linear(h, u_fs[k], b_f)) * ck)
    # Summed from the first term, not from sum()'s 0: `0 + t` is a pass and an autograd node.
    # (addcmul would save the adds' passes, but its backward multiplies by its scalar too.)
    return _finish(iou, sum(fcs[1:], fcs[0]))


def _child_sum_kernel(xs, lengths, shape):
    x, w_iou, u_iou, w_f, u_f, b_iou, b_f, *children = xs
    if x.shape[0] != len(lengths):  # one input every node reads (an expand is an autograd node)
        x = x.expand(len(lengths), -1)
    if tree_lstm.fused(*xs):
        return tree_lstm.child_sum(x, children[0] if children else None, lengths, w_iou, u_iou,
                                   w_f, u_f, b_iou, b_f)
    iou = kernels.linear(x, w_iou.squeeze(0), b_iou.squeeze(0))
    if not children:  # no node of the batch has children
        return _finish(iou, None)
    # Every child of every node, flat; sums over each node's children are segment sums.
    h, c = _split(children[0].expand(int(lengths.sum()), -1), shape[0] // 2)
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.from_numpy(lengths))
    rows = rows.to(h.device)
    h_sum = h.new_zeros(len(lengths), h.shape[1]).index_add(0, rows, h)
    iou = iou + kernels.linear(h_sum, u_iou.squeeze(0))
    fx = kernels.linear(x, w_f.squeeze(0), b_f.squeeze(0))
    f = torch.sigmoid(fx.index_select(0, rows) + kernels.linear(h, u_f.squeeze(0)))
    return _finish(iou, h.new_zeros(len(lengths), h.shape[1]).index_add(0, rows, f * c))


TREE_LEAF = Op("tree_lstm_leaf", _tree_leaf_kernel)
TREE_NARY = Op("tree_lstm_nary", _nary_kernel)
# Its parameters, without and with the node's own input x.
_NARY_PARAMS = {False: ("U_iou", "U_f", "b_iou", "b_f"),
                True: ("U_iou", "U_f", "b_iou", "b_f", "W_iou")}
# The children are the op's list: one batch whatever their number (0..k).
CHILD_SUM_PARAMS = ("W_iou", "U_iou", "W_f", "U_f", "b_iou", "b_f")
TREE_CHILD_SUM = ops.RaggedOp("tree_lstm_child_sum", _child_sum_kernel,
                              fixed=1 + len(CHILD_SUM_PARAMS))


class TreeLSTMCell(FusedModule):
    """Tree-LSTM cells (Tai et al. 2015): N-ary (ordered children) or child-sum.

    `leaf` and a call return a `State`: read its output `state.h` and memory cell `state.c` by
    name (it does not unpack). Children are States; make one from your own vectors with
    `State.of(h=..., c=...)` (a tuple is refused: Tree-LSTM code orders it either way).

    N-ary: `leaf(x)` computes i, o, u from a word vector; `cell(children, x=None)` computes
    i, o, u from `[h_1; ...; h_N]` (and x if given) and one forget gate per child position:
        f_k = sigmoid(U_f[k] h_k + b_f),  c = i*u + sum_k f_k*c_k,  h = o*tanh(c).
    Child-sum: any number of children, x required:
        i, o, u from W x + U sum_k h_k + b;  f_k = sigmoid(W_f x + U_f h_k + b_f).
    """

    def __init__(self, input_size: int, hidden_size: int, arity: int = 2,
                 child_sum: bool = False):
        super().__init__()
        H = self.hidden_size = hidden_size
        # Sizes are plain ints, not read off the parameters per call: inside a graph block
        # every tensor attribute read goes through the capture mode (~2 us).
        self.input_size, self.arity, self.child_sum = input_size, arity, child_sum
        self.W_iou = nn.Parameter(torch.empty(3 * H, input_size))
        self.b_iou = nn.Parameter(torch.empty(3 * H))
        self.b_f = nn.Parameter(torch.empty(H))
        if child_sum:
            self.U_iou = nn.Parameter(torch.empty(3 * H, H))
            self.W_f = nn.Parameter(torch.empty(H, input_size))
            self.U_f = nn.Parameter(torch.empty(H, H))
        else:
            self.U_iou = nn.Parameter(torch.empty(3 * H, arity * H))
            self.U_f = nn.Parameter(torch.empty(arity, H, H))
        _uniform(self, H)
        hc, x = (2 * H,), (input_size,)
        if child_sum:  # the children's [h; c] follow the parameters, out of the signature
            self._child_sum = _core.FusedSpec(TREE_CHILD_SUM, CHILD_SUM_PARAMS, (x,), hc,
                                              child_shape=hc, state=State)
        else:
            self._leaf = _core.FusedSpec(TREE_LEAF, ("W_iou", "b_iou"), (x,), hc, state=State)
            # Without and with the node's own input x.
            self._nary = {with_x: _core.FusedSpec(TREE_NARY, _NARY_PARAMS[with_x],
                                                  (hc,) * arity + (x,) * with_x, hc,
                                                  (arity, with_x), states=arity, state=State)
                          for with_x in (False, True)}

    @_core.own_time
    def leaf(self, x: Operand) -> State:
        if self.child_sum:
            return self.forward([], x)
        return _core.fused(self, self._leaf, (x,))

    def forward(self, children: Sequence[State], x: Operand | None = None) -> State:
        if self.child_sum:
            if x is None:
                raise ValueError("TreeLSTMCell(child_sum=True) needs the node's input x")
            return _core.fused(self, self._child_sum, (x, *children))
        if len(children) != self.arity:
            raise ValueError(f"TreeLSTMCell(arity={self.arity}) got {len(children)} children")
        if x is None:
            return _core.fused(self, self._nary[False], children)
        return _core.fused(self, self._nary[True], (*children, x))

    __call__ = _core.own_time(forward)
