"""flybatch: write the computation for ONE instance; flybatch batches many on the fly.

    with fb.Graph() as g:
        losses = [model(x) for x in minibatch]   # plain Python per instance: loops, recursion
        loss = fb.esum(losses)
        loss.backward()                          # one batched forward, one batched backward
"""

try:
    from . import _core  # noqa: F401  (the compiled core: the stages below call into it)
except ImportError as error:
    raise ImportError("the compiled core of flybatch is not built: run `pip install -e .` "
                      "(needs a C++17 compiler)") from error
from .errors import ExecutionError, GraphError, ShapeError
from .graph import Expression, Graph, current_graph, new_graph
from .ops import (abs, add, affine, attention, average, cdiv, cmult, concat, div, dot, dropout,
                  emax, esum, exp, input, log, log_softmax, logistic, logsumexp, lookup, matmul,
                  mean_elems, mul, neg, ones, parameter, pick, pick_neg_log_softmax, rectify,
                  relu, reshape, sigmoid, slice_rows, softmax, sqrt, square, squared_distance,
                  squared_norm, stack, sub, sum_elems, tanh, transpose, zeros)
from .stats import Stats
from .concurrent import MapBatchedError, map_batched
from . import nn  # noqa: E402  (needs the ops above)
from . import capture  # noqa: E402,F401  (torch calls on expressions become nodes)
from . import distributed  # noqa: E402  (fb.distributed: data-parallel training)

__all__ = [
    "ExecutionError", "Expression", "Graph", "GraphError", "ShapeError", "Stats", "abs", "add", "affine", "average",
    "attention", "cdiv", "cmult", "concat", "current_graph", "div", "dot", "dropout", "emax",
    "esum", "exp", "input", "log", "log_softmax", "logistic", "logsumexp", "lookup", "matmul",
    "mean_elems", "mul", "neg", "new_graph", "nn", "ones", "parameter", "pick",
    "pick_neg_log_softmax", "rectify", "relu", "reshape", "sigmoid", "slice_rows", "softmax",
    "sqrt", "square", "squared_distance", "squared_norm", "stack", "sub", "sum_elems", "tanh",
    "transpose", "zeros", "MapBatchedError", "map_batched",
]
