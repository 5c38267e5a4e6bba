"""A synchronized layer under ``torch.utils.checkpoint``: its recomputation in backward reuses the
statistics of its first run, so its forward meets no replica and makes no collective again, and
updates no running statistics.

A synchronized call in a checkpointed region's first run keeps its (mean, invstd, count) under its
place in the region (:func:`remember`); the recomputed call at the same place takes them back
(:func:`recall`) and its forward normalizes with them alone
(:attr:`~functions.synchronization.synchronizer.Synchronizer.given`), saving what the first run
saved, so that its backward, where it runs, meets as the first run's would have. The place:

- non-reentrant checkpoint (``use_reentrant=False``) keeps the first run's autograd nodes and
  differentiates them, the recomputation only making again the tensors they saved, matched to
  them by the order in which they are saved: the place is the region's frame and the index of
  the call's first saved tensor in that order;
- reentrant checkpoint runs the region without a graph first, and differentiates the
  recomputation: the place is the region's autograd node and the call's number among the
  synchronized calls of that run.

The statistics live as long as the region's frame or node, which the graph holds. Where none are
found (a checkpoint around ThreadedDataParallel or nn.DataParallel, whose replicas run on other
threads; other saved-tensor hooks inside the region) the recomputation meets again, with the same
result, and updates copies of the running statistics (``SyncBatchNorm._running_state``).
"""
from __future__ import annotations

import threading
import weakref
from typing import NamedTuple

from torch import Tensor

from . import torch_internals

Statistics = tuple[Tensor, Tensor, "int | Tensor | None"]
"""A replica's (mean, invstd) of one call, in the accumulation dtype, on its device, and the
count of values per channel that its backward divides by (the master's; None for the others)."""

_KEPT: "weakref.WeakKeyDictionary[object, dict[int, Statistics]]" = weakref.WeakKeyDictionary()
_CALLS: "weakref.WeakKeyDictionary[object, dict[int, int]]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()  # replicas on other threads keep theirs in their own regions


class Place(NamedTuple):
    """A call's place in a checkpointed region: the region (its frame or node), the call's index
    there, and whether this is the recomputation."""

    region: object
    index: int
    recomputing: bool


def place() -> Place | None:
    """This synchronized call's place in the checkpointed region it runs in, or None."""
    position = torch_internals.checkpoint_position()
    if position is not None:
        return Place(*position)
    region = torch_internals.reentrant_checkpoint_region()
    if region is None:
        return None
    node, recomputing = region
    run = torch_internals.current_graph_task_id()  # -1: the first run, else the backward that recomputes
    with _LOCK:
        calls = _CALLS.setdefault(node, {})
        index = calls[run] = calls.get(run, -1) + 1
    return Place(node, index, recomputing)


def remember(where: Place | None, statistics: Statistics | None) -> None:
    """Keep the first run's ``statistics`` for the recomputation at the same place (nothing
    outside a region's first run)."""
    if where is None or where.recomputing or statistics is None:
        return
    with _LOCK:
        _KEPT.setdefault(where.region, {})[where.index] = statistics


def recall(where: Place | None) -> Statistics | None:
    """The statistics the first run kept at this place where this is the recomputation, else
    None. Kept after reading: a backward with ``retain_graph=True`` recomputes the region again
    for the next backward."""
    if where is None or not where.recomputing:
        return None
    with _LOCK:
        return _KEPT.get(where.region, {}).get(where.index)
