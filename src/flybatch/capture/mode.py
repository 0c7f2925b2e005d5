"""Switching capture on and off (and, while any thread captures, the shortcuts for torch's most
called functions and the cyclic collector paused), and what stays outside it: the calls that
describe a tensor, writes into parameters, an optimizer's step, modules' backward hooks and
buffers."""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Any, Callable

import torch
from torch.distributions import Distribution
from torch.optim import optimizer as _optimizer
from torch.overrides import TorchFunctionMode

from .. import _core
from ..graph import Expression, _current, live_graphs


# ---- switching capture on and off --------------------------------------------------------------
class _Capture(TorchFunctionMode):
    """Records the torch calls that involve the graph; runs every other call as it is.

    Its `__torch_function__` (every torch call in a graph block goes through it) is in C,
    `_core` capture.cpp, installed by dispatch.py: whether a call involves the graph (an expression among
    its operands, a shadowed tensor, written with an expression, or a parameter, under
    `torch.no_grad()` too so that an evaluation batches, but not inside an optimizer's step,
    whose updates are the parameters' own), by the rules of `_DESCRIBE`, `_REBINDS`... below.
    A recorded call goes to `torch_call`, any other runs as `func(*args, **kwargs)`."""


_thread = threading.local()  # torch's mode stack is per thread: so is the depth of `push`


# ---- shortcuts: torch's most called functions straight to the mode ----------------------------
# While any thread captures, these torch functions are rebound to `_core.Shortcut`s of
# themselves (csrc/dispatch.cpp): where capture's mode is the innermost, a call reaches it
# without torch's own dispatch (~0.55 us of a ~0.9 us recorded call) and is recorded or run by
# its rules as it would be; elsewhere it is torch's function as it is. The functions
# per-instance models call most (the list); `from torch import sigmoid` made before
# keeps torch's own, which records the same, slower.
_SHORTCUT_NAMES = {
    torch: ("tensor zeros ones full cat stack tanh sigmoid relu exp log sum mean max min matmul mm "
            "bmm mul add sub div "
            "zeros_like ones_like softmax log_softmax squeeze unsqueeze transpose reshape split "
            "chunk").split(),
    torch.nn.functional: ("linear embedding softmax log_softmax dropout cross_entropy nll_loss "
                          "mse_loss binary_cross_entropy binary_cross_entropy_with_logits "
                          "layer_norm relu tanh sigmoid").split(),
    # `U_f[0]`: a part of a parameter, per node of a Tree-LSTM (an attribute of the class
    # while capture is on; torch.Tensor's own slot is left as it is).
    torch.nn.Parameter: ["__getitem__"],
}
_SHORTCUTS = [(owner, name, getattr(owner, name),
               (_core.MethodShortcut if isinstance(owner, type) else _core.Shortcut)(
                   getattr(owner, name)))
              for owner, names in _SHORTCUT_NAMES.items() for name in names]

# ---- while any thread captures: the shortcuts, and Python's cyclic collector paused ----------
# A graph block makes tens of thousands of objects that live until it ends (expression handles,
# index tensors): each makes the cyclic garbage collector run sooner, and each run walks all of
# them again (a full run, the whole heap of torch's modules too). Paused while a block records
# and until its graph is closed (`pop(keep_collector=True)`, then `release_collector()`: run
# before the close, the first collection walked every handle the graph still held, ~1.3 ms of a
# parser step), the collector runs as due once the last block ends. Cyclic garbage made inside a
# block is collected after it (reference counting frees the rest at once, as always); a
# collector the user turned off stays off.
_process_lock = threading.Lock()
_capturing_threads = 0
_collector_holds = 0  # capturing threads, and graphs closing after their capture ended
_paused_collector = False


def _hold_collector() -> None:  # (under _process_lock)
    global _collector_holds, _paused_collector
    _collector_holds += 1
    if _collector_holds == 1:
        _paused_collector = gc.isenabled()
        gc.disable()


def _release_collector() -> None:  # (under _process_lock)
    global _collector_holds
    _collector_holds -= 1
    if _collector_holds == 0 and _paused_collector:
        gc.enable()


def release_collector() -> None:
    """Ends the collector's pause that `pop(keep_collector=True)` kept (after a graph's close)."""
    with _process_lock:
        _release_collector()


def _process_on() -> None:
    global _capturing_threads
    with _process_lock:
        _capturing_threads += 1
        _hold_collector()
        if _capturing_threads == 1:
            for owner, name, func, shortcut in _SHORTCUTS:
                if getattr(owner, name) is func:  # (leave a name someone else rebound)
                    setattr(owner, name, shortcut)


