"""Where the replicas and the ranks of a synchronized layer meet, for one call: the one owner of
rounds, fences, collectives, failure reporting and aborts.

The layer builds a :class:`Synchronizer` for each call that syncs (training with more than one
replica in the process, or a process group of more than one rank). The autograd Function asks
it for two exchanges and nothing else:

- forward, :meth:`Synchronizer.global_stats`: each replica posts its (count, mean, M2) to its
  round (:mod:`functions.replicas`); the master replica (index 0) fetches them onto its device
  after each replica's work (:mod:`functions.devices`: an event per part, no host sync), checks
  that they agree, and, where a process group is given, merges them into the process's part and
  joins ONE all_gather (:mod:`functions.distributed`); then it merges every part in rank order
  (:func:`functions.stats.merge`), turns the result into what the elementwise kernels take
  (mean and invstd in the accumulation dtype, once for every replica) and hands it back;
- backward, :meth:`Synchronizer.global_grad_sums`: the replicas' (sum_dy, sum_dy_xmu) summed on
  the master, then over the ranks in ONE all_reduce, and handed back.

Whoever catches an error during the call hands it to :meth:`Synchronizer.fail`: the other
replicas of the round are released at once (they raise instead of waiting), and a process master
that has not yet joined the forward's collective joins it with a failed flag, so that the other
ranks raise too rather than wait for the collective's timeout.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import Tensor

from . import checks, devices, reference, stats
from .distributed import ProcessGroupCall, ProcessGroupSync, all_gather_stats, all_reduce_sums, report_failure
from .reference import values_per_channel
from .replicas import ReplicaCall, ReplicaHandle
from .stats import LocalStats


class Synchronizer:
    """One synchronized call of one layer: its exchanges with the other replicas of the process
    (``replica_call``) and with the other ranks (``process_call``, held by the process master).

    ``layer`` names the layer in errors; ``channels`` and ``device`` (the layer's) shape the
    failed-flag row that :meth:`fail` sends to the ranks. ``count`` is the global number of
    values per channel once :meth:`global_stats` has run.
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
        """The one replica of the process that updates the running statistics."""
        return self.replica_call is None or self.replica_call.is_master

    def global_stats(
        self, x: Tensor, mean: Tensor, m2: Tensor, eps: float
    ) -> tuple[int | Tensor, Tensor | None, Tensor | None, Tensor, Tensor]:
        """From this replica's local ``mean`` and ``m2`` of ``x`` (``(C,)`` each): the count,
        mean and biased variance (float64) to update the running statistics with, on the master
        replica only (else the count and None, None), and the mean and invstd = 1 / sqrt(var +
        eps) in the accumulation dtype on x's device, which the master computes once for every
        replica. The counts are ints, or 0-dim float64 tensors on the device where they come
        from a collective whose checks are deferred (:func:`functions.distributed.all_gather_stats`:
        then the update's is NaN where a check failed). :attr:`count` is the total, for the
        backward."""
        acc = reference.accumulation_dtype(x.dtype)
        # only a part that another replica's thread fetches needs a fence
        ready = None if self.replica_call is None else devices.mark_ready(mean)
        local = LocalStats(values_per_channel(x), mean, m2, x.dtype, x.shape, ready)
        if self.replica_call is None:
            self.count, counted, mean, var = self._merge_parts([local])
            return (counted, mean, var, *reference.normalization(mean, var, eps, acc))
        merged: list[tuple] = []  # the master's own (counted, mean, var): its combine runs here

        def merge(parts: list[LocalStats]) -> tuple:
            count, counted, mean, var = self._merge_parts(parts)
            merged.append((counted, mean, var))
            mean_acc, invstd = reference.normalization(mean, var, eps, acc)
            return count, mean_acc, invstd, devices.mark_ready(invstd)

        count, mean_acc, invstd, ready = self._exchange("forward", local, merge)
        mean_acc, invstd = devices.fetch(mean_acc, x.device, ready), devices.fetch(invstd, x.device, ready)
        if isinstance(count, Tensor):
            count = devices.fetch(count, x.device, ready)
        self.count = count
        counted, mean, var = merged[0] if merged else (count, None, None)
        return counted, mean, var, mean_acc, invstd

    def global_grad_sums(self, sum_dy: Tensor, sum_dy_xmu: Tensor) -> tuple[Tensor, Tensor]:
        """(sum_dy, sum_dy_xmu) summed over every replica and rank in one exchange, on this
        replica's device. The master does every op of the sum: the others only wait, and each
        op they made would hand the GIL around among the replica threads."""
        part = (sum_dy, sum_dy_xmu, devices.mark_ready(sum_dy_xmu) if self.replica_call is not None else None)
        if self.replica_call is None:
            total_dy, total_dy_xmu, ready = self._sum_parts([part])
        else:
            total_dy, total_dy_xmu, ready = self._exchange("backward", part, self._sum_parts)
        return devices.fetch(total_dy, sum_dy.device, ready), devices.fetch(total_dy_xmu, sum_dy.device, ready)

    def fail(self, error: BaseException) -> None:
        """This replica failed during the call: release the other replicas of its round, and,
        where this process has not joined the forward's collective yet, tell the other ranks."""
        if self.replica_call is not None:
            self.replica_call.round.abort(error, self.replica_call.index)
        if self.process_call is not None and not self._joined_collective and isinstance(error, Exception):
            self._joined_collective = True
            report_failure(self.process_call, self.channels, self.device)

    def _exchange(self, direction: str, payload: Any, combine: Callable[[list[Any]], Any]) -> Any:
        assert self.replica_call is not None
        return self.replica_call.exchange(direction, payload, combine)

    def _merge_parts(self, parts: list[LocalStats]) -> tuple[int | Tensor, int | Tensor, Tensor, Tensor]:
        """On the master: the replicas' parts (and, with a process group, every rank's) merged,
        as (count, count to update the running statistics with, mean, var). Raises when they
        disagree on channels or dtype, or hold one value per channel between them, before
        anything is updated; the ranks raise alike (where their checks are read at once:
        :mod:`functions.checks`)."""
        stats.check_parts_agree(parts, self.layer)
        parts = _on_one_device(parts)
        if self.process_call is not None:
            # a deferred failure found here raises before this rank joins the collective, so
            # that fail() joins it with a failed flag: the ranks' collectives stay paired
            checks.poll()
            self._joined_collective = True
            return all_gather_stats(stats.merge_into_one(parts), self.process_call)
        stats.check_values_per_channel(sum(part.count for part in parts), self.layer, [p.input_shape for p in parts])
        count, mean, var = stats.merge(parts)
        return count, count, mean, var

    def _sum_parts(self, parts: list[tuple[Tensor, Tensor, Any]]) -> tuple[Tensor, Tensor, Any]:
        """On the master: the replicas' (sum_dy, sum_dy_xmu), each pair as one ``(2C,)`` row,
        summed in replica order on the first one's device, then over the ranks (one
        all_reduce)."""
        device = parts[0][0].device
        rows = [torch.cat([devices.fetch(dy, device, ready), devices.fetch(dy_xmu, device, ready)]) for dy, dy_xmu, ready in parts]
        total = rows[0] if len(rows) == 1 else torch.stack(rows).sum(0)
        if self.process_call is not None:
            total = all_reduce_sums(total, self.process_call)
        total_dy, total_dy_xmu = total.chunk(2)
        return total_dy, total_dy_xmu, devices.mark_ready(total)


def _on_one_device(parts: list[LocalStats]) -> list[LocalStats]:
    """The parts with their mean and M2 on the first part's device, each copied after the work
    that produced it."""
    device = parts[0].mean.device
    return [
        part
        if part.mean.device == device
        else dataclasses.replace(part, mean=devices.fetch(part.mean, device, part.ready), m2=devices.fetch(part.m2, device, part.ready))
        for part in parts
    ]
