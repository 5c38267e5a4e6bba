"""Where the replicas of one layer meet inside one process (nn.DataParallel, ThreadedDataParallel).

``replicate()`` calls ``module._replicate_for_data_parallel()`` once per replica, in device order,
for every module. The original layer holds a :class:`RoundTracker`; each call joins the replica
to the tracker's current :class:`ReplicaRound` (index 0 is the master) or opens a new round.
Where a round begins:

- under torch's own ``replicate()`` (stock ``nn.DataParallel``), the replica's position is read
  from that call's loop (:func:`torch_replicate_call`), and under ThreadedDataParallel's
  replication it is said (:func:`replicas_in_order`): replica 0 opens a new round. This
  holds even when the previous step failed before any replica reached the layer and its
  replicas are still alive (an exception's traceback keeps DataParallel's frame alive);
- otherwise a round takes members until it is *sealed* (its first exchange began, or the caller
  said that replication is done, as ThreadedDataParallel does too) or until all its members are gone:
  a replicate() holds every replica of a round alive while it creates them and drops them after
  the step, so a replica whose round-mates are all gone starts a new round.

Replicas meet in the round's native side (src/replica_round.h), keyed by direction and by the
replica's call number, so a layer called twice syncs twice and backward meets the right forward;
the synchronized call runs there whole (src/sync_batch_norm.cpp). Every wait has a timeout; a
failure or a timeout breaks the round for every replica at once. Without the compiled module
replicas cannot meet: the first call raises an error that says how to build it.
"""
from __future__ import annotations

import functools
import os
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, Iterable, Sequence

from torch import nn

from ..operators import backend
from .. import torch_internals
from ..torch_internals import torch_replicate_call

TIMEOUT_ENV = "SYNCBN_TIMEOUT"
DEFAULT_TIMEOUT = 60.0
MAX_TIMEOUT = 1e9
"""Seconds: about 31 years, as good as no timeout; beyond, the waits' deadlines overflow."""
SPIN_US = 300.0
"""How long a replica waiting at a meeting polls (yielding its core) before it sleeps, where a
core is spare (src/replica_round.h, ``spare_core``: the long pollers and the replicas still
working fit in :func:`usable_cores`; else it polls 50 us at most, ``kSharedSpin``): waking a
sleeping thread costs more than that poll where its core went idle, and every other replica
waits through it (benchmarks/bench_sync_overhead.py measures the choice)."""
REPLICA_ATTR = "_sync_replica"


class ReplicaSyncError(RuntimeError):
    """Replicas of a layer could not complete an exchange: one failed, or one never came."""


if backend.NATIVE_ROUNDS is not None:
    backend.NATIVE_ROUNDS.set_replica_sync_error(ReplicaSyncError)  # what a native waiter raises


