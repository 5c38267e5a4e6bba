"""How a test sets the synchronized calls' meetings up: how long the replicas poll, and the ranks'
checks deferred without a GPU."""
from __future__ import annotations

import pytest

import contextlib
from typing import Iterator

import syncbn.functions.synchronization.checks as checks
import syncbn.functions.synchronization.replicas as replicas


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
