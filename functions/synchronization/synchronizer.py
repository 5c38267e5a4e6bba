"""Where the replicas and the ranks of a synchronized layer meet, for one call: the one owner of
the call's native run, its collectives, its failure reporting and its aborts.

The layer builds a :class:`Synchronizer` for each call that syncs (training with more than one
replica in the process, or a process group of more than one rank) and runs the call through it
(:meth:`Synchronizer.batch_norm`, :meth:`Synchronizer.inplace_abn`): one native call per replica
and direction (``src/sync_batch_norm.cpp``), without the GIL, whose replicas meet at their round
(``src/replica_round.h``). The process master builds, merges and judges the collectives' rows in
C++ and calls back only for the collectives (:meth:`Synchronizer.gather_rows`,
:meth:`Synchronizer.reduce_row`), for a verdict that fails at once
(:meth:`Synchronizer.judge_gathered`, :meth:`Synchronizer.judge_summed`), and, where the checks
are deferred, to queue the verdicts it has copied to host memory
(:meth:`Synchronizer.defer_gathered`, :meth:`Synchronizer.defer_summed`).

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

import sys
import threading
import weakref
from typing import Any

import torch
from torch import Tensor

from . import checks, distributed
from .. import checkpointing, stats, torch_internals
from ..operators import backend
from .distributed import ProcessGroupCall, ProcessGroupSync, report_backward_failure, report_failure
from .replicas import ReplicaCall, ReplicaHandle, ReplicaSyncError


class Synchronizer:
    """One synchronized call of one layer: its exchanges with the other replicas of the process
    (``replica_call``) and with the other ranks (``process_call``, held by the process master).

    ``layer`` names the layer in errors; ``channels`` and ``device`` (the layer's) shape the
    failed-flag row that :meth:`fail` sends to the ranks. ``count`` is the global number of
    values per channel once the forward has run (an int, or a 0-dim device tensor where the
    ranks' checks are deferred).
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
        self._node: Any = None  # that node, held weakly (the native WeakNode), or None
        self._joined_pass = -2  # the backward pass whose all_reduce it joined (-2: none)
        self.region: object | None = None
        """The non-reentrant checkpointed region (its frame) this call runs in, if any."""
        self.native: tuple | None = None  # what the native Ranks reads: distributed.native_ranks
        self.normalization: tuple[Tensor, Tensor] | None = None
        """This replica's (mean, invstd) once the forward has made them."""
        self.given: tuple[Tensor, Tensor, int | Tensor | None, int | None] | None = None
        """(mean, invstd, count, call number) that a checkpoint's first run kept for this call, its
        recomputation: the forward takes them and meets no one (:mod:`syncbn.functions.checkpointing`)."""
        self._process_calls: ProcessGroupSync | None = None

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
        sync = cls(replica_call, process_call, layer, channels, device)
        sync._process_calls = process_calls
        return sync

    def renumber(self, number: int | None) -> None:
        """This call is a recomputation, which meets no one in its forward: it takes its first run's
        call ``number`` back, so that the ranks count the same calls whether or not a recomputation
        failed on one of them."""
        if self.process_call is not None and number is not None and self._process_calls is not None:
            self.process_call = self._process_calls.renumber(self.process_call, number)

    def statistics(self) -> tuple[Tensor, Tensor, int | Tensor | None, int | None] | None:
        """This replica's (mean, invstd, count, call number) once the forward ran, for a checkpoint's
        recomputation to be :attr:`given`; None before."""
        if self.normalization is None:
            return None
        return (*self.normalization, self.count, None if self.process_call is None else self.process_call.number)

    def batch_norm(
        self, input: Tensor, weight: Tensor | None, bias: Tensor | None, running: stats.Running, eps: float,
        residual: Tensor | None, negative_slope: float | None, mask: Tensor | None = None,
    ) -> Tensor:
        """This replica's call of :func:`syncbn.functions.sync_batchnorm.sync_batch_norm`'s math with the
        statistics over every replica and rank (or :attr:`given`), and a backward that meets
        again: ``running`` is (running_mean, running_var, num_batches_tracked, momentum); ``mask``
        (bool ``(N, *spatial)``, or None) limits the statistics to its valid positions."""
        return self._run("sync_batch_norm", input, weight, bias, *running, eps, residual, negative_slope, tail=(mask,))

    def inplace_abn(
        self, x: Tensor, weight: Tensor | None, bias: Tensor | None, running: stats.Running, eps: float,
        activation: str, activation_param: float,
    ) -> Tensor:
        """:func:`syncbn.functions.inplace_abn.inplace_abn`'s math written over ``x``, with the statistics
        over every replica and rank (or :attr:`given`), and a backward that meets again."""
        return self._run("inplace_abn", x, weight, bias, *running, eps, activation, activation_param)

    def _run(self, name: str, input: Tensor, *arguments: Any, tail: tuple = ()) -> Tensor:
        """``tail``: the arguments after ``given``, by position (no keywords to parse). Raises
        :class:`~syncbn.functions.ReplicaSyncError` where the round broke."""
        call = self.replica_call
        round = None if call is None else call.round.native()  # raises where replicas cannot meet
        native_call = getattr(_native(self.layer), name)
        if self.process_call is not None:  # what the native Ranks reads of the call
            self.native = distributed.native_ranks(self.process_call, input.dtype, input.device)
        try:
            y, mean, invstd, self.count = native_call(
                round, 0 if call is None else call.index,
                0 if call is None else call.number, input, *arguments, self.layer,
                None if self.process_call is None else self, self.given, *tail,
            )
        except ReplicaSyncError as error:
            cause = None if call is None else call.round.failure_cause
            if error.__cause__ is None and cause is not None and not isinstance(cause, ReplicaSyncError):
                error.__cause__ = cause
            raise
        self.normalization = mean, invstd
        return y

    def gather_rows(self, row: Tensor) -> Tensor:
        """The all_gather of this process's ``row`` (built by the native call): every
        rank's, (world, len(row))."""
        # a deferred failure found here raises before this rank joins the collective, so that
        # fail() joins it with a failed flag: the ranks' collectives stay paired
        checks.poll()
        self._joined_collective = True
        return distributed.all_gather_rows(row, self.process_call)

    def judge_gathered(self, valid: Tensor, rows: Tensor) -> None:
        """The forward checks where they fail (``valid`` false), read at once: raises
        (:func:`syncbn.functions.synchronization.distributed.judge_gathered`)."""
        distributed.judge_gathered(self.process_call, valid, rows)

    def defer_gathered(self, valid: Tensor, headers: Tensor, ready: checks.Ready | None) -> None:
        """The forward checks where they are deferred: ``valid`` and the rows'
        ``headers`` on their way to host memory, read once ``ready`` has passed
        (:func:`syncbn.functions.synchronization.distributed.defer_gathered`)."""
        distributed.defer_gathered(self.process_call, valid, headers, ready)

    def reduce_row(self, row: Tensor) -> None:
        """The all_reduce of the native backward's ``row``, in place."""
        self._joined_pass = torch_internals.current_graph_task_id()
        distributed.all_reduce_row(row, self.process_call)

    def judge_summed(self, row: Tensor) -> None:
        """The backward checks where they fail, read at once: raises."""
        distributed.judge_summed(self.process_call, row)

    def defer_summed(self, identities: Tensor, ready: checks.Ready | None) -> None:
        """The backward checks where they are deferred: the summed ``identities``
        on their way to host memory (:func:`syncbn.functions.synchronization.distributed.defer_summed`)."""
        distributed.defer_summed(self.process_call, identities, ready)

    def owe_backward(self, y: Tensor) -> None:
        """This call's forward made ``y``, whose backward node will meet the ranks, in the checkpointed
        region :attr:`region` (if any): where a recomputation of that region fails, the failure is
        told through the latest such call's collective that the backward pass runs (:meth:`fail_backward`)."""
        if self.process_call is not None:
            self._owed = True
            if self.region is not None:  # only a region's failed recomputation asks which node runs
                self._node = backend.NATIVE_ROUNDS.weak_node(y)
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
        (:func:`syncbn.functions.checkpointing.met_only_its_own`), so that its recomputation meets no
        one, is it the latest call of the region still owed (the engine runs a graph's nodes in
        reverse order of their making). Elsewhere nothing is certain: no report, and the others
        wait for the collective timeout. A call that has joined its own all_reduce in this pass tells
        no one: the others saw its verdict too, or have moved past it to a collective unknown here."""
        if self.process_call is None or not torch_internals.in_backward_pass():
            return
        if self._joined_pass == torch_internals.current_graph_task_id():
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
        """The latest call still owed that ran in ``region`` and whose node the running backward
        pass executes (an output left out of the loss owes nothing to this pass)."""
        with self._lock:
            owed = [sync for sync in (ref() for ref in self._calls) if sync is not None and sync.region is region]
        for sync in reversed(owed):
            node = sync._node() if sync._node is not None else None
            if _owes(sync) and node is not None and torch_internals.will_engine_execute(node):
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
    capturing (:func:`syncbn.functions.stats.check_not_capturing`), before any work."""
    if input.is_cuda:
        stats.check_not_capturing(torch.cuda.is_current_stream_capturing(), layer, direction)


def check_not_transformed(input: Tensor | None, layer: str) -> None:
    """Refuse a synchronized call of ``layer`` (a layer, or ThreadedDataParallel's replicas) under a
    torch.func transform (on this thread, or one whose wrapped ``input`` reached a replica's
    thread), before any work: its meetings and collectives run outside autograd and outside the
    transforms' interpreters."""
    wrapped = input is not None and torch_internals.is_functorch_wrapped(input)
    if wrapped or torch_internals.functorch_transforms_active():
        raise RuntimeError(
            f"{layer}: torch.func transforms (grad, vjp, jvp, vmap) over a call synchronized across replicas or "
            "processes are not supported; take gradients with torch.autograd (loss.backward(), "
            "torch.autograd.grad), or run the transform on one device in one process, where the layer is "
            "nn.BatchNorm*'s math (vmap with torch.func.replace_all_batch_norm_modules_)"
        )


def _native(layer: str) -> Any:
    """The compiled module that runs every synchronized call. Without it replicas refuse to meet
    and ranks alone take the traced path, so this only names what is missing."""
    if backend.NATIVE_ROUNDS is None:
        raise RuntimeError(f"{layer}: a synchronized call needs the compiled extension, which is not loaded: {backend.BUILD_HINT}")
    return backend.NATIVE_ROUNDS


if backend.NATIVE_ROUNDS is not None:  # the rows' layout, once: the native call builds them
    backend.NATIVE_ROUNDS.set_row_layout(*distributed.row_layout())
