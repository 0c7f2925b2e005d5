"""Helpers of the tests of ops whose instances differ in length (test_padded, test_ragged,
test_padded_elementwise): float64 data drawn from a seed, and the two checks every such test
makes, values and gradients against eager PyTorch and the launches of a batch."""

from __future__ import annotations

import torch

import eager
import flybatch as fb

F64 = torch.float64


def vectors(seed: int, n: int, size: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=gen, dtype=F64) for _ in range(n)]


def parameters(seed: int = 0, **shapes: tuple[int, ...]) -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.nn.Parameter(torch.randn(*shape, generator=gen, dtype=F64) * 0.5)
            for name, shape in shapes.items()}


def same_as_eager(strategy: str, build, params, tol: float | None = None) -> None:
    """`build`'s values, every parameter's gradient and the loss under `strategy` are eager's
    (to `eager.TOLERANCE`, or `tol`)."""
    eager.assert_same(eager.run(fb, strategy, F64, build, params),
                      eager.run(eager, "eager", F64, build, params), F64, tol)


def launches(build, strategy: str = "auto") -> fb.Stats:
    """The stats of one forward and backward of `build`'s outputs, summed."""
    with fb.Graph(strategy=strategy, dtype=F64) as g:
        fb.esum([fb.sum_elems(o) for o in build(fb)]).backward()
        return g.stats()
