"""Checks between ranks whose verdict is computed on the device, and read on the host where that
costs nothing.

A synchronized layer checks at every exchange across processes that the ranks agree (same layer
and call, same dtype, no rank failed before the exchange, more than one value per channel).
The verdict is a small tensor made on the collective's device from the gathered data
(:mod:`syncbn.functions.synchronization.distributed`). One rule says when it is read: where reading it waits for no
device (a CPU tensor), at once, at the layer; on CUDA, where reading it is a host
synchronization (the GPU runs dry until the host has queued the next work, once per layer), it
is deferred:

- each verdict is copied to pinned host memory without waiting, behind an event; every
  synchronized call reads those whose event has completed (no wait), and the end of each
  backward through a synchronized layer reads every verdict up to the last forward one
  (waiting only until the GPU has run the forward's exchanges, not the backward's) and the later
  ones that are ready. A verdict is read at the latest at the end of the next such backward, or
  by :func:`check_pending`.

The debug mode ``SYNCBN_CHECKS=layer`` reads every verdict at its layer (a host synchronization
per layer on CUDA, as ``TORCH_DISTRIBUTED_DEBUG`` trades speed for errors). Under torch.compile
the same verdict is asserted on the device (:mod:`syncbn.functions.synchronization.traced_ranks`).

A deferred failure raises the same error as the debug mode would have, later (its message says
so); the verdicts pending then are dropped with it (they are most often its consequences).
Meanwhile the step went on with the statistics as gathered, but a failed exchange changed no
running statistics (the ``merge_gathered_stats`` operator updates them only where the rows pass
the checks, on the device: :class:`syncbn.functions.synchronization.synchronizer.Synchronizer`).
A rank that raised at once (its own bad input) joined that exchange with a failed flag and then
stops: the others raise when they read that verdict, or wait at their next collective until the
process group's timeout (``init_process_group(timeout=...)``), never a silent hang.
"""
from __future__ import annotations

import os
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import Tensor

from .. import torch_internals

CHECKS_ENV = "SYNCBN_CHECKS"
DEFER_ON_HOST = False
"""Defer host tensors' verdicts too, as a device's (``testkit.paths.deferred_checks``: the
deferral tested without a GPU)."""
MAX_PENDING = 1024
"""Deferred verdicts kept at most; beyond, the oldest is read (waiting for it if need be)."""

DEFERRED_NOTE = (
    " (found by a deferred check: the verdict was read once the device had run it, at the latest "
    f"at the end of the next backward; {CHECKS_ENV}=layer raises at the layer itself)"
)

Explain = Callable[[list], BaseException | None]
"""Turns a verdict read on the host into the error it stands for, or None where all is well."""


def debugging() -> bool:
    """``$SYNCBN_CHECKS=layer``: every verdict read at its layer, waiting for the device."""
    value = os.environ.get(CHECKS_ENV)
    if not value:  # the usual case, on every synchronized call: nothing more to do
        return False
    if value.strip().lower() != "layer":
        raise ValueError(f"{CHECKS_ENV} must be 'layer' (or unset), got {value!r}")
    return True


def reads_at_once(device: torch.device) -> bool:
    """Whether verdicts made on ``device`` are read at the layer: where reading them waits for
    no device (host tensors), or in the debug mode; else deferred (see the module docstring)."""
    return debugging() or (device.type != "cuda" and not DEFER_ON_HOST)


