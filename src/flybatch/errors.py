"""The errors flybatch raises at the user's line, never deep inside a batched kernel."""


class ShapeError(ValueError, RuntimeError):
    """An op was given operands whose shapes do not fit; raised when the node is created. A
    RuntimeError too, as torch's own shape errors are: torch code that catches those (`except
    RuntimeError`) catches it inside a graph as well."""


class GraphError(RuntimeError):
    """An expression was used where it cannot be: a closed graph, or two graphs mixed."""


class ExecutionError(RuntimeError):
    """A batched kernel failed on something only the forward could see (e.g. an index computed
    per instance, out of its table's range). The message names the op, its signature and the nodes
    (and, for a graph made with `debug=True`, the lines that wrote them); `__cause__` is the
    error torch raised."""