@functools.cache
def usable_cores() -> int:
    """The CPUs this process may run on (its affinity), read once."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def resolve_timeout(timeout: float | None) -> float:
    """``timeout`` in seconds, else ``$SYNCBN_TIMEOUT``, else 60."""
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV)
        if raw is None:
            return DEFAULT_TIMEOUT
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if not 0 < timeout <= MAX_TIMEOUT:
        raise ValueError(f"the replica timeout must be positive and at most {MAX_TIMEOUT:g} s, got {timeout}")
    return float(timeout)


class ReplicaRound:
    """The replicas of one layer that one replicate() call created, for one step. They meet in
    the round's native side (src/replica_round.h), made at the first exchange; this holds who
    belongs and why the round broke, where Python broke it."""

    def __init__(
        self, layer: str, number: int, timeout: float, spin_us: float | None = None, recomputing: bool = False
    ) -> None:
        self.layer = layer
        self.number = number
        self.timeout = timeout
        self.recomputing = recomputing
        """Whether the replicas were made inside a backward pass: a checkpoint's recomputation of
        the wrapper (their threads are not in the backward themselves)."""
        self.spin_us = SPIN_US if spin_us is None else spin_us
        """How long a replica waiting at this round's meetings polls, where a core is spare,
        before it sleeps (microseconds, 0 to 1e6)."""
        self._members: list[weakref.ref] = []
        self._lock = threading.Lock()
        self._sealed = False
        self._failure: tuple[int | None, BaseException] | None = None
        self._native: Any = None

    @property
    def size(self) -> int:
        return len(self._members)

    def add(self, replica: nn.Module) -> int:
        """Add a replica; returns its index (0 is the master)."""
        with self._lock:
            self._members.append(weakref.ref(replica))
            return len(self._members) - 1

    def accepts_members(self) -> bool:
        with self._lock:
            return not self._sealed and any(ref() is not None for ref in self._members)

    @property
    def sealed(self) -> bool:
        return self._sealed

    def seal(self) -> None:
        with self._lock:
            self._sealed = True

    def abort(self, error: BaseException, index: int | None = None) -> None:
        """Break the round: every replica waiting in it, or arriving later, raises."""
        with self._lock:
            if self._failure is None:
                self._failure = (index, error)
            native = self._native
        if native is not None:
            native.abort(self._failure_reason())

    def native(self) -> Any:
        """The round's native side (:data:`syncbn.functions.operators.backend.NATIVE_ROUNDS`), made at its first
        exchange, which seals the round; broken already where the round is. Without the compiled
        module, replicas cannot meet: a clear error says how to build it."""
        native = self._native  # set once, never unset: read without the lock on every call after
        if native is not None:
            return native
        if backend.NATIVE_ROUNDS is None:
            raise RuntimeError(
                f"{self.layer}: synchronizing replicas in one process needs the compiled extension, which is "
                f"not loaded ({backend.LOAD_PROBLEMS.get('cpu', 'not built')}): {backend.BUILD_HINT}"
            )
        with self._lock:
            if self._native is None:
                self._sealed = True
                self._native = backend.NATIVE_ROUNDS.ReplicaRound(
                    self.size, self.timeout, self.layer, self.number, self.spin_us, usable_cores()
                )
                if self._failure is not None:
                    self._native.abort(self._failure_reason())
            return self._native

    @property
    def failure_cause(self) -> BaseException | None:
        """The error that broke the round from Python, if one did."""
        return None if self._failure is None else self._failure[1]

    def _failure_reason(self) -> str:
        """Why the round broke, as the errors of the replicas that waited say it."""
        index, cause = self._failure  # type: ignore[misc]
        if isinstance(cause, ReplicaSyncError):
            return f"the round was broken: {cause}"
        who = "a replica" if index is None else f"replica {index}"
        return f"{who} failed: {type(cause).__name__}: {cause}"


class ReplicaCall:
    """One call of a replica's layer within a step: what its exchanges are keyed by."""

    __slots__ = ("round", "index", "number")

    def __init__(self, round: ReplicaRound, index: int, number: int) -> None:
        self.round, self.index, self.number = round, index, number


class ReplicaHandle:
    """What a replica module holds: its round, its index and how often it has synced."""

    __slots__ = ("round", "index", "_calls")

    def __init__(self, round: ReplicaRound, index: int) -> None:
        self.round, self.index, self._calls = round, index, 0

    def next_call(self) -> ReplicaCall:
        call = ReplicaCall(self.round, self.index, self._calls)
        self._calls += 1
        return call


