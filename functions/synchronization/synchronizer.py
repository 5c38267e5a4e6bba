"""Where the replicas and the ranks of a synchronized layer meet, for one call: the one owner of
rounds, streams, fences, collectives, failure reporting and aborts.

The layer builds a :class:`Synchronizer` for each call that syncs (training with more than one
replica in the process, or a process group of more than one rank). On the native path
(src/sync_batch_norm.cpp, where the compiled module is loaded) the replicas meet in C++, and the
process master builds, merges and judges the collectives' rows itself, calling back only for the
collectives (:meth:`Synchronizer.gather_rows`, :meth:`Synchronizer.reduce_row`), for a verdict
that fails at once (:meth:`Synchronizer.judge_gathered`, :meth:`Synchronizer.judge_summed`), and,
where the checks are deferred, to queue the verdicts that it has copied to host memory itself
(:meth:`Synchronizer.defer_gathered`, :meth:`Synchronizer.defer_summed`). On the Python path the autograd Function
meets the other replicas once per direction, with :meth:`Synchronizer.on_master`: each replica posts
its part of the call (its tensors, and the stream it runs on) to its round (the same native
meeting: :meth:`functions.synchronization.replicas.ReplicaRound.exchange`) and waits; the master's work (run by
the replica that arrives last) does the whole call for every replica, in replica order, on each
part's stream, and hands each its own result. The master's work asks this class for what
crosses replicas and ranks:

- :meth:`Synchronizer.merge_stats`: the replicas' (count, mean, M2) fetched onto the master's
  device after each part's work (:mod:`functions.devices`: an event per part, no host sync),
  checked to agree and merged (:func:`functions.stats.merge`), and, where a process group is
  given, merged into the process's part and sent through ONE all_gather, whose rows every rank
  merges in rank order (:mod:`functions.synchronization.distributed`); the running statistics updated once;
- :meth:`Synchronizer.sum_over_ranks`: the backward's (sum_dy, sum_dy_xmu) row over the ranks in
  ONE all_reduce;
- :meth:`Synchronizer.stream_for`: the stream a replica runs on, which the master runs its part
  on (:func:`functions.devices.on_stream`); what the master made on its own device reaches the
  others after an event (:func:`functions.devices.fetch`).

Why one replica does every replica's work on this path: replicas are threads of one process, and
every call into torch from Python hands the GIL to another runnable replica and waits to get it
back. A replica that only posts and waits (without the GIL) makes no such call while the others
run. The kernels' own work is not serialized by it where it matters: CUDA kernels are queued on
each replica's stream, and the CPU kernels use every core themselves.

Whoever catches an error during the call hands it to :meth:`Synchronizer.fail`: the other
replicas of the round are released at once (they raise instead of waiting), and a process master
that has not yet joined the forward's collective joins it with a failed flag, so that the other
ranks raise too rather than wait for the collective's timeout. An error in a backward pass (a
synchronized backward, or a checkpoint's recomputation that reuses its statistics and so joins no
forward collective) is told to the other ranks in the collective they are certain to wait in, if
any (:meth:`Synchronizer.fail_backward`): the failed call's own backward all_reduce, or that of its
checkpointed region's latest call whose backward this process still owes (:class:`OwedBackwards`),
joined once per backward pass with the failed identity.
"""
from __future__ import annotations

import dataclasses
import sys
import threading
import weakref
from typing import Any, Callable, Sequence, TypeVar

import torch
from torch import Tensor

from . import checks, distributed
from .. import checkpointing, devices, stats, torch_internals
from ..operators import reference
from .distributed import (
    ProcessGroupCall, ProcessGroupSync, all_gather_stats, all_reduce_sums, report_backward_failure, report_failure,
)
from .replicas import ReplicaCall, ReplicaHandle
from ..stats import LocalStats, Running, update_running_stats

Part = TypeVar("Part")
Result = TypeVar("Result")


