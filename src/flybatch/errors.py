"""The errors flybatch raises at the user's line, never deep inside a batched kernel."""


class ShapeError(ValueError):
    """An op was given operands whose shapes do not fit; raised when the node is created."""


class GraphError(RuntimeError):
    """An expression was used where it cannot be: a closed graph, or two graphs mixed."""
