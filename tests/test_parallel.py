"""ThreadedDataParallel as a DataParallel: scatter, gather, gradients, grad mode, errors; also
for modules without batch norm."""
from __future__ import annotations

import threading
import time
from collections import namedtuple

import pytest
import torch
from torch import nn

from modules import nn as NN
from functions import ReplicaSyncError
from modules.parallel import ThreadedDataParallel

Pair = namedtuple("Pair", "first second")


class Recorder(nn.Module):
    """Linear layer that records the chunk sizes and threads it ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2).double()
        self.seen: list = []

    def forward(self, x, scale=1.0, *, extra=None):
        self.seen.append((x.size(0), threading.get_ident(), torch.is_grad_enabled()))
        y = self.linear(x) * scale
        return {"y": y, "pair": Pair(y.sum(), y * 2), "extra": extra}


def test_scatter_gather_and_grads_without_batch_norm() -> None:
    module = Recorder()
    model = ThreadedDataParallel(module, ["cpu"] * 4)
    x = torch.randn(10, 3, dtype=torch.float64, requires_grad=True)
    scale = torch.full((10, 1), 3.0, dtype=torch.float64)
    out = model(x, scale, extra="tag")
    assert sorted(size for size, *_ in module.seen) == [1, 3, 3, 3]
    assert out["extra"] == "tag" and out["y"].shape == (10, 2) and out["pair"].first.shape == (4,)
    loss = out["y"].square().sum() + out["pair"].first.sum() + out["pair"].second.sum()
    grads = torch.autograd.grad(loss, [x, module.linear.weight, module.linear.bias])

    x_ref = x.detach().clone().requires_grad_()
    y_ref = module.linear(x_ref) * scale
    loss_ref = y_ref.square().sum() + y_ref.sum() + (y_ref * 2).sum()
    grads_ref = torch.autograd.grad(loss_ref, [x_ref, module.linear.weight, module.linear.bias])
    torch.testing.assert_close(out["y"], y_ref)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref)


def test_forward_and_backward_run_replicas_concurrently() -> None:
    # a barrier that all three replicas must reach together: serial execution would break it
    forward_barrier, backward_barrier = threading.Barrier(3, timeout=10), threading.Barrier(3, timeout=10)
    threads: list = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            threads.append(threading.get_ident())
            backward_barrier.wait()
            return grad

    class Model(nn.Module):
        def forward(self, x):
            forward_barrier.wait()
            return Spy.apply(x) * 2

    x = torch.randn(6, 2, requires_grad=True)
    ThreadedDataParallel(Model(), ["cpu"] * 3)(x).sum().backward()
    assert len(set(threads)) == 3 and threading.get_ident() not in threads
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


def test_replica_backward_stays_on_its_thread_for_every_device() -> None:
    # with autograd multithreading off on the replica thread, the engine runs CUDA nodes there
    # too, instead of queueing them on its device thread, which (running the gather's backward,
    # waiting for the replicas) would never take them: the deadlock of replicas on CUDA
    seen: list = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(torch._C._is_multithreading_enabled())
            return grad

    class Model(nn.Module):
        def forward(self, x):
            return Spy.apply(x)

    ThreadedDataParallel(Model(), ["cpu"] * 2)(torch.randn(4, 2, requires_grad=True)).sum().backward()
    assert seen == [False, False]
    assert torch._C._is_multithreading_enabled()  # the caller's own setting is untouched


def test_a_replica_stuck_outside_the_exchanges_is_named_after_the_timeout(capfd) -> None:
    # a synchronized layer after the stuck replica's hang point: the other replica waits in its
    # round, whose own timeout names the layer first; without one, the wrapper's bound names it
    release = threading.Event()

    class StuckOnOneRow(nn.Module):
        def forward(self, x):
            if x.size(0) == 1:
                release.wait(30)
            return x * 2

    runner = ThreadedDataParallel(StuckOnOneRow(), ["cpu"] * 2, timeout=0.1)
    start = time.monotonic()
    try:
        with pytest.raises(ReplicaSyncError, match=r"replica\(s\) \[1\] did not finish in time after replicas \[0\]"):
            runner(torch.randn(3, 2))
        assert time.monotonic() - start < 5
    finally:
        release.set()
    assert "StuckOnOneRow" not in capfd.readouterr().out  # the stacks went to stderr
    assert runner(torch.randn(4, 2)).shape == (4, 2)  # the next step runs on fresh workers

    release.clear()
    synced = ThreadedDataParallel(nn.Sequential(StuckOnOneRow(), NN.SyncBatchNorm1d(2, timeout=0.2)), ["cpu"] * 2, timeout=0.1)
    start = time.monotonic()
    try:
        # the layer's error (its longer timeout sets the wrapper's straggler wait: 3 x 0.2 s)
        with pytest.raises(ReplicaSyncError, match=r"'1', forward call 0 .* \[1\] missing"):
            synced(torch.randn(3, 2))
        assert time.monotonic() - start < 5
    finally:
        release.set()
