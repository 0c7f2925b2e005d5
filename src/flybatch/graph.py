"""The lazy per-instance graph: a struct-of-arrays node store and the handles users hold.

Creating a node does no torch work: it appends the op, its argument node ids, the inferred shape,
the interned signature and the depth to the columns of the compiled node store (`_core.Store`,
csrc/store.cpp, which `Graph` subclasses) and returns an `Expression` handle (a C object).
A forward (asked for by `value()`, `backward()` or `Graph.forward`) schedules every pending node
(`scheduling.py`) and runs the schedule as batched kernels (`execution.py`). Node ids are
creation order, which is a topological order, so "pending" is simply `ids >= n_done`.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import numbers
import struct
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from . import _core, execution, projection, scheduling, signatures, weight_grads
from .errors import GraphError, ShapeError

Shape = tuple[int, ...]
STRATEGIES = ("none", "depth", "agenda", "auto")


@dataclass(frozen=True, eq=False)
class Op:
    """An operation: its batched kernel and how the executor should feed it.

    `kernel(xs, attr, shape)` gets one tensor per argument position with the batch in dim 0
    (dim 0 may be 1 when every node of the batch shares that argument: a parameter, an interned
    constant), the first node's attr (with `per_node_attrs`: that attr and an int64 array of
    each node's int, its index or row, kept by the store without a Python object per node) and
    the per-instance output shape; it returns `[B, *shape]` (or `[1, *shape]`, expanded by the executor).
    Variadic ops with at least `stack_from` arguments of equal shape get ONE stacked argument
    `[B, k, *shape]` gathered in a single copy instead of k separate ones (with fewer too,
    unless some argument position is a zero-copy view: see csrc/execute.cpp).
    """

    name: str
    kernel: Callable[..., torch.Tensor] | None = None
    leaf: bool = False
    per_node_attrs: bool = False  # the rules give each node an int (pick's index, lookup's row)
    stack_from: int | None = None
    ragged: bool = False  # variadic, any arity in one batch: ONE flat argument, attr = arities
    # Lengths differ in one batch: its rule may leave the leading dim of the first argument (a
    # vector's length, a matrix's rows) out of the signature (csrc/rules.cpp says when). The executor pads each argument to
    # the longest of its column (with zeros) and calls `kernel(xs, attr, shape, lengths)`, with
    # each node's length of its first argument (None when they are equal: nothing is padded);
    # the kernel masks what the padding would change, and leaves zeros in the padding of a
    # result whose length varies (stored padded: each node keeps its own shape).
    padded: bool = False
    # A padded op whose lengths are its nodes' own, not their first arguments' (elementwise ops,
    # whose first operand may be a broadcast row or a scalar).
    result_length: bool = False
    cheap: bool = False  # tie-break of the agenda: cheap ops first, as DyNet does
    # The kernel is `x[i]` of each node's one input (pick): the executor runs it as ONE index
    # of the batch result the inputs live in, instead of first copying every node's whole input
    # (a pick of step t of a sequence's (n, H) result would copy the (n, H) per step).
    picks_from_input: bool = False
    # The rule family of csrc/rules.cpp (shape rule and signature) when `_core.Rule(op)` creates
    # its nodes; None for ops added by `Graph.add` (leaves, reshape, dropout...).
    rule: str | None = None

    def __repr__(self) -> str:
        return f"Op({self.name})"


def _input_kernel(graph: "Graph", nodes: Sequence[int]) -> torch.Tensor:
    stacked = torch.stack([graph.attr_of(n) for n in nodes])
    # Integer and bool inputs (index tensors, class targets) keep their dtype: their nodes have a
    # signature of their own (see `Graph.input_node`), so they never share a batch with floats.
    if stacked.is_floating_point():
        return stacked.to(graph.device, graph.dtype)
    return stacked.to(graph.device)


def _index_input_kernel(graph: "Graph", nodes: Sequence[int]) -> torch.Tensor:
    first = nodes[0]
    ints = torch.from_numpy(np.frombuffer(graph.indices(nodes), np.int64))
    return ints.to(graph.device, graph.node_dtypes[first]).reshape(len(nodes),
                                                                  *graph.shape_of(first))


def _parameter_kernel(graph: "Graph", nodes: Sequence[int]) -> torch.Tensor:
    (node,) = nodes  # a parameter is one node per graph, never batched with another
    return graph.parameter_value(node).unsqueeze(0)


class ParameterView:
    """`parameter[key]` with a constant key (a Tree-LSTM's `U_f[0]`), taken when the forward
    runs: the node of such a view is a parameter node of its own, one per graph, so that every
    product with it batches as a product with a shared weight."""

    __slots__ = ("parameter", "key")

    def __init__(self, parameter: torch.Tensor, key: Any):
        self.parameter, self.key = parameter, key

    def __call__(self) -> torch.Tensor:
        return self.parameter[self.key]


def _filled_kernel(value: float) -> Callable[["Graph", Sequence[int]], torch.Tensor]:
    def kernel(graph: "Graph", nodes: Sequence[int]) -> torch.Tensor:
        shape = (len(nodes),) + graph.shape_of(nodes[0])
        return torch.full(shape, value, device=graph.device, dtype=graph.dtype)

    return kernel


INPUT = Op("input", _input_kernel, leaf=True)
# A one-element integer input (a class label, a row number: `torch.tensor([label])`): its value
# is the node's per-node int, so the graph keeps no tensor per node and a batch of them is made
# from the ints in one call.
INDEX_INPUT = Op("input", _index_input_kernel, leaf=True, per_node_attrs=True)
_INDEX_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})
PARAMETER = Op("parameter", _parameter_kernel, leaf=True)
ZEROS = Op("zeros", _filled_kernel(0.0), leaf=True)
ONES = Op("ones", _filled_kernel(1.0), leaf=True)


class Expression(_core.Expression):
    """A handle on one node of a graph. Nothing is computed until a value is asked for.

    The handle itself (`graph`, `id`, `shape`) is the compiled core's: creating one costs
    tens of nanoseconds and no __dict__. `Expression(graph, node)` makes one by hand.
    """

    __slots__ = ()

    @property
    def op(self) -> str:
        return self.graph.op_of(self.id).name

    def value(self) -> torch.Tensor:
        """This node's value, running one batched forward over every pending node if needed."""
        return self.graph.value_of(self.id)

    # The peeks below work on the value with the capture of torch calls off (capture/):
    # inside `with fb.Graph()` a `.detach()` of a value that requires grad would be recorded.
    # The value is asked for first, with capture on: the request may suspend this instance of
    # `map_batched`, and torch's switch is per thread, so a switch held across the suspension
    # would turn capture off in the instances that run meanwhile.
    def _peek(self) -> torch.Tensor:
        value = self.value()
        with _no_capture():
            return value.detach()

    def item(self) -> float:
        value = self._peek()
        with _no_capture():
            return value.item()

    def numpy(self) -> np.ndarray:
        value = self._peek()
        with _no_capture():
            return value.cpu().numpy()

    def argmax(self) -> int:
        value = self._peek()
        with _no_capture():
            return int(value.argmax())

    def backward(self, gradient: Any = None, retain_graph: bool | None = None,
                 create_graph: bool = False, inputs: Sequence[torch.Tensor] | None = None
                 ) -> None:
        """Accumulate d(this)/d(leaf) into every leaf's `.grad`, as `Tensor.backward` does
        (`gradient` for a non-scalar, `inputs` to restrict the leaves, `create_graph`).

        Instances batched together share their kernels' autograd nodes, so a backward per
        instance must not free them: the graph keeps them until it closes (`retain_graph=False`
        frees them at once, when this is the graph's last backward). As eagerly, a second
        backward of the same expression raises unless the first had `retain_graph=True`.
        """
        self.graph.backward([self], None if gradient is None else [gradient],
                            retain_graph=retain_graph, create_graph=create_graph, inputs=inputs)

    def __float__(self) -> float:
        value = self._peek()
        with _no_capture():
            return float(value)

    def __int__(self) -> int:
        value = self._peek()
        with _no_capture():
            return int(value)

    def __bool__(self) -> bool:
        value = self._peek()
        with _no_capture():
            return bool(value)

    # Comparisons of a scalar ask for the value (so control flow can depend on it) and give
    # torch's 0-d bool tensor of it (`~(s > t)`, `(s > t).float()`, `torch.where(s > t, ...)`
    # as eagerly; a Python bool would make `~` -1 or -2); capture/ makes those of a larger
    # expression elementwise masks, and `==` / `!=` elementwise (the hash stays identity, as
    # a tensor's: expressions are dict keys and set members).
    def __lt__(self, other: Any) -> torch.Tensor:
        a, b = self._peek(), _plain(other)
        with _no_capture():
            return a < b

    def __le__(self, other: Any) -> torch.Tensor:
        a, b = self._peek(), _plain(other)
        with _no_capture():
            return a <= b

    def __gt__(self, other: Any) -> torch.Tensor:
        a, b = self._peek(), _plain(other)
        with _no_capture():
            return a > b

    def __ge__(self, other: Any) -> torch.Tensor:
        a, b = self._peek(), _plain(other)
        with _no_capture():
            return a >= b

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        state = "done" if self.id < self.graph.n_done else "pending"
        return f"Expression(#{self.id} {self.op} {self.shape}, {state})"


# Flybatch's own tensor work (values, inputs, kernels) runs with the capture of torch calls off.
_no_capture = torch._C.DisableTorchFunction


def _plain(x: Any) -> Any:
    return x._peek() if isinstance(x, Expression) else x


class Graph(_core.Store):
    """A computation graph that batches the nodes of many instances on the fly.

    Use it as a context manager to make it current (in this thread or task only); leaving the
    outermost `with` block closes it and frees its values (expressions of a closed graph raise
    `GraphError`).

    Its nodes live in the compiled store it subclasses: `add`, `shape_of`, `op_of`, `attr_of`,
    `args_of`, `is_no_grad`, `n_nodes`, `n_done`, and `view(name)`, zero-copy buffers of the
    columns for the scheduler (see `_core.Store.view`).
    """

    def __init__(self, strategy: str = "auto", device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, debug: bool = False):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            # Values and gradients are computed in this dtype: anything else fails only at the
            # first forward, far from the mistake.
            raise TypeError(f"Graph: dtype must be a floating torch dtype (torch.float32, "
                            f"torch.float64, ...), got {dtype!r}")
        self.strategy = strategy
        self.device = torch.device(device) if device is not None else None
        # Without `dtype`, the first floating parameter or input tensor met fixes it, as the
        # first one fixes the device (see `dtype`).
        self._dtype = dtype
        # dtypes of the nodes that are not of the graph's floating dtype (integer inputs, the
        # indices of a captured `topk`...): node -> dtype, written by `set_node_dtype` (which
        # marks the node for the compiled core too).
        self.node_dtypes: dict[int, torch.dtype] = {}
        # Plain tensors written in place with expressions by captured torch code
        # (`buffer[i] = h`): id -> (tensor, the expression now standing for it). See
        # capture/inplace.py.
        self.shadows: dict[int, tuple[torch.Tensor, "Expression"]] = {}
        # The storages (data pointers) of the shadowed tensors: another tensor object of one of
        # them (`E.weight` after a write into `E.weight.data`) reads the write (write_through).
        self.shadow_storages: set[int] = set()
        # In-place writes into expressions (`h += x` rebinds h's handle, capture/inplace.py):
        # (old node, first node of the write, its last node, function), and, worked out before the
        # next forward, the nodes that eagerly share storage with what was written (its old
        # node and the views around it), which would show the write: reading one after it
        # raises (`_refuse_stale_reads`). node -> (the write's last node, its function).
        self.writes: list[tuple[int, int, int, Callable]] = []
        self.overwritten: dict[int, tuple[int, Callable]] = {}
        self._stale_arrays: tuple[np.ndarray, np.ndarray] | None = None  # sorted nodes, points
        # The node store is the compiled base class, with this graph's signature table
        # (`sig_ids`: key -> int, and `sig_keys`: int -> key, which stays after close so that
        # `stats()` can still describe the launches).
        self.tags: dict[int, tuple] = {}  # id(obj) -> (obj, its tag, ...): signatures.remember
        self._leaf_nodes: dict[Any, int] = {}  # parameters and interned constants, one node each
        # `W[i]` of a 2-D parameter is, eagerly, a view of its row: a write into W in place is
        # seen by every later use of it. Here it is a lookup (all rows of a table batch into
        # one call), so its computed row is brought up to date after such a write: storage of
        # the table -> (node, the table's tensor when the row was taken, row).
        self.row_views: dict[int, list[tuple[int, torch.Tensor, int]]] = {}
        # Execution state: node -> (batch, row) of `values` lives in the store's node_batch and
        # node_row columns, filled by the scheduler; nodes below `n_done` (a store field) are
        # computed.
        self.forward_ends: list[int] = []  # n_done after each forward: depth is per segment
        self.values: list[torch.Tensor | None] = []  # None: deferred (below), until read
        # Batches that a forward left uncomputed, since no reader needed them then (a concat
        # whose product took projections instead): batch -> what computing it needs
        # (execution._Deferred). `result` computes one when something reads it.
        self.deferred: dict[int, Any] = {}
        # The batches whose result may be stored padded (rows longer than some nodes' shapes:
        # a padded op's nodes of different lengths); a value read from one is narrowed.
        self.padded: set[int] = set()
        live_graphs.add(self)
        self.sinks: dict[int, Any] = {}  # batch -> its gradient sink (execution._GradientSink)
        # Projections of earlier results by shared weights (projection.py): what a product of a
        # concat of such results reads instead of multiplying.
        self.projections = projection.Projections()
        # The shared weights' gradients, each deferred to one product (weight_grads.py).
        self.weight_grads: dict[tuple, Any] = {}
        # Nodes whose backward ran without `retain_graph=True`: a second one raises, as eagerly
        # (it would silently add the gradients again; see `backward`).
        self.backward_done: set[int] = set()
        self.launches: list[tuple[int, int]] = []  # (signature, size) per non-leaf kernel
        self.gathers = 0
        self.gathers_avoided = 0
        # Seconds spent inside batch kernels, summed over forwards, when a benchmark asks for
        # it by setting 0.0 (None: off, so a forward pays no clock read per batch). A forward's
        # time minus its kernels' is flybatch's fixed cost per forward (issue 10).
        self.kernel_seconds: float | None = None
        self.forwards = 0  # forwards that executed pending nodes (map_batched counts rounds by it)
        self.seconds = {"build": 0.0, "schedule": 0.0, "forward": 0.0, "backward": 0.0}
        # Set by `map_batched`: called before a value request forces a forward, so that the
        # instance can wait until every other instance has asked too.
        self.before_value_request: Callable[[], None] | None = None
        self.parameter_nodes: list[int] = []  # re-read by every forward (see execution.run)
        # parameter node -> (the tensor it reads, its data_ptr and shape when last read)
        self.parameter_reads: dict[int, tuple[torch.Tensor, int, torch.Size]] = {}
        # (len(tags), the storages of the tensors among them) when `reads_later` last looked
        self._read_storages: tuple[int, set[int]] | None = None
        # With `debug=True`, node -> "file:line: code" of the user's line that wrote it, so a
        # kernel failure can point there.
        self.origins: dict[int, str] | None = None
        if debug:
            self.origins = {}
            self.origin_hook = self._record_origin
        self._mark_idle()
        # One token per open `with` block (re-entering nests, in one context or several): each
        # exit restores the graph that was current before its entry, and only the last one
        # closes the graph.
        self._entries: list[contextvars.Token] = []
        self.map_batched_runs = 0  # `map_batched` calls running on this graph (see new_graph)

    @property
    def dtype(self) -> torch.dtype:
        """The floating dtype values and gradients are computed in. Given to the constructor,
        or fixed by the first floating parameter or input tensor met; torch's default dtype if
        something needs it before either."""
        if self._dtype is None:
            self._dtype = torch.get_default_dtype()
        return self._dtype

    def _meet_dtype(self, tensor: torch.Tensor) -> None:
        """The first floating tensor met fixes the graph's dtype; a later input that the
        graph's dtype cannot hold exactly (float64 values in a float32 graph) is refused: it
        would be rounded silently, where eager torch computes in the wider type or raises."""
        if not tensor.is_floating_point():
            return
        if self._dtype is None:
            self._dtype = tensor.dtype
        elif torch.promote_types(tensor.dtype, self._dtype) != self._dtype:
            raise TypeError(f"input: a {tensor.dtype} tensor of shape {tuple(tensor.shape)} in a "
                            f"{self._dtype} graph would be rounded to {self._dtype}; pass "
                            f"dtype={tensor.dtype} to fb.Graph or convert the tensor")

    # ---- node creation -------------------------------------------------------------------
    # `add(op, args, shape, sig_key, attr=None)` is the store's (csrc/store.cpp): it appends a
    # node, marking it when written under torch.no_grad(), and returns its Expression.

    def _record_origin(self, node: int) -> None:
        self.origins[node] = _user_line()

    def parameter_node(self, tensor: torch.Tensor) -> int:
        """The one node of `tensor` in this graph, so every use of it shares its signature."""
        key = ("parameter", id(tensor))
        node = self._leaf_nodes.get(key)
        if node is None:
            self.check_tensor("parameter", tensor)
            self.write_through(tensor)
            node = self.n_nodes
            self.add(PARAMETER, (), tuple(tensor.shape), ("parameter", node), tensor)
            self._leaf_nodes[key] = node
            self.parameter_nodes.append(node)
            self.set_parameter_tag(node, signatures.tag(self, tensor))
        return node

    def reads_later(self, storages: set[int]) -> bool:
        """Whether one of `storages` (data pointers) is that of a tensor this graph reads when
        its forward runs: a parameter, a constant part of one (`U_f[0]`) or an embedding table
        (inputs are copied at the call instead)."""
        # Those of the graph's tensors, kept while no tensor is added or rebound (`forget`)
        if self._read_storages is None or self._read_storages[0] != len(self.tags):
            with _no_capture():
                held = (obj.parameter if isinstance(obj, ParameterView) else obj
                        for obj, *_ in self.tags.values())
                self._read_storages = (len(self.tags), {
                    t.untyped_storage().data_ptr() for t in held
                    if isinstance(t, torch.Tensor) and not t.is_meta})
        return not storages.isdisjoint(self._read_storages[1])

    def forget(self, tensor: torch.Tensor) -> None:
        """A tensor's requires_grad, data or size was rebound: what the graph remembers of it
        is read again (the store's rules, the storages of `reads_later`)."""
        self._read_storages = None
        super().forget(tensor)

    def shadow(self, target: torch.Tensor, new: "Expression") -> None:
        """Let the plain tensor `target`, written in place with expressions, stand for `new`."""
        self.shadows[id(target)] = (target, new)
        with _no_capture():
            self.shadow_storages.add(target.untyped_storage().data_ptr())

    def write_through(self, tensor: torch.Tensor) -> None:
        """Before `tensor`'s storage is read (an eager torch call, an input copied, a forward
        reading it as a parameter or table): what the graph wrote into ANOTHER tensor object
        of that storage (`E.weight.data[1] = h`, `T.detach().copy_(h)`, which stood for that
        object's new value only) is written into the storage now, as eagerly at its call."""
        if not self.shadows:
            return
        with _no_capture():
            storage = tensor.untyped_storage().data_ptr()
            if not storage or storage not in self.shadow_storages:
                return
            aliases = [key for key, (target, _) in self.shadows.items() if target is not tensor
                       and target.untyped_storage().data_ptr() == storage]
        for key in aliases:
            target, new = self.shadows.pop(key)
            value = self.value_of(self.node_of(new))
            with _no_capture(), torch.set_grad_enabled(value.requires_grad and
                                                       not target.requires_grad):
                target.copy_(value)  # eagerly the write made `target` part of new's history

    def parameter_value(self, node: int) -> torch.Tensor:
        """The tensor of parameter node `node` as of now (a `ParameterView` taken anew)."""
        value = self.attr_of(node)
        return value() if isinstance(value, ParameterView) else value

    def parameter_tensor(self, node: int) -> torch.Tensor:
        """The tensor parameter node `node` reads: the parameter, or the one it is a view of."""
        value = self.attr_of(node)
        return value.parameter if isinstance(value, ParameterView) else value

    def parameter_view_node(self, tensor: torch.Tensor, key: Any, key_id: Any) -> int:
        """The one node of `tensor[key]` in this graph (`key_id`: a hashable form of `key`)."""
        leaf_key = ("view", id(tensor), key_id)
        node = self._leaf_nodes.get(leaf_key)
        if node is None:
            self.check_tensor("parameter", tensor)
            self.write_through(tensor)
            view = ParameterView(tensor, key)  # holds the tensor: its id stays its own
            with _no_capture():
                shape = tuple(view().shape)
            node = self.n_nodes
            self.add(PARAMETER, (), shape, ("parameter", node), view)
            self._leaf_nodes[leaf_key] = node
            self.parameter_nodes.append(node)  # re-read by each forward, as parameters are
            self.set_parameter_tag(node, signatures.tag(self, view))
            if type(key) is int:  # the next `tensor[key]` is found in C (Store.remember_part)
                self.remember_part(tensor, key, node)
        return node

    def note_row_view(self, node: int, table: torch.Tensor, row: int) -> None:
        """Node `node` is `table[row]`, a view of the row in eager torch (see `row_views`)."""
        with _no_capture():  # (detach: the storage it is a view of now, were `.data` rebound)
            held = table.detach()
            self.row_views.setdefault(held.untyped_storage().data_ptr(), []).append(
                (node, held, row))

    def refresh_row_views(self, storages: set[int]) -> None:
        """After an in-place write into the tensors of `storages`: the computed rows taken as
        views of them hold what the views hold now (pending ones read it when they run). As
        eagerly, a use saved for backward before the write then fails its version check."""
        with _no_capture(), torch.no_grad():
            for storage in storages:
                for node, table, row in self.row_views.get(storage, ()):
                    if node < self.n_done:
                        batch, position = self.position(node)
                        self.values[batch][position].copy_(table[row])

    def check_tensor(self, op: str, tensor: torch.Tensor) -> None:
        """A parameter or table must match the graph's dtype and device (the first one fixes
        the device when the graph was given none): mixing them would fail only later, inside
        a batched kernel."""
        self._meet_dtype(tensor)
        if tensor.is_floating_point() and tensor.dtype != self.dtype:
            raise TypeError(f"{op}: a {tensor.dtype} tensor of shape {tuple(tensor.shape)} in a "
                            f"{self.dtype} graph; pass dtype={tensor.dtype} to fb.Graph or "
                            f"convert the tensor")
        if self.device is None:
            self.device = tensor.device
        elif tensor.device != self.device:
            raise ValueError(f"{op}: a tensor of shape {tuple(tensor.shape)} on {tensor.device} "
                             f"in a graph that runs on {self.device}")

    def constant_node(self, kind: str, shape: Shape, value: float = 0.0) -> int:
        """An interned constant (zeros, ones or a scalar): one node however often it is used."""
        # Keyed by the value's bits: 0.0 == -0.0 would share a node (x / -0.0 giving +inf), and
        # NaN != NaN would give every NaN a node of its own.
        key = (kind, shape, struct.pack("d", value))
        node = self._leaf_nodes.get(key)
        if node is None:
            node = self.n_nodes
            if kind == "zeros":
                self.add(ZEROS, (), shape, ("zeros", shape))
            elif kind == "ones":
                self.add(ONES, (), shape, ("ones", shape))
            else:
                # float64 holds the value exactly; the input kernel casts it to the graph's
                # dtype, which this must not fix before a parameter does.
                with _no_capture():
                    value = torch.tensor(value, dtype=torch.float64)
                self.add(INPUT, (), shape, ("input", shape), value)
            self._leaf_nodes[key] = node
        return node

    def input_node(self, tensor: torch.Tensor, keep_grad: bool = False, owned: bool = False) -> int:
        """A per-instance input holding `tensor`'s value AT THIS CALL (as eagerly and in
        DyNet): it is copied unless `owned` (a fresh tensor nobody else can write), so a
        buffer reused afterwards does not change the node. With `keep_grad`, gradient flows
        back into `tensor`'s own autograd history. A one-element integer tensor on the CPU (a
        label, a row number) is kept as the int it holds (`INDEX_INPUT`); a sparse tensor
        holds its dense value."""
        with _no_capture():  # flybatch's own tensor work, not the user's: no capture dispatch
            if tensor.device.type == "meta":
                raise ValueError(f"input: a tensor of shape {tuple(tensor.shape)} on the meta "
                                 "device has no values to compute with")
            shape, dtype = tuple(tensor.shape), tensor.dtype
            # (capture.cpp `index_input` makes the same node for a recorded call's operands,
            # without this Python: keep the two keys alike, or their nodes stop batching.)
            if dtype in _INDEX_DTYPES and tensor.numel() == 1 and tensor.device.type == "cpu":
                node = self.add(INDEX_INPUT, (), shape, ("index input", shape, dtype), None,
                                int(tensor)).id
                self.set_node_dtype(node, dtype)
                return node
            value = tensor if keep_grad else tensor.detach()
            if value.layout != torch.strided:
                # A sparse matrix (a graph's adjacency, `torch.sparse.mm(adj, h)`, `adj @ h`)
                # is its dense value: a batch stacks dense tensors, and the products compute
                # the same values and gradients with it.
                value, owned = value.to_dense(), True
            if not owned:
                value = value.clone()
                self._meet_dtype(tensor)  # a tensor the user made, not one flybatch converted
            floating = tensor.is_floating_point() or tensor.is_complex()
        if floating:
            return self.add(INPUT, (), shape, ("input", shape), value).id
        node = self.add(INPUT, (), shape, ("input", shape, dtype), value).id
        self.set_node_dtype(node, dtype)
        return node

    def dtype_of(self, node: int) -> torch.dtype:
        """The dtype of `node`'s value: the graph's floating dtype unless recorded otherwise."""
        return self.node_dtypes.get(node) or self.dtype

    def _operand(self, x: Any) -> int:
        """The node of an operand that is not an expression (the compiled rules call this):
        a tensor that requires grad and is a leaf is a parameter, any other tensor or ndarray
        an input copied now, a number an interned constant. A plain tensor the graph wrote
        into (`out[t] = h`, `buf.add_(y)`: `shadows`) stands for its new value, whichever op
        reads it."""
        if isinstance(x, torch.Tensor):
            if self.shadows:
                new = self.shadow_of(x)
                if new is not None:
                    return new.id
                self._refuse_stale_view(x)
                self.write_through(x)
            with _no_capture():  # (through the capture mode each attribute costs ~1.4 us)
                requires_grad, leaf = x.requires_grad, x.is_leaf
            if not requires_grad:
                return self.input_node(x)
            # Only leaves that require grad are parameters (one shared node per graph); a
            # computed tensor is a per-instance input whose gradient flows into its history.
            return self.parameter_node(x) if leaf else self.input_node(x, keep_grad=True)
        if isinstance(x, numbers.Real):
            return self.constant_node("scalar", (), float(x))
        if isinstance(x, np.ndarray):
            return self.input_node(torch.tensor(x), owned=True)
        if isinstance(x, Expression):
            return self.node_of(x)
        raise TypeError(f"cannot use {type(x).__name__} as an operand of a flybatch op")

    def shadow_of(self, tensor: torch.Tensor) -> "Expression | None":
        """The expression a plain tensor the graph wrote into now stands for, else None."""
        shadow = self.shadows.get(id(tensor))
        return shadow[1] if shadow is not None and shadow[0] is tensor else None

    def _refuse_stale_view(self, x: torch.Tensor) -> None:
        """A view taken of a plain tensor BEFORE the graph wrote into it (`row = out[1]`, then
        `out[1] = h`) shares the tensor's storage, which does not hold what the graph wrote:
        eagerly it would show the write, here it would silently read the old values."""
        with _no_capture():
            base = x._base
        if base is not None and self.shadow_of(base) is not None:
            raise RuntimeError(
                f"a view of shape {tuple(x.shape)} of a tensor of shape {tuple(base.shape)} "
                "was taken before the graph wrote expressions into that tensor: it still holds "
                "the old values, where eagerly it would show the write. Take the view after "
                "the write (e.g. index the tensor where the view is used)")

    def _refuse_stale_reads(self, start: int, end: int, exprs: Sequence[Expression]) -> None:
        """Before a forward: no node made after an in-place write into an expression reads
        what eagerly shares storage with it (a view taken before the write, or the tensor
        viewed when the write went through a view), and no such node's value is asked for:
        eagerly they would show the write, here they hold the old values."""
        if self._stale_arrays is None:
            nodes = np.fromiter(self.overwritten, dtype=np.int64)
            order = np.argsort(nodes)
            points = np.fromiter((p for p, _ in self.overwritten.values()), dtype=np.int64)
            self._stale_arrays = nodes[order], points[order]
        nodes, points = self._stale_arrays
        arg_ptr = np.frombuffer(self.view("arg_ptr"), dtype=np.int64)
        arg_flat = np.frombuffer(self.view("arg_flat"), dtype=np.int64)
        first = max(start, int(points.min()) + 1)
        reads = arg_flat[arg_ptr[first]:arg_ptr[end]]
        hits = np.nonzero(np.isin(reads, nodes))[0]
        if len(hits):
            readers = np.searchsorted(arg_ptr, hits + arg_ptr[first], side="right") - 1
            late = readers > points[np.searchsorted(nodes, reads[hits])]
            for k in np.nonzero(late)[0].tolist():
                reader, node = int(readers[k]), int(reads[hits[k]])
                if self._sums_the_written_value(reader, node):
                    continue
                where = (self.origins or {}).get(reader) or \
                    "(fb.Graph(debug=True) names the line)"
                self._stale(node, f"a {self.op_of(reader).name} node {where}")
        for e in exprs:
            if isinstance(e, Expression) and e.graph is self and e.id in self.overwritten:
                self._stale(e.id, "a value request")

    def _sums_the_written_value(self, reader: int, node: int) -> bool:
        """Whether `reader` reads the written node `node` only as a term of its new value: a
        scalar `loss + x` after `loss += y` is one esum of the new value's terms (`y` and the
        node written), which adds what eagerly is in the tensor after the write."""
        point = self.overwritten[node][0]
        terms = self.args_of(point)
        return (self.op_of(reader).name == "esum" and node in terms
                and self.args_of(reader)[:len(terms)] == terms)

    def _stale(self, node: int, reader: str) -> None:
        point, func = self.overwritten[node]
        written = f"Tensor.{func.__name__} (shape {self.shape_of(point)})"
        raise RuntimeError(
            f"{reader} reads an expression of shape {self.shape_of(node)} that shares storage, "
            f"eagerly, with an expression later written in place by {written}: eagerly it "
            "would show the write, here it holds the old values. Take the view again after the "
            "write, or write out of place (`h = h + x` for `h += x`)")

    def _lookup_tag(self, table: torch.Tensor) -> tuple:
        """The tag of an embedding table in this graph, checked once (the compiled lookup rule
        keeps it until close)."""
        self.check_tensor("lookup", table)
        if self.shadows:
            self.write_through(table)
        return signatures.tag(self, table)

    def node_of(self, x: Expression) -> int:
        """The node id of `x`, checking that it belongs to this (open) graph."""
        # A tensor among forward's or backward's expressions is caught by its missing
        # attribute, not by an isinstance check each call (a parser's step reads dozens).
        try:
            graph = x.graph
        except AttributeError:
            raise TypeError(f"{type(x).__name__} is not a flybatch expression; make a tensor "
                            "one with fb.parameter(t) or fb.input(t)") from None
        if graph is not self:
            if graph.closed:
                raise GraphError(f"{x!r} belongs to a closed graph; expressions cannot outlive "
                                 "their graph (create them in the current graph)")
            raise GraphError(f"{x!r} belongs to another graph; one op cannot mix two graphs")
        return x.id

    # ---- evaluation ----------------------------------------------------------------------
    @_core.own_time  # reading the values back after the forward is flybatch's part of a build
    def forward(self, exprs: Iterable[Expression] | None = None,
                stack: bool = False) -> list[torch.Tensor] | torch.Tensor | None:
        """Run every pending node as batched kernels; return the values of `exprs` if given:
        a list, or with `stack=True` ONE tensor `[len(exprs), *shape]` (the expressions must
        share a shape), read from the batch results in one call rather than one per
        expression (a parser reading 64 scores per step: ~7 us instead of ~130 for
        `torch.stack` of the list).

        The graph may keep growing afterwards: the next forward runs only the new nodes and
        reads the earlier results where it needs them (incremental forward).
        """
        self._check_open()
        start, end = self.n_done, self.n_nodes
        if self.writes:
            from .capture import sharing_storage  # (the capture package builds on this)
            self.overwritten.update(sharing_storage(self, self.writes))
            self.writes, self._stale_arrays = [], None
        if self.overwritten:
            if exprs is not None and not isinstance(exprs, (list, tuple)):
                exprs = list(exprs)
            self._refuse_stale_reads(start, end, exprs or ())
        if end > start:
            now = self._count_build()
            self._grow_positions(end)
            n_batches, n_launches = len(self.values), len(self.launches)
            counters = (self.gathers, self.gathers_avoided)
            try:
                schedule = scheduling.schedule(self, start, end)
                t1 = time.perf_counter()
                self.seconds["schedule"] += t1 - now
                # A forward computes the same autograd graph whatever the grad mode of the code
                # that asked for a value (a peek under no_grad or inference_mode): each node's
                # own mode decides; and in the precision of the nodes' recording whatever
                # autocast region asked (calls recorded inside one raise). Kernels are plain
                # torch: the capture of torch calls (capture/) is off (first, so that
                # switching grad mode on is not itself dispatched to it).
                with torch._C.DisableTorchFunction(), self._kernel_modes(), \
                        weight_grads.deferring(self.weight_grads):
                    execution.run(self, schedule)
                self.seconds["forward"] += time.perf_counter() - t1
            except BaseException:
                # Leave nothing half-executed: the pending nodes stay pending, so the graph is
                # exactly as it was before this forward and a later forward can retry.
                del self.values[n_batches:]
                for batch in [b for b in self.deferred if b >= n_batches]:
                    del self.deferred[batch]
                del self.launches[n_launches:]
                self.gathers, self.gathers_avoided = counters
                self.unschedule(start, n_batches)
                self._mark_idle()
                raise
            self.n_done = end
            self.forward_ends.append(end)
            self.forwards += 1
            self._mark_idle()
        if exprs is None:
            return None
        if stack:
            exprs = exprs if isinstance(exprs, (list, tuple)) else list(exprs)
            found = self.stacked_rows(exprs)  # rows of one batch result (the common case)
            if found is not None:
                return self._batch_rows(*found, exprs)
            return self._stacked([self.node_of(e) for e in exprs])
        nodes = [self.node_of(e) for e in exprs]
        # One at a time: a node made by a generator given as `exprs`, or a row of a result
        # stored padded (narrowed to the node's shape).
        if self.padded or any(node >= self.n_done for node in nodes):
            return [self.value_of(node) for node in nodes]
        values, position = self.values, self.position
        with _no_capture(), torch.enable_grad():  # once for all rows (a parser: 64 per step)
            if self.deferred:
                return [self.result(batch)[row] for batch, row in map(position, nodes)]
            return [values[batch][row] for batch, row in map(position, nodes)]

    def result(self, batch: int) -> torch.Tensor:
        """The result of batch `batch` (of `values`), computed now if its forward deferred it."""
        value = self.values[batch]
        if value is None:
            with self._kernel_modes():
                value = execution.compute_deferred(self, batch)
        return value

    def _kernel_modes(self) -> contextlib.AbstractContextManager:
        """Grad mode on, inference mode and autocast off, for the kernels; nothing to enter
        in the common case (the three context managers cost ~4% of a small forward), and only
        grad mode to switch under no_grad (an evaluation loop's forwards)."""
        if not torch.is_inference_mode_enabled() and not torch._C._is_any_autocast_enabled():
            return _NOTHING if torch.is_grad_enabled() else _GRAD_ON
        modes = contextlib.ExitStack()
        modes.enter_context(torch.inference_mode(False))
        modes.enter_context(torch.enable_grad())
        if torch._C._is_any_autocast_enabled():
            modes.enter_context(
                torch.autocast(self.device.type if self.device else "cpu", enabled=False))
        return modes

    def _batch_rows(self, batch: int, first: int, rows: bytearray | None,
                    exprs: Sequence[Expression]) -> torch.Tensor:
        """The values of `exprs`, rows of batch result `batch` (`Store.stacked_rows`), as one
        tensor: a view of it when they are its rows first, first + 1, ... in order, else one
        index_select of the rows numbered in `rows`. Read with grad mode on, entered only where
        it is off (`torch.enable_grad()` costs ~1 us, a parser's every forward)."""
        with _no_capture(), _NOTHING if torch.is_grad_enabled() else _GRAD_ON:
            source = self.result(batch)
            if batch in self.padded:  # rows as long as the longest node's: the nodes' length
                source = source.narrow(1, 0, exprs[0].shape[0])
            if rows is None:
                return source[first:first + len(exprs)]  # (a slice: faster than narrow)
            index = torch.frombuffer(rows, dtype=torch.int64).to(source.device)
            return source.index_select(0, index)

    def _stacked(self, nodes: list[int]) -> torch.Tensor:
        """The values of `nodes` that are not rows of one batch result (`_batch_rows`), or that
        are pending (made by a generator given as `exprs`), as one stacked tensor."""
        shapes = {self.shape_of(node) for node in nodes}
        if len(shapes) != 1:
            raise ShapeError("forward(stack=True) needs expressions of one shape, got "
                             + (", ".join(map(str, sorted(shapes))) if shapes else "none"))
        rows = [self.value_of(node) for node in nodes]
        with _no_capture(), torch.enable_grad():
            return torch.stack(rows)

    def value_of(self, node: int) -> torch.Tensor:
        self._check_open()
        if node >= self.n_done:
            if self.before_value_request is not None:
                self.before_value_request()
            if node >= self.n_done:
                self.forward()
        batch, row = self.position(node)
        # The row keeps the node's autograd history whatever the caller's grad mode, as an
        # eager tensor does (`backward()` under `torch.no_grad()` of a loss made with grad).
        with _no_capture(), torch.enable_grad():
            value = self.result(batch)[row]
            if batch in self.padded:  # the node's own length of a padded row
                value = value.narrow(0, 0, self.shape_of(node)[0])
            return value

    def backward(self, exprs: Sequence[Expression], gradients: Sequence[Any] | None = None,
                 retain_graph: bool | None = None, create_graph: bool = False,
                 inputs: Sequence[torch.Tensor] | None = None) -> None:
        """`torch.autograd.backward` of expressions: into the `.grad` of the leaves (or of
        `inputs` only), over the batched forward that computed them."""
        values, gradients = self._differentiated(exprs, gradients, inputs)
        start = time.perf_counter()
        with torch._C.DisableTorchFunction():
            # Instances batched together share their kernels' autograd nodes: unless the user
            # asks to free them, they stay for the other instances' backwards.
            torch.autograd.backward(values, gradients, retain_graph=retain_graph is not False,
                                    create_graph=create_graph, inputs=inputs)
        self._done_with(exprs, retain_graph or create_graph, start)

    def grad(self, exprs: Sequence[Expression], inputs: Sequence[torch.Tensor],
             gradients: Sequence[Any] | None = None, retain_graph: bool | None = None,
             create_graph: bool = False, **options: Any) -> tuple[torch.Tensor, ...]:
        """`torch.autograd.grad` of expressions with respect to tensors (parameters, input
        tensors that require grad): plain tensors, with their own history under
        `create_graph=True` (a gradient penalty)."""
        values, gradients = self._differentiated(exprs, gradients, inputs)
        start = time.perf_counter()
        with torch._C.DisableTorchFunction():
            grads = torch.autograd.grad(values, inputs, gradients,
                                        retain_graph=retain_graph is not False,
                                        create_graph=create_graph, **options)
        self._done_with(exprs, retain_graph or create_graph, start)
        return grads

    def _differentiated(self, exprs: Sequence[Expression], gradients: Sequence[Any] | None,
                        inputs: Sequence[torch.Tensor] | None) -> tuple[list, list | None]:
        """The values to differentiate and their gradients (tensors), after the checks eager
        PyTorch makes (a second backward, a non-scalar without a gradient) and those of a
        batched graph (an expression's gradient is never a tensor of its own)."""
        for x in inputs or ():
            if isinstance(x, Expression):
                raise TypeError(f"gradients with respect to a flybatch expression (shape "
                                f"{x.shape}) are not supported: they are computed batched "
                                "with other instances', never as a tensor of its own; take "
                                "them with respect to parameters or input tensors")
        nodes = [self.node_of(e) for e in exprs]
        if any(node in self.backward_done for node in nodes):
            raise RuntimeError(
                "Trying to backward through the graph a second time: this expression's "
                "backward already ran (eager PyTorch raises here too, since the first backward "
                "freed its graph). Pass retain_graph=True to the first backward to accumulate "
                "its gradients twice.")
        values = [self.value_of(node) for node in nodes]
        if gradients is None:
            for e, value in zip(exprs, values):
                if value.dim() != 0:
                    raise ValueError(f"backward() needs a scalar expression or a gradient, got "
                                     f"shape {e.shape}")
            return values, None
        gradients = [self.value_of(self.node_of(x)) if isinstance(x, Expression) else x
                     for x in gradients]
        return values, gradients

    def _done_with(self, exprs: Sequence[Expression], retained: bool | None,
                   start: float) -> None:
        if not retained:
            self.backward_done.update(self.node_of(e) for e in exprs)
        self.seconds["backward"] += time.perf_counter() - start
        self._mark_idle()

    # Build time is what passes between the graph's own work (its forwards and backwards): the
    # user's per-instance Python and flybatch's op calls. While `_core.measure_own_time` is on,
    # the op calls' part is counted too, as seconds["build_flybatch"].
    def _mark_idle(self) -> None:
        self._idle_since = time.perf_counter()
        self._own_since = _core.own_time_ns()

    def _count_build(self) -> float:
        """Adds the build time since the graph was last busy; returns now."""
        now, own = time.perf_counter(), _core.own_time_ns()
        self.seconds["build"] += now - self._idle_since
        if own != self._own_since:
            self.seconds["build_flybatch"] = (self.seconds.get("build_flybatch", 0.0)
                                              + (own - self._own_since) * 1e-9)
        self._idle_since, self._own_since = now, own  # a failed forward counts it only once
        return now

    def _grow_positions(self, n: int) -> None:
        self.grow_positions(n)  # the store's, before scheduling nodes up to n - 1

    @property
    def node_batch(self) -> np.ndarray:
        """The batch (index into `values`) of each scheduled node, -1 for others (read-only)."""
        return np.asarray(self.view("node_batch"))

    @property
    def node_row(self) -> np.ndarray:
        """The row of each scheduled node in its batch's result (read-only)."""
        return np.asarray(self.view("node_row"))

    # ---- lifetime ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise GraphError("this graph is closed and its values were freed; "
                             "ask for values inside its `with` block")

    def close(self, write_back: bool = True, exc: BaseException | None = None) -> None:
        """Free the values (and the autograd graph behind them); further use raises GraphError.
        A plain tensor the graph wrote into (a buffer updated in place in a forward, a running
        mean) first takes its last value, as eagerly it would hold it (`write_back`), with its
        gradient history if the value has one. When the block ends with an error, a write-back
        that fails too (the forward it needs) is given up: the block's error is the one raised."""
        if write_back and self.shadows and not self.closed:
            if exc is None:
                self._write_back()
            else:
                with contextlib.suppress(Exception):
                    self._write_back()
        super().close()
        self.values = []
        self.deferred = {}
        self.padded = set()
        self.sinks = {}
        self.projections = projection.Projections()
        self.weight_grads = {}
        self._leaf_nodes = {}
        self.row_views = {}
        self.tags = {}
        self.shadows = {}
        self.shadow_storages = set()

    def _write_back(self) -> None:
        targets = [target for target, _ in self.shadows.values()]
        values = self.forward([new for _, new in self.shadows.values()])
        with _no_capture():
            for target, value in zip(targets, values):
                # eagerly `buf.copy_(h)` made `buf` part of h's autograd graph
                with torch.set_grad_enabled(value.requires_grad and not target.requires_grad):
                    target.copy_(value)

    def __enter__(self) -> "Graph":
        from . import capture

        self._entries.append(_current.set(self))
        capture.push()  # torch calls on expressions and parameters become nodes of the graph
        return self

    def __exit__(self, *exc: Any) -> None:
        # This block's token is the last one entered in this context; later ones may belong to
        # other tasks or `map_batched` instances inside `with` blocks of this same graph.
        for i in range(len(self._entries) - 1, -1, -1):
            try:
                _current.reset(self._entries[i])
            except ValueError:  # created in another context: not this block's
                continue
            del self._entries[i]
            break
        from . import capture

        held = capture.pop(keep_collector=True)  # (paused until the graph's objects are freed)
        try:
            if not self._entries:
                # (not after KeyboardInterrupt and the like: nothing more should run)
                self.close(write_back=exc[0] is None or issubclass(exc[0], Exception), exc=exc[1])
        finally:
            if held:
                capture.release_collector()

    def stats(self):
        from .stats import collect

        return collect(self)

    def __repr__(self) -> str:
        return (f"Graph(strategy={self.strategy!r}, nodes={self.n_nodes}, "
                f"done={self.n_done}, batches={len(self.launches)})")


