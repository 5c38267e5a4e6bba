"""A failure in a backward pass across ranks and thread replicas: a checkpoint's recomputation
or a synchronized backward that raises on one rank frees the others at once, through the backward
collective they are certain to wait in, and the failed rank raises its own error; where that
collective is not certain (a region whose recomputation may meet again), nothing is sent."""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from syncbn import nn as NN
from syncbn.functions import torch_internals
from syncbn.parallel import ThreadedDataParallel
from testkit.local_group import run_local_group

F64 = torch.float64
C = 3
TIMEOUT = 30
"""The collective and replica timeout: a participant freed at once waits far less (half of it, on
a loaded machine), one left to the timeout waits all of it."""


class FailingRecomputation(nn.Module):
    """conv -> [ours -> conv -> ours, checkpointed] -> conv -> ours; ``failing`` raises an
    out-of-memory in its recomputation on rank 1."""

    def __init__(self, failing: str, rank: int) -> None:
        super().__init__()
        self.pre, self.a, self.conv, self.b = nn.Conv2d(C, C, 1), NN.BatchNorm2d(C), nn.Conv2d(C, C, 3, padding=1), NN.BatchNorm2d(C)
        self.post, self.c = nn.Conv2d(C, C, 1), NN.BatchNorm2d(C)
        target = getattr(self, failing)
        check = target._check_input

        def failing_check(input: torch.Tensor, z: torch.Tensor | None = None) -> None:
            if rank == 1 and torch_internals.in_backward_pass():
                raise MemoryError("out of memory in the recomputation")
            check(input, z)

        target._check_input = failing_check

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(lambda h: self.b(self.conv(self.a(h))), self.pre(x), use_reentrant=False)
        return self.c(self.post(h))


def _fail_in_a_recomputation(rank: int, world: int, failing: str) -> tuple[str, str | None, float]:
    model = FailingRecomputation(failing, rank).to(F64)
    x = torch.randn(3 + rank, C, 4, 4, dtype=F64)
    start = time.monotonic()
    try:
        model(x).sum().backward()
    except Exception as error:  # noqa: BLE001 (the test looks at what each rank raised)
        cause = error.__cause__ or error.__context__
        return f"{type(error).__name__}: {error}", None if cause is None else type(cause).__name__, time.monotonic() - start
    return "no error", None, time.monotonic() - start


@pytest.mark.parametrize("failing", ["b"])  # "a", the region's first layer: the generated test's examples
def test_a_failing_recomputation_frees_every_rank_at_once(failing: str) -> None:
    # the failing rank raises its own error; the other, waiting in a backward collective, learns
    # of it there at once, not after the collective timeout
    results = run_local_group(_fail_in_a_recomputation, 2, failing, timeout_s=TIMEOUT)
    (waiting, _, waited), (failed, _, failed_after) = results
    assert failed.startswith("MemoryError: out of memory in the recomputation"), failed
    assert "1 rank(s) of the process group failed in this backward pass" in waiting, waiting
    assert waited < TIMEOUT / 2 and failed_after < TIMEOUT / 2, results


class FailingReplica(nn.Module):
    """``FailingRecomputation``'s model, whose ``failing`` layer raises in its recomputation where
    the replica's batch has ``rows`` samples."""

    def __init__(self, failing: str, rows: int) -> None:
        super().__init__()
        self.model = FailingRecomputation("a", rank=0)  # rank 0: not armed there; armed here per replica batch
        self.armed = True
        target = getattr(self.model, failing)
        check = type(target)._check_input

        def failing_check(input: torch.Tensor, z: torch.Tensor | None = None) -> None:
            if self.armed and input.shape[0] == rows and torch_internals.in_backward_pass():
                raise MemoryError("out of memory in the recomputation")
            check(target, input, z)

        target._check_input = failing_check

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