class Synchronizer:
    """One synchronized call of one layer: its exchanges with the other replicas of the process
    (``replica_call``) and with the other ranks (``process_call``, held by the process master).

    ``layer`` names the layer in errors; ``channels`` and ``device`` (the layer's) shape the
    failed-flag row that :meth:`fail` sends to the ranks. ``count`` is the global number of
    values per channel once :meth:`merge_stats` has run (on the master).
    """

    def __init__(
        self,
        replica_call: ReplicaCall | None,
        process_call: ProcessGroupCall | None,
        layer: str,
        channels: int,
        device: torch.device,
    ) -> None:
        self.replica_call, self.process_call, self.layer = replica_call, process_call, layer
        self.channels, self.device = channels, device
        self.count: int | Tensor | None = None
        self._joined_collective = False
        self._owed = False  # its forward made a node whose backward meets the ranks
        self._joined_pass = -2  # the backward pass whose all_reduce it joined (-2: none)
        self.region: object | None = None
        """The non-reentrant checkpointed region (its frame) this call runs in, if any."""
        self.native: tuple | None = None  # the native path's process master: distributed.native_ranks
        self.normalization: tuple[Tensor, Tensor] | None = None
        """This replica's (mean, invstd) once the forward has made them."""
        self.given: tuple[Tensor, Tensor, int | Tensor | None] | None = None
        """(mean, invstd, count) that a checkpoint's first run kept for this call, its recomputation:
        the forward takes them and meets no one (:mod:`functions.checkpointing`)."""

    @classmethod
    def for_call(
        cls,
        handle: ReplicaHandle | None,
        group: Any | None,
        process_calls: ProcessGroupSync,
        layer: str,
        channels: int,
        device: torch.device,
    ) -> "Synchronizer":
        """The synchronizer of a layer's next call. ``handle``: this replica's place in a round of
        more than one replica (None: the only replica of its process); ``group``: the process
        group to sync over (None: this process alone); ``process_calls``: the layer's count of
        calls across processes. The master replica of each process (or the only one) takes part
        in the collectives."""
        replica_call = handle.next_call() if handle is not None else None
        is_process_master = handle is None or handle.index == 0
        process_call = process_calls.next_call(group, layer) if group is not None and is_process_master else None
        return cls(replica_call, process_call, layer, channels, device)

    @property
    def is_master(self) -> bool:
        """The one replica of the process that does every replica's work and updates the
        running statistics."""
        return self.replica_call is None or self.replica_call.is_master

    def statistics(self) -> tuple[Tensor, Tensor, int | Tensor | None] | None:
        """This replica's (mean, invstd, count) once the forward ran (the count where this is the
        master), for a checkpoint's recomputation to be :attr:`given`; None before."""
        return None if self.normalization is None else (*self.normalization, self.count)

    def stream_for(self, device: torch.device) -> "torch.cuda.Stream | None":
        """The stream this replica runs on, on ``device``, for the master to run its part on
        (None: a CPU device, or no other replica in the process, whose work runs here)."""
        if self.replica_call is None or device.type != "cuda":
            return None
        return torch.cuda.current_stream(device)

    def on_master(self, direction: str, part: Part, work: Callable[[list[Part]], Sequence[Result]]) -> Result:
        """Post ``part`` and return this replica's result of ``work``, which the master runs once
        over every replica's part (in replica order) and which returns one result per part.
        Raises :class:`~functions.ReplicaSyncError` when another replica failed or one never came
        (after the round's timeout); an error raised by ``work`` is the master's, and breaks the
        round for the others."""
        if self.replica_call is None:
            return work([part])[0]
        call = self.replica_call
        return call.exchange(direction, part, work)[call.index]

    def merge_stats(self, parts: list[LocalStats], running: Running) -> tuple[Tensor, Tensor]:
        """On the master: the replicas' parts (and, with a process group, every rank's) merged,
        on the first part's device, as (mean, biased variance), float64, and the layer's
        ``running`` statistics updated once; :attr:`count` is the total, for the backward.
        Raises when they disagree on channels or dtype, or hold one value per channel between
        them, and updates nothing then; the ranks raise alike (at once, or deferred where their
        checks are: :mod:`functions.synchronization.checks`). The count is
        an int, or a 0-dim float64 tensor on the device where it comes from a collective whose
        checks are deferred (:func:`functions.synchronization.distributed.all_gather_stats`)."""
        stats.check_inputs_agree(self.layer, [p.mean.numel() for p in parts], [p.input_dtype for p in parts])
        parts = _on_one_device(parts)
        if self.process_call is not None:
            return self._gather_over_ranks(stats.merge_into_one(parts), running)
        stats.check_values_per_channel(sum(part.count for part in parts), self.layer, [p.input_shape for p in parts])
        self.count, mean, var = stats.merge(parts)
        update_running_stats(running, mean, var, self.count)
        return mean, var

    def sum_over_ranks(self, sum_dy: Tensor, sum_dy_xmu: Tensor) -> tuple[Tensor, Tensor]:
        """On the master: the replicas' summed (sum_dy, sum_dy_xmu), summed over the ranks too
        (one all_reduce of both as one row), or themselves without a process group."""
        if self.process_call is None:
            return sum_dy, sum_dy_xmu
        self._joined_pass = torch_internals.current_graph_task_id()
        return all_reduce_sums(sum_dy, sum_dy_xmu, self.process_call)

    def gather_rows(self, row: Tensor) -> Tensor:
        """The native path's all_gather of this process's ``row`` (built by the caller): every
        rank's, (world, len(row)). A deferred failure found first raises before joining, as
        :meth:`_gather_over_ranks`."""
        checks.poll()
        self._joined_collective = True
        return distributed.all_gather_rows(row, self.process_call)

    def judge_gathered(self, valid: Tensor, rows: Tensor) -> None:
        """The native path's forward checks where they fail (``valid`` false), read at once:
        raises, as the Python path does (:func:`functions.synchronization.distributed.judge_gathered`)."""
        distributed.judge_gathered(self.process_call, valid, rows)

    def defer_gathered(self, valid: Tensor, headers: Tensor, ready: checks.Ready | None) -> None:
        """The native path's forward checks where they are deferred: ``valid`` and the rows'
        ``headers`` on their way to host memory, read once ``ready`` has passed
        (:func:`functions.synchronization.distributed.defer_gathered`)."""
        distributed.defer_gathered(self.process_call, valid, headers, ready)

    def reduce_row(self, row: Tensor) -> None:
        """The native path's all_reduce of its backward ``row``, in place."""
        self._joined_pass = torch_internals.current_graph_task_id()
        distributed.all_reduce_row(row, self.process_call)

    def judge_summed(self, row: Tensor) -> None:
        """The native path's backward checks where they fail, read at once: raises."""
        distributed.judge_summed(self.process_call, row)

    def defer_summed(self, identities: Tensor, ready: checks.Ready | None) -> None:
        """The native path's backward checks where they are deferred: the summed ``identities``
        on their way to host memory (:func:`functions.synchronization.distributed.defer_summed`)."""
        distributed.defer_summed(self.process_call, identities, ready)

    def sum_with_ranks(self, sum_dy: Tensor, sum_dy_xmu: Tensor) -> tuple[Tensor, Tensor, int]:
        """On the master (the Python path's backward): the process's sums over every rank, as
        backward_elemt takes them with the count returned (divided by the count here where it is
        a device tensor: deferred checks)."""
        total_dy, total_dy_xmu = self.sum_over_ranks(sum_dy, sum_dy_xmu)
        assert self.count is not None
        if isinstance(self.count, Tensor):
            return reference.sums_per_value(total_dy, total_dy_xmu, self.count)
        return total_dy, total_dy_xmu, self.count

    def _gather_over_ranks(self, local: LocalStats, running: Running) -> tuple[Tensor, Tensor]:
        """This process's part merged with every rank's (one all_gather) and ``running`` updated:
        mean, variance; :attr:`count` the total."""
        assert self.process_call is not None
        # a deferred failure found here raises before this rank joins the collective, so that
        # fail() joins it with a failed flag: the ranks' collectives stay paired
        checks.poll()
        self._joined_collective = True
        self.count, mean, var = all_gather_stats(local, self.process_call, running)
        return mean, var

    def owe_backward(self) -> None:
        """This call's forward made a backward node that will meet the ranks, in the checkpointed
        region :attr:`region` (if any): where a recomputation of that region fails, the failure is
        told through the latest such call's collective (:meth:`fail_backward`)."""
        if self.process_call is not None:
            self._owed = True
            OWED.add(self)

    def fail(self, error: BaseException) -> None:
        """This replica failed during the call: release the other replicas of its round, and tell
        the other ranks through the collective they wait in: the forward's, where this process
        has not joined it yet, else, in a backward pass, the one :meth:`fail_backward` finds.
        Checkpoint's stop of a recomputation is control flow, not a failure. An error in telling
        them is reported, not raised: ``error`` is the one the caller raises."""
        if torch_internals.is_checkpoint_stop(error):
            return
        if self.replica_call is not None:
            self.replica_call.round.abort(error, self.replica_call.index)
        if self.process_call is None or not isinstance(error, Exception):
            return
        try:
            if not self._joined_collective and self.given is None:
                self._joined_collective = True
                report_failure(self.process_call, self.channels, self.device)
            else:
                self.fail_backward()
        except Exception:  # noqa: BLE001
            sys.unraisablehook(sys.UnraisableHookArgs(*sys.exc_info(), "syncbn: telling the other ranks of a failure", None))

    def fail_backward(self) -> None:
        """This call failed in a backward pass (the native backward calls this too): tell the other
        ranks in the collective they are certain to wait in, once per backward pass. Outside a
        non-reentrant checkpointed region, that is this call's own backward all_reduce, where it
        owes it in this pass. Inside one, the failure may come from the region's recomputation
        (this call's, or the one its backward's unpacking started), which others may still be
        running: only where the region's first run met no one but its own calls
        (:func:`functions.checkpointing.met_only_its_own`), so that its recomputation meets no
        one, is it the latest call of the region still owed (the engine runs a graph's nodes in
        reverse order of their making). Elsewhere nothing is certain: no report, and the others
        wait for the collective timeout."""
        if self.process_call is None or not torch_internals.in_backward_pass():
            return
        if self.region is None:
            if _owes(self):
                OWED.report_failure(self)
        elif checkpointing.met_only_its_own(self.region):
            OWED.report_failure(OWED.latest_in(self.region))


