"""The errors flybatch raises at the user's line, never deep inside a batched kernel."""


class ShapeError(ValueError):
    """An op was given operands whose shapes do not fit; raised when the node is created."""


class GraphError(RuntimeError):
    """An expression was used where it cannot be: a closed graph, or two graphs mixed."""


class ExecutionError(RuntimeError):
    """A batched kernel failed on something only the forward could see (e.g. a table that
    shrank after a lookup was written). The message names the op, its signature and the nodes
    (and, for a graph made with `debug=True`, the lines that wrote them); `__cause__` is the
    error torch raised."""
