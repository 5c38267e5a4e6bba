"""Which path a synchronized call takes, for the tests that cover both: one native call per
replica and direction (src/sync_batch_norm.cpp, the default where the compiled module is loaded),
or the autograd Function in Python (functions/sync_batchnorm.py), whose replicas exchange Python
objects at the same native meeting (functions.synchronization.replicas.ReplicaRound.exchange)."""
from __future__ import annotations

import pytest

import contextlib
from typing import Iterator

import syncbn.functions.synchronization.checks as checks
import syncbn.functions.synchronization.replicas as replicas
import syncbn.modules.batchnorm as batchnorm


def through_the_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """Synchronized calls take the autograd Function for the rest of the test."""
    monkeypatch.setattr(batchnorm, "native_serves", lambda: False)


def replicas_spin(monkeypatch: pytest.MonkeyPatch, microseconds: float) -> None:
    """The rounds that begin for the rest of the test poll ``microseconds`` (where a core is
    spare) before their waiters sleep."""
    monkeypatch.setattr(replicas, "SPIN_US", microseconds)


@contextlib.contextmanager
def deferred_checks() -> Iterator[None]:
    """Within the block, the checks across ranks of CPU tensors are deferred as a CUDA tensor's
    are (kept, read later), so that the deferral runs without a GPU; what is pending at the end
    is read (a block that raised leaves it unread), and the next block starts clean."""
    before, checks.DEFER_ON_HOST = checks.DEFER_ON_HOST, True
    try:
        yield
        checks.check_pending()
    finally:
        checks._pending.clear()
        checks.DEFER_ON_HOST = before