class OwedBackwards:
    """The synchronized calls of this process whose backward collective is still owed (their node
    alive, their all_reduce not joined), in the order of their forwards."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[weakref.ref[Synchronizer]] = []
        self._prune_at = 64
        self._reported_pass = -1

    def add(self, sync: Synchronizer) -> None:
        with self._lock:
            self._calls.append(weakref.ref(sync))
            if len(self._calls) >= self._prune_at:
                self._calls = [ref for ref in self._calls if _owes(ref())]
                self._prune_at = 2 * len(self._calls) + 64

    def latest_in(self, region: object) -> Synchronizer | None:
        """The latest call still owed that ran in ``region``."""
        with self._lock:
            for ref in reversed(self._calls):
                sync = ref()
                if sync is not None and sync.region is region and _owes(sync):
                    return sync
        return None

    def report_failure(self, sync: Synchronizer | None) -> None:
        """Join ``sync``'s backward all_reduce with the failed identity, once per backward pass."""
        backward_pass = torch_internals.current_graph_task_id()
        with self._lock:
            if sync is None or backward_pass == self._reported_pass or not _owes(sync):
                return
            self._reported_pass = backward_pass
            sync._joined_pass = backward_pass
        assert sync.process_call is not None
        report_backward_failure(sync.process_call, sync.channels, sync.device)


def _owes(sync: Synchronizer | None) -> bool:
    """Whether ``sync``'s backward all_reduce is still owed in the running backward pass (every
    pass of a graph kept with ``retain_graph`` owes it again)."""
    return sync is not None and sync._owed and sync._joined_pass != torch_internals.current_graph_task_id()


OWED = OwedBackwards()
"""This process's owed backward collectives."""


def check_not_captured(input: Tensor, layer: str, direction: str = "forward") -> None:
    """Refuse a synchronized ``direction`` of ``layer`` on a CUDA stream that a CUDA graph is
    capturing (:func:`functions.stats.check_not_capturing`), before any work."""
    if input.is_cuda:
        stats.check_not_capturing(torch.cuda.is_current_stream_capturing(), layer, direction)


def _on_one_device(parts: list[LocalStats]) -> list[LocalStats]:
    """The parts with their mean and M2 on the first part's device, each copied (or, already
    there, read: replicas on one GPU may run on different streams) after the work that produced
    it."""
    device = parts[0].mean.device
    return [
        part
        if part.mean.device == device and part.ready is None
        else dataclasses.replace(part, mean=devices.fetch(part.mean, device, part.ready), m2=devices.fetch(part.m2, device, part.ready))
        for part in parts
    ]