class RoundTracker:
    """Held by an original layer (and shared by its replicas): hands out replica rounds.

    Pickles and deep-copies as a fresh tracker, so round state never travels with a module.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: ReplicaRound | None = None
        self._rounds = 0

    def __reduce__(self):
        return (RoundTracker, ())

    def join(self, replica: nn.Module, settings: Callable[[], tuple[str, float]]) -> ReplicaHandle:
        """Add ``replica`` to the current round or to a new one; ``settings()`` gives a new
        round's layer label and timeout (called only where a round begins: this runs for every
        replica of every layer at every step)."""
        position = REPLICATING.index
        if position is None:
            position, root = torch_replicate_call()
            if root is not None:
                release_rounds_on_failure(root)
        with self._lock:
            if self._starts_round(position):
                layer, timeout = settings()  # may raise (a bad timeout): no round number taken
                recomputing = torch_internals.in_backward_pass()  # the replicating thread is the caller's
                self._current = ReplicaRound(layer, self._rounds + 1, timeout, recomputing=recomputing)  # may raise too
                self._rounds += 1
            return ReplicaHandle(self._current, self._current.add(replica))

    def _starts_round(self, position: int | None) -> bool:
        if self._current is None:
            return True
        if position is not None:
            return position == 0 or self._current.sealed
        return not self._current.accepts_members()


class ReplicatingIndex(threading.local):
    """The index of the replica that the replicating code on this thread is making, where that
    code says it (:func:`replicas_in_order`); None elsewhere. Read before
    :func:`torch_replicate_call`, whose walk up the frames costs more: a join runs for
    every replica of every layer at every step."""

    index: int | None = None


REPLICATING = ReplicatingIndex()


def replicas_in_order(module: nn.Module, count: int) -> list[nn.Module]:
    """``count`` replicas of ``module``, made as torch's replicate() makes them (one
    ``_replicate_for_data_parallel()`` per replica, in index order), each with its index in
    :data:`REPLICATING`, so that a synchronized layer's replica 0 opens a new round."""
    replicas, outer = [], REPLICATING.index  # a replication inside a replica's own making
    try:
        for index in range(count):
            REPLICATING.index = index
            replicas.append(module._replicate_for_data_parallel())
    finally:
        REPLICATING.index = outer
    return replicas


def in_recomputation(handle: ReplicaHandle | None) -> bool:
    """Whether a forward runs again inside a backward pass (torch.utils.checkpoint recomputing it):
    on the backward's own thread, or as a replica (``handle``) made there."""
    return torch_internals.in_backward_pass() or (handle is not None and handle.round.recomputing)


def warn_if_data_parallel_meets_no_one() -> None:
    """Warn where stock ``nn.DataParallel`` runs this call as its only replica because no CUDA
    device is visible (once per process: the message is the same for every layer)."""
    if torch_internals.device_less_data_parallel_call():
        warnings.warn(
            "syncbn: nn.DataParallel found no CUDA device, so it runs the whole batch as one replica and "
            "the synchronized layers meet no one (their statistics are the whole batch's); to run CPU "
            "replicas that synchronize, use syncbn.parallel.ThreadedDataParallel",
            UserWarning,
            stacklevel=4,
        )


def release_rounds_on_failure(replica: nn.Module) -> None:
    """Make ``replica`` (a root replica that torch's ``replicate()`` made, as stock
    ``nn.DataParallel`` does each step) break the rounds of its synchronized layers when its
    forward raises, wherever it raised: the replicas waiting at a meeting of that step are
    released at once (a :class:`ReplicaSyncError` naming the failed replica and its error)
    instead of after their timeout. One forward hook, ``always_call=True``, on the replica alone
    (its hook dicts made its own first): the user's module, from which the replicas are copied,
    carries nothing of ours. Registered once per replica."""
    if not torch_internals.has_forward_hook(replica, _break_rounds_if_raised):
        torch_internals.own_forward_hooks(replica)
        replica.register_forward_hook(_break_rounds_if_raised, always_call=True)


def _break_rounds_if_raised(replica: nn.Module, args: Any, result: Any) -> None:
    """The hook of :func:`release_rounds_on_failure`. torch calls an always-called hook from the
    handler of the forward's exception (result None), so the exception is the one handled now."""
    error = sys.exc_info()[1]
    if result is not None or error is None:
        return
    for module in replica.modules():
        handle = getattr(module, REPLICA_ATTR, None)
        if handle is not None:
            handle.round.abort(error, handle.index)


def replica_rounds(replicas: Iterable[nn.Module]) -> list[ReplicaRound]:
    """The distinct rounds that the layers inside these replica modules belong to."""
    rounds: dict[int, ReplicaRound] = {}
    for replica in replicas:
        for module in replica.modules():
            handle = getattr(module, REPLICA_ATTR, None)
            if handle is not None:
                rounds.setdefault(id(handle.round), handle.round)
    return list(rounds.values())


def abort_rounds(rounds: Sequence[ReplicaRound], error: BaseException, index: int | None = None) -> None:
    for round in rounds:
        round.abort(error, index)
