"""How long and how replicas wait for each other: a missing replica times out with a clear error
and leaves the state as it was, the timeout from the layer or the environment and its bad values, how
long a waiter polls before it sleeps (its bad values), and that it polls only where a core is spare."""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from syncbn.functions import ReplicaSyncError
from syncbn.functions.operators import backend
from syncbn.functions.synchronization import replicas
from syncbn.functions.synchronization.replicas import ReplicaRound, resolve_timeout
from helpers import assert_buffers_equal, buffers_of
from syncbn import nn as NN
from syncbn.modules.parallel import ThreadedDataParallel
from testkit.paths import replicas_spin


class SkipOn(nn.Module):
    """A data-dependent branch: the replica whose chunk has ``batch`` samples skips ``layer``."""

    def __init__(self, layer: nn.Module, batch: int) -> None:
        super().__init__()
        self.layer, self.batch = layer, batch

    def forward(self, x):
        return x if x.size(0) == self.batch else self.layer(x)


def test_missing_replica_times_out_with_a_clear_error() -> None:
    bn = NN.SyncBatchNorm2d(3, timeout=0.5)
    model = ThreadedDataParallel(nn.Sequential(SkipOn(bn, batch=1)), ["cpu"] * 4)
    before = buffers_of(model.module)
    start = time.monotonic()
    with pytest.raises(ReplicaSyncError) as info:
        model(torch.randn(10, 3, 2, 2))
    assert time.monotonic() - start < replicas.DEFAULT_TIMEOUT / 4  # the given wait, not the default one
    message = str(info.value)
    assert "SyncBatchNorm2d(3) '0.layer'" in message
    assert "forward call 0 of replica round 1" in message
    assert "replicas [0, 1, 2] of 4 arrived, [3] missing" in message
    assert_buffers_equal(buffers_of(model.module), before)
    # the next step, where every replica reaches the layer, works and counts one batch
    model.module[0].batch = -1
    model(torch.randn(10, 3, 2, 2))
    assert int(bn.num_batches_tracked) == 1


def test_timeout_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SYNCBN_TIMEOUT", "0.3")
    model = ThreadedDataParallel(SkipOn(NN.SyncBatchNorm1d(2), batch=1), ["cpu"] * 2)
    start = time.monotonic()
    with pytest.raises(ReplicaSyncError, match="after waiting 0.3s"):
        model(torch.randn(3, 2))  # chunks 2, 1
    assert time.monotonic() - start < replicas.DEFAULT_TIMEOUT / 4  # the given wait, not the default one


def test_bad_timeout_values(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in (0, -1, float("nan"), float("inf"), 1e10):  # beyond 1e9 s the waits' deadlines overflow
        with pytest.raises(ValueError):
            NN.SyncBatchNorm2d(3, timeout=bad)
    monkeypatch.setenv("SYNCBN_TIMEOUT", "inf")
    with pytest.raises(ValueError, match="at most"):
        resolve_timeout(None)


def test_rounds_spin(monkeypatch: pytest.MonkeyPatch) -> None:
    # how long a replica waiting at a native meeting polls before it sleeps: 300 us by default
    monkeypatch.setattr(replicas, "usable_cores", lambda: 2)
    round = ReplicaRound("layer", 1, 5.0)
    members = [nn.Identity() for _ in range(3)]
    for member in members:
        round.add(member)
    assert round.spin_us == replicas.SPIN_US == 300.0
    if backend.NATIVE_ROUNDS is not None:  # the cores that decide who may poll reach the native side
        assert round.native().cores == 2
        assert round.native().spin_us == 300.0
    torch.manual_seed(0)
    x = torch.randn(5, 3, 2, 2, dtype=torch.float64)  # chunks 3, 2
    for value in (0.0, 1000.0):
        round = ReplicaRound("layer", 1, 5.0, spin_us=value)
        if backend.NATIVE_ROUNDS is not None:  # the native side waits with it
            members = [nn.Identity(), nn.Identity()]
            for member in members:
                round.add(member)
            assert round.native().spin_us == value
        replicas_spin(monkeypatch, value)  # the rounds of the layers below
        ours, theirs = NN.SyncBatchNorm2d(3).double(), nn.BatchNorm2d(3).double()
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        y = ThreadedDataParallel(ours, ["cpu"] * 2)(a)
        assert ours._round_tracker._current.spin_us == value
        torch.testing.assert_close(y, theirs(b), rtol=0, atol=1e-12)
        y.square().sum().backward()
        theirs(b).square().sum().backward()
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)


@pytest.mark.skipif(backend.NATIVE_ROUNDS is None, reason="the native meeting checks its spin")
def test_bad_spin_values() -> None:
    for bad in (-1.0, float("nan"), float("inf"), 2e6):
        with pytest.raises(ValueError, match="spin_us"):
            backend.NATIVE_ROUNDS.ReplicaRound(2, 5.0, "layer", 1, bad)


def replica_mark(x: torch.Tensor) -> int:
    """Which replica's chunk ``x`` is, where the caller wrote the index in each chunk's first value."""
    return int(x[0, 0, 0, 0])


class LateReplicas(nn.Module):
    """Every replica but the first sleeps ``seconds`` before going on."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        if replica_mark(x) != 0:
            time.sleep(self.seconds)
        return x


class MeetingCpuTime(nn.Module):
    """``layer``, recording the CPU time its call took on each replica's thread."""

    def __init__(self, layer: nn.Module, seen: dict) -> None:
        super().__init__()
        self.layer, self.seen = layer, seen

    def forward(self, x):
        start = time.thread_time()
        y = self.layer(x)
        self.seen[replica_mark(x)] = time.thread_time() - start
        return y


@pytest.mark.skipif(backend.NATIVE_ROUNDS is None, reason="the native meeting decides who polls")
@pytest.mark.parametrize("replicas_count, cores, polls", [(2, 1, False), (2, 2, True), (3, 2, False), (3, 3, True)])
def test_waiters_poll_only_on_spare_cores(monkeypatch: pytest.MonkeyPatch, replicas_count: int, cores: int, polls: bool) -> None:
    # The first replica waits 0.4 s for the others. It may poll long (burning its core's time, here
    # up to a second) only where the replicas still working leave a core spare: with 3 replicas on
    # 2 cores, the 2 still working need both, so it polls 50 us at most and sleeps.
    replicas_spin(monkeypatch, 1e6)
    monkeypatch.setattr(replicas, "usable_cores", lambda: cores)
    seen: dict = {}
    model = nn.Sequential(LateReplicas(0.4), MeetingCpuTime(NN.SyncBatchNorm2d(3), seen)).double()
    x = torch.randn(3 * replicas_count, 3, 2, 2, dtype=torch.float64)
    x[::3, 0, 0, 0] = torch.arange(replicas_count, dtype=torch.float64)  # chunks of 3: the replica's index first
    with torch.no_grad():
        y = ThreadedDataParallel(model, ["cpu"] * replicas_count)(x)
    torch.testing.assert_close(y, nn.BatchNorm2d(3).double()(x), rtol=0, atol=1e-12)
    assert (seen[0] > 0.1) == polls, f"the first replica's meeting took {seen[0]:.3f} s of CPU time"