class Ready(Protocol):
    """What a deferred verdict waits for: a ``torch.cuda.Event``, or the native call's event."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass
class _Deferred:
    host: Tensor  # the verdict in host memory (pinned for CUDA), valid once `ready` has passed
    ready: Ready | None
    explain: Explain
    backward: bool  # made in a backward: not waited for at that backward's end
    valid: Tensor | None = None  # the device's judgement of the verdict (verify_judged), in host memory

    def is_ready(self) -> bool:
        return self.ready is None or self.ready.query()

    def read(self) -> BaseException | None:
        if self.ready is not None:
            self.ready.synchronize()  # waits for the GPU up to this verdict only
        if self.valid is not None and _host_values(self.valid):
            return None
        error = self.explain(_host_values(self.host))
        return None if error is None else type(error)(f"{error}{DEFERRED_NOTE}")


def _host_values(host: Tensor) -> list | bool:
    """A verdict's values (or a 0-dim flag's), read from host memory (never from a device)."""
    return host.tolist()


_pending: deque[_Deferred] = deque()
_lock = threading.Lock()
_read_at_end_of: set[int] = set()  # graph tasks whose end reads the deferred verdicts


def verify(verdict: Tensor, explain: Explain) -> list | None:
    """Check ``verdict`` (made on the collective's device, read as a list): at once where
    :func:`reads_at_once` says so (raising ``explain``'s error, returning the values read), else
    deferred (returning None)."""
    if reads_at_once(verdict.device):
        values = _host_values(verdict.cpu())
        error = explain(values)
        if error is not None:
            raise error
        return values
    _defer(verdict, explain)
    return None


def verify_judged(valid: Tensor, verdict: Callable[[], Tensor], explain: Explain) -> bool:
    """:func:`verify` where the device has judged already: ``valid`` (0-dim bool) says whether
    ``verdict()`` (made on the same device) passes. Read at once, or deferred (as :func:`verify`),
    only ``valid`` is read, and the verdict only where it fails, to raise ``explain``'s error.
    Returns whether it was read at once (and passed)."""
    if not reads_at_once(valid.device):
        _defer(verdict(), explain, valid)
        return False
    if not bool(valid):
        values = _host_values(verdict().cpu())
        raise explain(values) or RuntimeError(f"the device judged the ranks' exchange failed, yet its values {values} pass")
    return True


def _defer(verdict: Tensor, explain: Explain, valid: Tensor | None = None) -> None:
    """Keep ``verdict`` (and ``valid``, the device's judgement of it, where given: read first, the
    verdict is explained only where it fails) to read once the device has made it."""
    if verdict.device.type == "cuda":
        host = verdict.to("cpu", non_blocking=True)  # into pinned memory, without waiting
        valid = None if valid is None else valid.to("cpu", non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(verdict.device))
    else:
        host, ready = verdict, None
    defer_read(host, ready, explain, valid)


def defer_read(host: Tensor, ready: Ready | None, explain: Explain, valid: Tensor | None = None) -> None:
    """Keep a verdict already on its way to host memory (``host``, and ``valid``, the device's
    judgement of it, where given), to read once ``ready`` has passed (None: readable now). The
    native call (``Ranks`` in src/ranks.h) makes the copies and the event itself and calls this."""
    in_backward = torch_internals.in_backward_pass()
    with _lock:
        _pending.append(_Deferred(host, ready, explain, in_backward, valid))
        overflow = _pending.popleft() if len(_pending) > MAX_PENDING else None
    if overflow is not None:
        _raise_if_failed(overflow)
    if in_backward:
        read_when_backward_ends()


def read_when_backward_ends() -> None:
    """Queue one read of the deferred verdicts at the end of the running backward (called from a
    synchronized layer's backward; nothing where none is pending)."""
    if not _pending:
        return
    task = torch_internals.current_graph_task_id()
    with _lock:
        if task == -1 or task in _read_at_end_of:
            return
        _read_at_end_of.add(task)

    def read() -> None:
        with _lock:
            _read_at_end_of.discard(task)
            # up to the last forward verdict, waiting: one stream orders them, so the wait is for
            # the forward's exchanges, not for the backward still running on the device
            last_forward = max((i for i, check in enumerate(_pending) if not check.backward), default=-1)
        _read_pending(waits=last_forward + 1)

    torch_internals.at_backward_end(read)


def poll() -> None:
    """Read the deferred verdicts that are ready, without waiting (every synchronized call)."""
    if _pending:
        _read_pending(waits=0)


def check_pending() -> None:
    """Read every deferred verdict now, waiting for the device where need be; raises the first
    failure. Call it where a loop without backward (statistics recalibration) must know."""
    _read_pending(waits=MAX_PENDING + 1)


def _read_pending(waits: int) -> None:
    """The first ``waits`` are read even if not ready (waiting for the device); the first failure
    raises and drops the rest."""
    while True:
        with _lock:
            if not _pending or not (waits > 0 or _pending[0].is_ready()):
                return
            check = _pending.popleft()
        waits -= 1
        _raise_if_failed(check)


def _raise_if_failed(check: _Deferred) -> None:
    error = check.read()
    if error is not None:
        with _lock:
            _pending.clear()
        raise error
