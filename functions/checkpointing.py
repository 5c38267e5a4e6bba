"""A synchronized layer under ``torch.utils.checkpoint(use_reentrant=False)``: its recomputation
in backward reuses the statistics of its first run, so it meets no replica and makes no
collective again, and updates no running statistics.

Non-reentrant checkpoint keeps the first run's autograd nodes and differentiates them; the
recomputation only makes again the tensors those nodes saved, matched to them by the order in
which they are saved. A synchronized call in the first run leaves its (mean, invstd) under its
place in that order (:func:`remember`); the recomputed call at the same place takes them back
(:func:`recall`) and normalizes with them alone, saving what the first run saved, in the same
order (:class:`RecomputedBatchNorm`, :class:`RecomputedInPlaceABN`). The statistics live as long
as the region's checkpoint frame, which the first run's graph holds.

Where no statistics are found (reentrant checkpoint, which recomputes outside any saved-tensor
hook; a checkpoint around ThreadedDataParallel, whose replicas run on other threads; other
saved-tensor hooks inside the region) the recomputation meets again, with the same result, and
updates copies of the running statistics (``SyncBatchNorm._running_state``).
"""
from __future__ import annotations

import threading
import weakref
from typing import NamedTuple

from torch import Tensor
from torch.autograd.function import Function

from . import torch_internals
from .operators.ops import OVERLOADS
from .operators.reference import memory_format_of

Statistics = tuple[Tensor, Tensor]
"""A replica's (mean, invstd) of one call, in the accumulation dtype, on its device."""

_KEPT: "weakref.WeakKeyDictionary[object, dict[int, Statistics]]" = weakref.WeakKeyDictionary()
_KEPT_LOCK = threading.Lock()  # replicas on other threads keep theirs in their own frames


class Place(NamedTuple):
    """A call's place in a checkpointed region: the region's frame, the index of the first tensor
    the call saves, and whether this is the recomputation."""

    frame: object
    index: int
    recomputing: bool


def place() -> Place | None:
    """This call's place in the non-reentrant checkpoint region it runs in, or None."""
    position = torch_internals.checkpoint_position()
    return None if position is None else Place(*position)


def remember(where: Place | None, statistics: Statistics | None) -> None:
    """Keep the first run's ``statistics`` for the recomputation at the same place (nothing
    outside a region's first run)."""
    if where is None or where.recomputing or statistics is None:
        return
    with _KEPT_LOCK:
        _KEPT.setdefault(where.frame, {})[where.index] = statistics


def recall(where: Place | None) -> Statistics | None:
    """The statistics the first run kept at this place where this is the recomputation, else
    None. Kept after reading: a backward with ``retain_graph=True`` recomputes the region again
    for the next backward."""
    if where is None or not where.recomputing:
        return None
    with _KEPT_LOCK:
        return _KEPT.get(where.frame, {}).get(where.index)


def _not_differentiated(layer: str) -> RuntimeError:
    return RuntimeError(
        f"{layer}: the graph of a checkpoint's recomputation is not differentiated (checkpoint differentiates "
        "the first run's nodes); a backward inside a checkpointed function through a synchronized layer is "
        "not supported"
    )


class RecomputedBatchNorm(Function):
    """``y = act((x - mean) * invstd * weight + bias + z)`` with the given statistics, saving
    (x, weight, bias, z, mean, invstd) as the synchronized forward saves them (the Python Function
    and the native node alike). ``apply(x, weight, bias, z, mean, invstd, negative_slope, layer)``;
    x ``(N, C, *)``, the others ``(C,)`` or None (z shaped as x)."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, mean, invstd, negative_slope, layer):  # type: ignore[override]
        x = x.contiguous(memory_format=memory_format_of(x))
        ctx.save_for_backward(x, weight, bias, residual, mean, invstd)
        ctx.layer = layer
        return OVERLOADS.elemt_forward(x, mean, invstd, weight, bias, residual, negative_slope)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        raise _not_differentiated(ctx.layer)


class RecomputedInPlaceABN(Function):
    """In-place ABN's forward with the given statistics, written over ``x``, saving (x, invstd,
    weight, bias) as :class:`~functions.inplace_abn.InPlaceABNFunction` saves them.
    ``apply(x, weight, bias, mean, invstd, eps, activation, activation_param, layer)``."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, eps, activation, activation_param, layer):  # type: ignore[override]
        OVERLOADS.abn_forward_(x, mean, invstd, weight, bias, eps, activation, activation_param)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, invstd, weight, bias)
        ctx.layer = layer
        return x

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        raise _not_differentiated(ctx.layer)
