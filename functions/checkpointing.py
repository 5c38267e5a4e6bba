"""A synchronized layer under ``torch.utils.checkpoint``: its recomputation in backward reuses the
statistics of its first run, so its forward meets no replica and makes no collective again, and
updates no running statistics.

A synchronized call in a checkpointed region's first run keeps its (mean, invstd, count) under its
place in the region (:func:`remember`); the recomputed call at the same place takes them back
(:func:`recall`) and its forward normalizes with them alone
(:attr:`~syncbn.functions.synchronization.synchronizer.Synchronizer.given`), saving what the first run
saved, so that its backward, where it runs, meets as the first run's would have. The place is the
region and the call's number among the synchronized calls of that run of it (a recomputation runs
the region's Python again, in the same order, up to checkpoint's early stop), whatever each call
saves and whatever the grad mode:

- non-reentrant checkpoint (``use_reentrant=False``): the region is its ``_CheckpointFrame``,
  found through the innermost saved-tensor hooks, which the first run and each recomputation set;
- reentrant checkpoint: the region is its autograd node, the ``ctx`` of the innermost
  ``CheckpointFunction.forward`` (the first run) or ``backward`` (the recomputation) on the stack.

A kept call is taken back only by a call of the same layer on an input of the same shape and
dtype. A region nested in a recomputation runs a first run of its own there, which meets again.

The statistics live as long as the region's frame or node, which the graph holds. Where none are
found (a checkpoint around ThreadedDataParallel or nn.DataParallel, whose replicas run on other
threads; other saved-tensor hooks inside the region) the recomputation meets again, with the same
result, and updates copies of the running statistics (``SyncBatchNorm._running_state``).
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import torch_internals

Statistics = tuple[Tensor, Tensor, "int | Tensor | None", "int | None"]
"""A replica's (mean, invstd) of one call, in the accumulation dtype, on its device, the count of
values per channel that its backward divides by (the master's; None for the others) and its call
number across ranks (the process master's; None for the others)."""

Signature = tuple[int, tuple[int, ...], torch.dtype]
"""What a call is in both runs: its layer (``id``; the region holds the layer alive), its input's
shape and dtype. A kept call whose recomputation differs is not taken: it meets again."""

_KEPT: "weakref.WeakKeyDictionary[object, dict[int, tuple[Signature, Statistics]]]" = weakref.WeakKeyDictionary()
_CALLS: "weakref.WeakKeyDictionary[object, dict[Any, int]]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()  # replicas on other threads keep theirs in their own regions
_MIXED: "weakref.WeakSet[object]" = weakref.WeakSet()
"""Non-reentrant regions whose first run made, while it ran, a synchronized call of another
region or of none: their recomputation may meet the ranks again."""


class _OpenRegions(threading.local):
    """The non-reentrant regions whose first run is running on this thread and made a call."""

    def __init__(self) -> None:
        self.regions: list[weakref.ref] = []


_OPEN = _OpenRegions()


class Place(NamedTuple):
    """A call's place in a checkpointed region: the region (its frame or node), the call's number
    among the synchronized calls of this run of it, whether this run is the recomputation, and
    whether the region is reentrant (whose recomputation makes the nodes that its backward runs;
    a non-reentrant one's are dropped)."""

    region: object
    index: int
    recomputing: bool
    reentrant: bool


def place() -> Place | None:
    """This synchronized call's place in the checkpointed region it runs in, or None. Every
    synchronized call of a run is numbered, whatever it saves and whatever the grad mode, in the
    order the region makes them, which its recomputation repeats: a recomputation of a
    ``retain_graph`` backward numbers its calls again."""
    found, reentrant = torch_internals.nonreentrant_checkpoint_region(), False
    if found is None:
        found, reentrant = torch_internals.reentrant_checkpoint_region(), True
    if found is None:
        _note_call(None)
        return None
    region, run = found
    first_run = run == torch_internals.FIRST_RUN
    _note_call(region if first_run and not reentrant else None)
    with _LOCK:
        calls = _CALLS.setdefault(region, {})
        index = calls[run] = calls.get(run, -1) + 1
    return Place(region, index, not first_run, reentrant)


def signature(layer: object, input: Tensor) -> Signature:
    """What a call of ``layer`` on ``input`` is, for :func:`remember` and :func:`recall`."""
    return id(layer), tuple(input.shape), input.dtype


def remember(where: Place | None, call: Signature, statistics: Statistics | None) -> None:
    """Keep the first run's ``statistics`` of ``call`` for the recomputation at the same place
    (nothing outside a region's first run)."""
    if where is None or where.recomputing or statistics is None:
        return
    with _LOCK:
        _KEPT.setdefault(where.region, {})[where.index] = call, statistics


def recall(where: Place | None, call: Signature) -> Statistics | None:
    """The statistics the first run kept at this place for the same ``call``, where this is the
    recomputation; else None (the call meets again). Kept after reading: a backward with
    ``retain_graph=True`` recomputes the region again for the next backward."""
    if where is None or not where.recomputing:
        return None
    with _LOCK:
        kept = _KEPT.get(where.region, {}).get(where.index)
    return kept[1] if kept is not None and kept[0] == call else None


def attach(sync: Any, where: Place | None, call: Signature) -> None:
    """Hand a call's :class:`~syncbn.functions.synchronization.synchronizer.Synchronizer` what its place
    says: the first run's statistics where this is the recomputation (``given``), and its region
    where that is non-reentrant (whose recomputation a failure in backward may come from)."""
    sync.given = recall(where, call)
    sync.region = None if where is None or where.reentrant else where.region
    if sync.given is not None:
        sync.renumber(sync.given[3])


def keeps_nodes(where: Place | None) -> bool:
    """Whether the backward nodes of a call made here surely run: those of a forward, and of a
    reentrant region's recomputation (its backward differentiates them); not those made in any
    other backward pass (a non-reentrant recomputation only makes again the tensors that the
    first run's nodes saved, a region nested in it included)."""
    if not torch_internals.in_backward_pass():
        return True
    return where is not None and where.recomputing and where.reentrant


def _note_call(home: object | None) -> None:
    """A synchronized call made in the first run of the non-reentrant region ``home`` (None: of
    no such region): every other region whose first run is running on this thread is mixed."""
    open_regions = []
    for ref in _OPEN.regions:
        region = ref()
        if region is not None and not torch_internals.checkpoint_first_run_ended(region):
            open_regions.append(ref)
            if region is not home:
                _MIXED.add(region)
    if home is not None and all(ref() is not home for ref in open_regions):
        open_regions.append(weakref.ref(home))
    _OPEN.regions = open_regions


def met_only_its_own(region: object) -> bool:
    """Whether the first run of the non-reentrant ``region`` has ended having made no synchronized
    call but its own: its recomputation, which reuses their statistics, then meets no one, and a
    rank that fails in it knows which collective the others wait in next."""
    return torch_internals.checkpoint_first_run_ended(region) and region not in _MIXED
