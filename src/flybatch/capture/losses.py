"""Losses: the batch call with reduction='none', reduced per instance."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..graph import Expression
from .calls import _Slot
from .direct import _Bound, _meta_of, _record
from .mappings import _across_lengths, _led, _rows_plan


# ---- losses: reduction per instance ----------------------------------------------------------
def _loss(func: Callable, n_inputs: int):
    """A loss with `reduction=`: the batch call with reduction='none', reduced per instance
    (so `mean` divides by each instance's own count, or summed class weights for nll)."""
    label = func.__name__
    weighted = func in (F.nll_loss, F.cross_entropy)

    def build(call, across_lengths=False):
        bound = _bind(func, call.args, call.kwargs)  # the template: operands are _Slots
        reduction = bound.pop("reduction", "mean")
        if any(bound.pop(legacy, None) is not None for legacy in ("size_average", "reduce")):
            return NotImplemented
        inputs = [bound.pop(name) for name in list(bound)[:n_inputs]]
        weight = bound.pop("weight", None) if weighted else None
        if weighted and bound.get("label_smoothing", 0.0) != 0.0:
            return NotImplemented
        if any(type(v) is not _Slot for v in inputs) or \
                any(isinstance(v, _Slot) for v in bound.values()):
            return NotImplemented  # per-instance weights, pos_weight: generic
        if weight is not None and type(weight) is not _Slot:
            return NotImplemented
        own_weight = weight is not None and not call.params[weight.index]
        if own_weight and not across_lengths:
            return NotImplemented  # each instance's own class weights (a plain tensor): generic
        if weighted and len(call.operands[inputs[0].index][0]) not in (1, 2):
            return NotImplemented  # (N, C, d1...) inputs: generic
        if weighted and call.operands[inputs[1].index][1].is_floating_point:
            return NotImplemented  # class probabilities as targets (distillation): generic
        shape, dtype = _meta_of(func, call)
        slots = tuple(v.index for v in inputs)
        weight_slot = None if weight is None else weight.index
        shared = tuple(i == weight_slot and not own_weight for i in range(len(call.nodes)))
        fn = _Bound(_loss_from_slots, func, weighted, slots, weight_slot, reduction,
                    tuple(sorted(bound.items())), key=call.key)
        if not across_lengths:
            return label, fn, shape, dtype, shared, False
        # Scores (n, C) of a length-led input and class targets (n,): the targets' padding
        # is ignore_index, so that padded rows add no loss, no count and no gradient.
        (x, _), (target, target_dtype) = (call.operands[i] for i in slots)
        if not weighted or len(x) != 2 or target != x[:1] or target_dtype.is_floating_point \
                or own_weight and call.operands[weight_slot][0] != x[1:]:
            return NotImplemented
        fills = ((slots[1], bound.get("ignore_index", -100)),)
        return _rows_plan(call, label, fn, shape, dtype, shared, fills,
                          whole=(weight_slot,) if own_weight else ())

    def rows(call):
        return build(call, across_lengths=True)

    def handler(*args, **kwargs):
        if weighted:
            _check_classes(label, args, kwargs)
            if _led(args[0] if args else kwargs.get("input")):
                out = _across_lengths(handler, args, kwargs, rows)
                if out is not NotImplemented:
                    return out
        return _record(handler, args, kwargs, build)

    return handler


def _check_classes(label: str, args: tuple, kwargs: dict) -> None:
    """A class index out of range raises here, at the call, as it does eagerly (in the batched
    kernel it would surface at the next value request). Targets that are expressions are
    checked by the kernel."""
    x = args[0] if args else kwargs.get("input")
    target = args[1] if len(args) > 1 else kwargs.get("target")
    if not isinstance(target, torch.Tensor) or isinstance(target, Expression) or \
            target.dtype.is_floating_point or x is None or len(x.shape) not in (1, 2):
        return
    classes = x.shape[-1]
    ignore = kwargs.get("ignore_index", args[4] if len(args) > 4 else -100)
    with torch._C.DisableTorchFunction():
        if target.numel() == 1:
            low = high = int(target.item())  # (int(target) takes 3x as long)
        elif target.numel() == 0:
            return
        else:
            kept = target[target != ignore]
            if kept.numel() == 0:
                return
            low, high = int(kept.min()), int(kept.max())
    for bad in (low, high):
        if bad != ignore and not 0 <= bad < classes:
            raise IndexError(f"F.{label}: target {bad} is out of bounds for input of shape "
                             f"{tuple(x.shape)} ({classes} classes)")


def _loss_from_slots(func, weighted, slots, weight_slot, reduction, options, batch):
    tensors = [batch[i] for i in slots]
    if weight_slot is not None:
        tensors.append(batch[weight_slot])
    return _loss_batched(func, weighted, tensors, reduction, weight_slot is not None, options)


def _bind(func, args, kwargs) -> dict:
    import inspect

    signature = _SIGNATURES.get(func)
    if signature is None:
        signature = _SIGNATURES[func] = inspect.signature(func)
    bound = signature.bind(*args, **kwargs)
    return dict(bound.arguments)


_SIGNATURES: dict = {}


def _loss_batched(func, weighted, batch, reduction, has_weight, options):
    options = dict(options)
    weight = batch[-1] if has_weight else None
    tensors = batch[:-1] if has_weight else batch
    size = tensors[0].shape[0]
    if weighted:
        x, target = tensors
        classes = x.shape[-1]
        rows = target.reshape(size, -1)
        classes_of_rows = rows.clamp(0, classes - 1)  # (an ignored target may be any int)
        own = weight is not None and weight.dim() == 2  # each instance's class weights [B, C]
        losses = func(x.reshape(-1, classes), rows.reshape(-1), weight=None if own else weight,
                      reduction="none", **options).reshape(size, -1)
        if own:  # w[t] * -x[t]: the product torch forms with a weight
            losses = losses * weight.gather(1, classes_of_rows)
        if reduction == "none":
            return losses.reshape(target.shape)
        if reduction == "sum":
            return losses.sum(1)
        # mean: divided by the summed weights of each instance's targets (ignore_index: 0)
        if weight is None:
            weights = torch.ones_like(rows, dtype=x.dtype)
        else:
            weights = weight.gather(1, classes_of_rows) if own else weight[classes_of_rows]
        counted = weights.masked_fill(rows == options.get("ignore_index", -100), 0.0)
        return losses.sum(1) / counted.sum(1)
    losses = func(*tensors, reduction="none", **options)
    if reduction == "none":
        return losses
    flat = losses.reshape(size, -1)
    return flat.sum(1) if reduction == "sum" else flat.mean(1)