class _GradOn:
    """Grad mode on, then off again: `torch.enable_grad()` entered where grad mode is off, less
    its Python layers (an ExitStack of it cost ~9 us a forward, ~1 ms of a parser's evaluation
    minibatch of ~100 forwards under no_grad)."""

    __slots__ = ()

    def __enter__(self) -> None:
        torch._C._set_grad_enabled(True)

    def __exit__(self, *exc_info: object) -> None:
        torch._C._set_grad_enabled(False)


_GRAD_ON = _GradOn()
_NOTHING = contextlib.nullcontext()


def _library_module(name: str) -> bool:
    return any(name == lib or name.startswith(lib + ".") for lib in ("flybatch", "torch"))


def _user_line() -> str:
    """"file:line: code" of the innermost caller outside flybatch and torch (debug mode only):
    the user's line, not the torch function it called (`F.embedding` of a captured module)."""
    frame = sys._getframe(2)
    while frame is not None and _library_module(frame.f_globals.get("__name__", "")):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    info = inspect.getframeinfo(frame, context=1)
    code = info.code_context[0].strip() if info.code_context else ""
    return f"{info.filename}:{info.lineno}: {code}"


# The graph new nodes go to, per thread and per `contextvars` context (an asyncio task, a
# `map_batched` instance): the innermost `with Graph()` there, else that context's default graph.
# A new thread starts with no current graph; a copied context (an asyncio task) shares its
# creator's until it enters or creates a graph of its own, which then stays its own.
_current: contextvars.ContextVar[Graph | None] = contextvars.ContextVar("flybatch_current_graph",
                                                                        default=None)