@pytest.mark.parametrize("failing", ["b"])  # "a", the region's first layer: the generated test's examples
def test_a_failing_recomputation_frees_every_thread_replica_at_once(failing: str) -> None:
    # 3 replicas (3, 3 and 1 rows): the one with 1 row fails; the caller gets its error, at once
    model = FailingReplica(failing, rows=1).to(F64)
    runner = ThreadedDataParallel(model, ["cpu"] * 3, timeout=TIMEOUT)
    x = torch.randn(7, C, 4, 4, dtype=F64, requires_grad=True)
    start = time.monotonic()
    with pytest.raises(MemoryError, match="out of memory in the recomputation"):
        runner(x).sum().backward()
    assert time.monotonic() - start < TIMEOUT / 2
    model.armed = False
    runner(x).sum().backward()  # the next step runs clean


def _fail_in_a_synchronized_backward(rank: int, world: int) -> tuple[str, float]:
    torch.manual_seed(0)
    conv, bn, head = nn.Conv2d(C, C, 1), NN.BatchNorm2d(C), NN.BatchNorm2d(C)
    nn.Sequential(conv, bn, head).to(F64)
    h = conv(torch.randn(3 + rank, C, 4, 4, dtype=F64))
    y = head(bn(h))
    if rank == 1:
        with torch.no_grad():
            h.add_(1)  # bn's saved input changed: its backward raises before its all_reduce
    start = time.monotonic()
    try:
        y.sum().backward()
    except Exception as error:  # noqa: BLE001 (the test looks at what each rank raised)
        return f"{type(error).__name__}: {error}", time.monotonic() - start
    return "no error", time.monotonic() - start


def test_a_failing_synchronized_backward_frees_every_rank_at_once() -> None:
    # rank 1's backward of the first layer fails before its all_reduce; rank 0, waiting in that
    # all_reduce, learns of it there at once, not after the collective timeout
    (waiting, waited), (failed, failed_after) = run_local_group(_fail_in_a_synchronized_backward, 2, timeout_s=TIMEOUT)
    assert "modified by an inplace operation" in failed, failed
    assert "1 rank(s) of the process group failed in this backward pass" in waiting, waiting
    assert waited < TIMEOUT / 2 and failed_after < TIMEOUT / 2


class NestedFailing(nn.Module):
    """checkpoint(a -> conv -> checkpoint(b, 5 channels) -> conv): the inner region's first run,
    inside the outer one's recomputation, meets the ranks again; ``a`` raises in its recomputation
    on rank 1."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.a, self.up, self.b, self.down = NN.BatchNorm2d(C), nn.Conv2d(C, 5, 1), NN.BatchNorm2d(5), nn.Conv2d(5, C, 1)
        check = self.a._check_input

        def failing_check(input: torch.Tensor, z: torch.Tensor | None = None) -> None:
            if rank == 1 and torch_internals.in_backward_pass():
                raise MemoryError("out of memory in the recomputation")
            check(input, z)

        self.a._check_input = failing_check

    def outer(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(checkpoint(self.b, self.up(self.a(h)), use_reentrant=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.outer, x, use_reentrant=False)


def _fail_in_a_mixed_region(rank: int, world: int) -> str:
    model = NestedFailing(rank).to(F64)
    try:
        model(torch.randn(3 + rank, C, 4, 4, dtype=F64, requires_grad=True)).sum().backward()
    except Exception as error:  # noqa: BLE001 (the test looks at what each rank raised)
        if rank == 1:
            return f"{type(error).__name__}: {error}"
        return "raised"
    return "no error"


def test_a_failing_recomputation_that_may_meet_again_reports_nothing() -> None:
    # the outer region held another region, whose recomputation meets again: rank 1 cannot know
    # which collective rank 0 is in, so it joins none (no size mismatch that aborts rank 0); it
    # raises its own error, and rank 0 is freed when rank 1's process ends (else by its timeout)
    results = run_local_group(_fail_in_a_mixed_region, 2, timeout_s=TIMEOUT)
    assert results[1].startswith("MemoryError: out of memory in the recomputation"), results
    assert results[0] == "raised", results