def _process_off(keep_collector: bool) -> None:
    global _capturing_threads
    with _process_lock:
        _capturing_threads -= 1
        if not keep_collector:
            _release_collector()
        if _capturing_threads == 0:
            for owner, name, func, shortcut in _SHORTCUTS:
                if getattr(owner, name) is shortcut:
                    if isinstance(owner, type) and getattr(owner.__base__, name, None) is func:
                        delattr(owner, name)  # inherited again: the base class's own slot
                    else:
                        setattr(owner, name, func)


def push() -> None:
    """Capture on (nested pushes share one mode; `Graph.__enter__`, `map_batched`)."""
    depth = getattr(_thread, "depth", 0)
    _thread.optimizer_step = False
    if depth == 0:
        _process_on()
        mode = getattr(_thread, "mode", None)
        if mode is None:  # one per thread, kept: a fresh mode per graph leaked ~35 B each
            mode = _thread.mode = _Capture()
        torch.overrides._push_mode(mode)
        _core.set_capture_level(torch._C._len_torch_function_stack())  # (the shortcuts')
        # torch.distributions' argument checks, on by default, read values (`valid.all()`: a
        # forward per distribution made) and refuse an expression as a `log_prob` sample (it is
        # no torch.Tensor): off by default inside a graph, as `set_default_validate_args(False)`
        # turns them off (a distribution made with `validate_args=True` still checks).
        _thread.validate_args = Distribution._validate_args
        Distribution.set_default_validate_args(False)
    _thread.depth = depth + 1


def pop(keep_collector: bool = False) -> bool:
    """Capture off (the last pop of nested pushes). With `keep_collector`, the collector stays
    paused when this was the last pop: returns True, and `release_collector()` must follow."""
    _thread.depth -= 1
    if _thread.depth == 0:
        torch.overrides._pop_mode()
        _core.set_capture_level(0)
        Distribution.set_default_validate_args(_thread.validate_args)
        _process_off(keep_collector)
        return keep_collector
    return False


# Tensor attributes and methods that describe a plain tensor: always run as they are (and
# attribute writes, `__set__`: `W.data = ...`, `p.grad = None` rebind, they compute nothing).
_DESCRIBE = frozenset("""size dim ndimension numel nelement element_size stride storage_offset
    is_contiguous is_floating_point is_complex is_signed data_ptr untyped_storage __len__ __repr__
    __format__ __hash__ __bool__ __int__ __float__ __index__ item tolist numpy __reduce_ex__
    __deepcopy__ requires_grad_ retain_grad register_hook backward __setstate__ __getstate__
    get_device __dlpack__ __array__ is_set_to __contains__ __iter__ __set__ detach to cpu cuda
    type float double half bfloat16 pin_memory share_memory_ __reduce__""".split())
# (detach / to / cpu... of a parameter itself: `state_dict()`, `model.to(...)`, checkpointing
# inside a graph block work on the tensors, as they must; on an expression they are recorded.)
# Those of them that read a tensor's values are recorded on a plain tensor the graph has
# written into (`h[0] = x`, Graph.shadows): its storage does not hold what it now stands for.
# (So do the properties that the write changed: `data`, and whether it now requires grad.)
_SHADOWED_PROPERTIES = frozenset({"data", "requires_grad", "is_leaf"})
_READS_VALUE = frozenset("""__repr__ __format__ __bool__ __int__ __float__ __index__ item tolist
    numpy __reduce_ex__ __deepcopy__ __getstate__ __dlpack__ __array__ __contains__ __iter__
    detach to cpu cuda type float double half bfloat16 pin_memory __reduce__""".split()
                         ) | _SHADOWED_PROPERTIES
assert _READS_VALUE - _SHADOWED_PROPERTIES <= _DESCRIBE
_RECORDED_PROPERTIES = frozenset({"T", "mT", "H", "mH"})  # properties that compute a tensor
# Calls that rebind what the graph's rules remember of a tensor without asking it again
# (whether it is a parameter, an embedding table's size; `Store.forget`). They run as they are.
_REBINDS = frozenset({"requires_grad_", "detach_", "set_", "resize_", "resize_as_"})
_REBOUND_ATTRIBUTES = frozenset({"requires_grad", "data"})  # `p.requires_grad = False`, `.data =`


def _forget(tensor) -> None:
    if isinstance(tensor, torch.Tensor):
        _before_write(tensor)  # what pending nodes read of it is what it holds before
        for graph in list(live_graphs):  # rare: a handful of graphs at most are alive
            if not graph.closed:
                graph.forget(tensor)


