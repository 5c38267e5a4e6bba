"""ThreadedDataParallel's replica threads: forward and backward run concurrently (each backward on
its replica's thread), a replica stuck outside the exchanges is named after the timeout while one
that ends late is waited for, a replica's error is raised again, the backward runs under the
backward's autocast state, and CPU replicas share the caller's intra-op threads."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from syncbn import nn as NN
from syncbn.functions import ReplicaSyncError
from syncbn.modules.parallel import ThreadedDataParallel


def test_forward_and_backward_run_replicas_concurrently() -> None:
    # a barrier that all three replicas must reach together: serial execution would break it.
    # Each backward runs with autograd multithreading off on its replica thread, so the engine
    # runs CUDA nodes there too instead of queueing them on its device thread, which (running
    # the gather's backward, waiting for the replicas) would never take them: the deadlock of
    # replicas on CUDA
    forward_barrier, backward_barrier = threading.Barrier(3, timeout=10), threading.Barrier(3, timeout=10)
    threads: list = []
    multithreading: list = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            threads.append(threading.get_ident())
            multithreading.append(torch._C._is_multithreading_enabled())
            backward_barrier.wait()
            return grad

    class Model(nn.Module):
        def forward(self, x):
            forward_barrier.wait()
            return Spy.apply(x) * 2

    x = torch.randn(6, 2, requires_grad=True)
    ThreadedDataParallel(Model(), ["cpu"] * 3)(x).sum().backward()
    assert len(set(threads)) == 3 and threading.get_ident() not in threads
    assert multithreading == [False] * 3
    assert torch._C._is_multithreading_enabled()  # the caller's own setting is untouched
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


def raises_soon(run, release: threading.Event, pattern: str) -> str:
    """``run()`` raises a ReplicaSyncError matching ``pattern`` within 5 s (its message is
    returned); then the stuck replica is released."""
    start = time.monotonic()
    try:
        with pytest.raises(ReplicaSyncError, match=pattern) as caught:
            run()
        assert time.monotonic() - start < 5
    finally:
        release.set()
    return str(caught.value)


def test_a_replica_stuck_outside_the_exchanges_is_named_after_the_timeout() -> None:
    # without a synchronized layer the wrapper's bound (10 timeouts after the other replica
    # ended) names the stuck replica, with its stack; with one after its hang point, the other
    # replica waits in the layer's round, whose own timeout names the layer first (and, the
    # longer, sets the wrapper's wait after that failure: 3 x 0.2 s)
    release = threading.Event()

    class StuckOnOneRow(nn.Module):
        def forward(self, x):
            if x.size(0) == 1:
                release.wait(30)
            return x * 2

    runner = ThreadedDataParallel(StuckOnOneRow(), ["cpu"] * 2, timeout=0.1)
    message = raises_soon(lambda: runner(torch.randn(3, 2)), release, r"replica\(s\) \[1\] did not finish in time after replicas \[0\]")
    assert "--- replica 1 (thread" in message and "release.wait(30)" in message  # where it hangs
    assert runner(torch.randn(4, 2)).shape == (4, 2)  # the next step runs on fresh workers

    release.clear()
    synced = ThreadedDataParallel(nn.Sequential(StuckOnOneRow(), NN.SyncBatchNorm1d(2, timeout=0.2)), ["cpu"] * 2, timeout=0.1)
    raises_soon(lambda: synced(torch.randn(3, 2)), release, r"'1', forward call 0 .* \[1\] missing")


def test_replicas_that_end_apart_after_the_last_exchange_are_waited_for() -> None:
    # uneven work after the synchronized layers (chunks of 3 and 1 rows, a head per replica) is
    # not a hang: the wrapper waits for the slow replica well past the layers' timeouts
    class SlowTailOnThreeRows(nn.Module):
        def forward(self, x):
            if x.size(0) == 3:
                time.sleep(0.8)
            return x * 2

    model = nn.Sequential(NN.SyncBatchNorm1d(2, timeout=0.1), SlowTailOnThreeRows())
    assert ThreadedDataParallel(model, ["cpu"] * 2, timeout=0.1)(torch.randn(5, 2)).shape == (5, 2)  # 3 + 2 rows


def test_replica_error_is_reraised() -> None:
    class Boom(nn.Module):
        def forward(self, x):
            if x.size(0) == 1:
                raise ZeroDivisionError("small chunk")
            return x

    with pytest.raises(ZeroDivisionError, match="small chunk"):
        ThreadedDataParallel(Boom(), ["cpu"] * 3)(torch.randn(5, 2))


def test_backward_runs_under_the_backward_autocast_state() -> None:
    seen: list = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, grad):
            seen.append(torch.is_autocast_enabled("cpu"))
            return grad

    class Model(nn.Module):
        def forward(self, x):
            return Probe.apply(x)

    x = torch.randn(4, 2, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ThreadedDataParallel(Model(), ["cpu"] * 2)(x)
    y.sum().backward()
    assert seen == [False, False]


class _ThreadsSeenInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, seen: list) -> torch.Tensor:  # type: ignore[override]
        ctx.seen = seen
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ctx.seen.append(("backward", torch.get_num_threads()))
        return grad, None


class ThreadsSeen(nn.Module):
    """Records the intra-op threads that torch's kernels get in the replica's thread."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(("forward", torch.get_num_threads()))
        return _ThreadsSeenInBackward.apply(x, self.seen)


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_cpu_replicas_share_the_callers_intra_op_threads(replicas: int) -> None:
    # R replica threads, each starting a team of all the caller's threads, would put R x threads
    # on the cores; each takes its share instead, and the caller's own setting stays as it was
    from syncbn.functions.operators import backend

    if backend.EXTENSION is None:
        pytest.skip("the per-thread setting needs the compiled module")
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        probe = ThreadsSeen()
        runner = ThreadedDataParallel(probe, ["cpu"] * replicas)
        x = torch.randn(2 * replicas, 3, requires_grad=True)
        runner(x).sum().backward()
        share = max(1, 4 // replicas)
        assert sorted(probe.seen) == sorted([("forward", share)] * replicas + [("backward", share)] * replicas)
        assert torch.get_num_threads() == 4
        seen_elsewhere: list[int] = []
        thread = threading.Thread(target=lambda: seen_elsewhere.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert seen_elsewhere == [4]  # a new thread starts from the process-wide value, untouched
    finally:
        torch.set_num_threads(before)


def test_a_compiled_module_is_refused_naming_the_order_that_works() -> None:
    # its replicas would be copies of torch's compiled wrapper, which replicate into threads wrongly
    model = nn.Sequential(nn.Conv2d(3, 3, 1), NN.BatchNorm2d(3))
    with pytest.raises(TypeError, match=r"torch.compile\(ThreadedDataParallel\(model\)\)"):
        ThreadedDataParallel(torch.compile(model), ["cpu"] * 2)
    with pytest.raises(TypeError, match="holds\\) a torch.compile'd module"):
        ThreadedDataParallel(nn.Sequential(torch.compile(nn.Conv2d(3, 3, 1)), NN.BatchNorm2d(3)), ["cpu"] * 2)
    runner = torch.compile(ThreadedDataParallel(model, ["cpu"] * 2))
    x = torch.randn(4, 3, 4, 4)
    torch.testing.assert_close(runner(x), ThreadedDataParallel(model, ["cpu"] * 2)(x))


def test_replicas_run_without_automatic_garbage_collection() -> None:
    # torch's get_rng_state allocates under the generator's mutex: a collection started there, with
    # another replica in checkpoint's fork_rng, deadlocks both (no timeout can end it)
    import gc

    class Seen(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear, self.collecting = nn.Linear(3, 3), []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.collecting.append(gc.isenabled())
            return self.linear(x)

    probe = Seen()
    ThreadedDataParallel(probe, ["cpu"] * 2)(torch.randn(4, 3, requires_grad=True)).sum().backward()
    assert probe.collecting == [False, False] and gc.isenabled()


@pytest.mark.skipif(torch.accelerator.is_available(), reason="an accelerator is present")
@pytest.mark.parametrize("devices", [[0, 1], ["cuda:0", "cuda:1"]])
def test_an_accelerators_device_without_one_is_refused_naming_what_to_pass(devices: list) -> None:
    with pytest.raises(ValueError, match=r"ThreadedDataParallel: device .* is an accelerator's, and this machine has none.*\['cpu'\] \* n"):
        ThreadedDataParallel(nn.Linear(2, 2), devices)


def test_what_is_not_a_device_is_refused_naming_what_to_pass() -> None:
    with pytest.raises(ValueError, match=r"ThreadedDataParallel: 'bogus' is not a device .*\['cpu'\] \* 2"):
        ThreadedDataParallel(nn.Linear(2, 2), ["bogus"])