# Every graph not yet freed: a rebind of a tensor's requires_grad or data inside a graph block
# is reported to each (`capture._forget`, `Store.forget`), whichever graph remembers it.
live_graphs: "weakref.WeakSet[Graph]" = weakref.WeakSet()


def current_graph() -> Graph:
    """The current graph of this thread or task; a fresh default graph if there is none."""
    graph = _current.get()
    if graph is None or graph.closed:
        graph = Graph()
        _current.set(graph)
    return graph


def new_graph(strategy: str = "auto", device: str | torch.device | None = None,
              dtype: torch.dtype | None = None) -> Graph:
    """Close the current default graph and start a fresh one (DyNet's `renew_cg`).

    A graph made current by a `with` block stays open (the block closes it). Inside `map_batched`
    the run's graph cannot be replaced: the other instances are still building in it.
    """
    graph = Graph(strategy, device, dtype)  # first: invalid arguments leave the current one open
    old = _current.get()
    if old is not None and old.map_batched_runs:
        raise GraphError("fb.new_graph() inside fb.map_batched: the current graph is in use by "
                         "the running map_batched (the other instances build in it); start the "
                         "fresh graph before map_batched, or use `with fb.Graph():` inside fn "
                         "for a graph of this instance alone")
    if old is not None and not old._entries:
        old.close()
    _current.set(graph)
    return graph


_core.configure(Expression, GraphError, ShapeError, torch._C.is_grad_enabled, current_graph,
                torch.Tensor, torch._C._is_torch_function_mode_enabled)
