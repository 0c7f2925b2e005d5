"""Torch-native capture: a user's own per-instance PyTorch code, recorded as graph nodes.

Inside `with fb.Graph():` (and in the instances of `fb.map_batched`) a `TorchFunctionMode` sees
every torch call. A call that involves an expression, or, with grad enabled, a tensor that
requires grad (a parameter), becomes a node of the graph; any other call runs eagerly (index
tensors, `torch.zeros(1, H)` for an initial state) and its result is a constant to later calls.
Expressions also carry `__torch_function__`, so torch calls on them are recorded outside `with`
blocks too, and they have the Tensor methods and properties per-instance code uses
(`x.view(1, -1)`, `x.size(0)`, `x.topk(1)`, `x[0, -1]`...), with torch's semantics on the
per-instance shape.

How a call is batched, fastest first:
1. a mapping onto a flybatch op (`tanh`, `+`, `@`, `torch.cat`, `F.dropout`...), one C call;
2. a *direct* batched call: the same torch function on the batch, with the per-instance dims
   shifted past the batch dim (`softmax(x, dim=1)` runs as `softmax(xs, dim=2)`), shared
   parameters passed once (`F.linear`, `F.embedding`, `F.layer_norm`, the RNN cells), or an
   elementwise function on batch tensors aligned for broadcasting;
3. any other function: a *generic* node, its output shape found by running it once on meta
   tensors (cached per signature), its batched kernel `torch.vmap` over the batch (a loop over
   the batch's nodes where vmap has no rule).
A function whose output shape depends on values (`nonzero`, a boolean mask), that returns a
Python value (`tolist`, `equal`) or that draws random numbers (`bernoulli`, `normal`, found by
the meta run: aten's `nondeterministic_seeded` operators) runs on the values, which asks for a
forward (a round of `map_batched`); its result keeps its autograd history, so gradients stay
right, and draws take the random stream in program order, as eagerly.

The signature of a recorded call is (function, the constants of the call, each operand's shape
and dtype, and the node of each shared parameter), so calls batch exactly when one kernel can
compute them all. An augmented assignment to an expression (`h += x`) points its handle at the
new value (`_write_into_expression`); other in-place operations on expressions raise; in-place
writes of expressions into a plain tensor (`outputs[i] = h`) are recorded out of place and the
tensor stands for its new value in the calls that follow (`Graph.shadows`).

The stages, one module each (in the order they build on each other):
- `calls`: how a recorded call is taken apart (operands, template, constants key), its output
  shape from meta tensors, and the facts about operands every stage asks;
- `mode`: switching capture on and off (while any thread captures: the C shortcuts that take
  the most called torch functions straight to the mode, the cyclic collector paused), and what
  stays outside it (describing a tensor, rebinding a parameter, an optimizer's step, backward
  hooks, buffers);
- `argmax`: `ArgmaxIndex`, an int that is also torch's 0-d index tensor;
- `generic`: the generic fallback (vmap over the batch; values for data-dependent calls);
- `direct`: direct batched calls and the plans that make a known call one C append;
- `inplace`: augmented assignments, writes into plain tensors and into parameters;
- `indexing`: `x[...]` and the calls that return pieces;
- `mappings`: the fast mappings onto flybatch ops, and row-wise calls across lengths;
- `losses`, `recurrent`: losses reduced per instance; RNN cells and layers;
- `dispatch`: the table from torch functions to handlers, and the C front end's configuration;
- `tensor_like`: the Tensor methods and properties of expressions, torch.autograd of them;
- `views`: node-free views (`x.unsqueeze(0)`, an embedding row's [1, n]), their reshape nodes.
"""

# (importing `tensor_like` imports every stage: the table is filled, Expression's methods set)
from . import tensor_like, views  # noqa: F401
# what the rest of flybatch uses (and tests reach into)
from .calls import _key, torch_call  # noqa: F401
from .dispatch import _FB_UNARY, _HANDLERS, _PLANNED  # noqa: F401
from .inplace import sharing_storage  # noqa: F401
from .mode import _Capture, _forget, pop, push, release_collector  # noqa: F401