def _before_write(target) -> Callable[[], None] | None:
    """Before `target` (a tensor, or a list of them: `torch._foreach_add_`) is written in place
    or rebound (`W.data.copy_(...)`, `W.add_(...)` under no_grad, an optimizer's step, `W.data
    = ...`): parameters and embedding tables are read when a forward runs, so the pending nodes
    of a graph that reads its storage run first, and see what they would have seen eagerly.
    A forward that fails leaves its nodes pending (it raises again at their value request,
    unless this write is the fix: `W.data = W.data.float()`). Returns what to call after an
    in-place write, when a graph holds rows taken as views of the tensor (`Graph.row_views`);
    a rebinding calls nothing after: eager views keep the storage they were taken of."""
    # (through the WeakSet's own set of references: iterating the WeakSet costs ~4 us)
    graphs = [ref() for ref in live_graphs.data]
    graphs = [g for g in graphs if g is not None and not g.closed]
    pending = [g for g in graphs if g.n_done < g.n_nodes]
    viewing = [g for g in graphs if g.row_views]
    if not pending and not viewing:
        return None
    tensors = target if isinstance(target, (list, tuple)) else (target,)
    with torch._C.DisableTorchFunction():
        storages = {t.untyped_storage().data_ptr() for t in tensors
                    if isinstance(t, torch.Tensor) and not t.is_meta}
    storages.discard(0)  # no storage of its own (empty)
    for graph in pending:
        if storages and graph.reads_later(storages):
            with contextlib.suppress(Exception):
                graph.forward()
    viewing = [g for g in viewing if not storages.isdisjoint(g.row_views)]
    if not viewing:
        return None

    def after_write() -> None:
        for graph in viewing:
            if not graph.closed:
                graph.refresh_row_views(storages)
    return after_write


# An optimizer's step inside a graph block updates the parameters themselves: capture stays out
# of it (global step hooks of torch.optim; a step that raised is forgotten at the next push).
def _step_begins(optimizer, args, kwargs) -> None:
    _thread.optimizer_step = True


def _step_ends(optimizer, args, kwargs) -> None:
    _thread.optimizer_step = False


_optimizer.register_optimizer_step_pre_hook(_step_begins)
_optimizer.register_optimizer_step_post_hook(_step_ends)


# A module's backward hooks (`register_full_backward_hook`, `..._pre_hook`, the old
# `register_backward_hook`) would be given one instance's gradients, which a graph computes
# batched: torch would drop them with a warning (or fail inside its hook set-up), so a call of
# such a module inside a graph block is refused, naming it.
def _outside_graphs(get_hooks: Callable) -> Callable:
    """`nn.Module._get_backward_hooks` (or `_pre_hooks`), which a module call asks only when it
    has such hooks, refused inside a graph block."""
    def get(module: torch.nn.Module):
        graph = _current.get()
        if getattr(_thread, "depth", 0) and graph is not None and not graph.closed:
            raise TypeError(f"{type(module).__name__} has backward hooks, which cannot be given "
                            "one instance's gradients inside a graph block (they are computed "
                            "batched); remove them there, or read .grad after backward")
        return get_hooks(module)
    return get


torch.nn.Module._get_backward_hooks = _outside_graphs(torch.nn.Module._get_backward_hooks)
torch.nn.Module._get_backward_pre_hooks = _outside_graphs(torch.nn.Module._get_backward_pre_hooks)


# A module's buffer assigned an expression (`self.running = 0.9 * self.running + 0.1 * y`,
# torch accepts any object with __torch_function__ as a buffer): the buffer becomes a new plain
# tensor that stands for the expression (Graph.shadows), as eagerly it becomes the new tensor,
# and holds its value once the graph closes, instead of an expression that outlives its graph.
_register_buffer = torch.nn.Module.register_buffer


def _register_buffer_of(module: torch.nn.Module, name: str, tensor: Any,
                        persistent: bool = True) -> None:
    if isinstance(tensor, Expression):
        g = tensor.graph
        g.node_of(tensor)  # (a closed graph's expression raises here)
        with torch._C.DisableTorchFunction():
            placeholder = torch.empty(tensor.shape, dtype=tensor.dtype,
                                      device=g.device or torch.device("cpu"))
        g.shadow(placeholder, tensor)
        tensor = placeholder
    return _register_buffer(module, name, tensor, persistent)


torch.nn.Module.register_buffer = _register_buffer_of
