"""Node-free views (csrc/views.cpp): `x.unsqueeze(0)`, `x.view(1, -1)`, `x.reshape(1, n)` and
`[0]` of such a row are handles presenting another shape over the same node, read
without a node where the consumer can (`x[0]` of a [1, n] view, a one-class cross-entropy, a
view of a view); anything else that reads a view's node gets its reshape node from here."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _core, ops
from ..graph import Expression
from .calls import T
from .dispatch import _HANDLERS


def _materialize(base: Expression, shape: tuple) -> Expression:
    """The reshape node of a view of `base`, as the reshape handler records `base.reshape(shape)`
    (a view is only made with grad enabled, so its node is made so too)."""
    with torch.enable_grad():
        return _RESHAPE(base, shape)


_RESHAPE = _HANDLERS[T.reshape]
_core.configure_views(_materialize, ops.pick_neg_log_softmax, F.cross_entropy,
                      (T.unsqueeze, torch.unsqueeze), (T.view, T.reshape, torch.reshape),
                      torch.int64)
