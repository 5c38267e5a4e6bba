"""A replica that fails, in forward or in backward, before, between or inside the layers, under
ThreadedDataParallel or replicas made by torch's replicate(): the others are released at once
(never a hang), the failed step changes no state that nn.BatchNorm would keep, and the next step is
exact."""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from syncbn.functions import ReplicaSyncError
from helpers import RaiseOn, assert_buffers_equal, buffers_of, run_threads, stock_replicas
from syncbn import nn as NN
from syncbn.modules.parallel import ThreadedDataParallel


def test_replica_error_releases_the_others_at_once_and_keeps_state() -> None:
    bn = NN.SyncBatchNorm2d(3, timeout=30).double()
    model = ThreadedDataParallel(nn.Sequential(RaiseOn(1), bn), ["cpu"] * 4)
    before = buffers_of(model.module)
    start = time.monotonic()
    with pytest.raises(KeyError, match="batch 1 fails"):  # the original error, not the abort
        model(torch.randn(10, 3, 2, 2, dtype=torch.float64))  # chunks 3,3,3,1
    assert time.monotonic() - start < 30 / 2  # at once: well within the 30 s timeout it guards
    assert_buffers_equal(buffers_of(model.module), before)


def test_step_after_failed_step_is_correct() -> None:
    raiser = RaiseOn(1)
    ours = nn.Sequential(raiser, NN.SyncBatchNorm2d(3, timeout=30)).double()
    ref = nn.BatchNorm2d(3).double()
    model = ThreadedDataParallel(ours, ["cpu"] * 4)
    with pytest.raises(KeyError):
        model(torch.randn(10, 3, 2, 2, dtype=torch.float64))
    raiser.armed = False
    for _ in range(2):
        x = torch.randn(10, 3, 2, 2, dtype=torch.float64)
        torch.testing.assert_close(model(x), ref(x), atol=1e-12, rtol=1e-12)
    assert_buffers_equal(buffers_of(ours[1]), buffers_of(ref))


def test_later_layer_failure_keeps_earlier_update() -> None:
    # as nn.BatchNorm: a layer whose exchange completed keeps its update when a later one fails
    first, second = NN.SyncBatchNorm2d(3, timeout=30), NN.SyncBatchNorm2d(3, timeout=30)
    ours = nn.Sequential(first, RaiseOn(1, ValueError), second).double()
    ref_first = nn.BatchNorm2d(3).double()
    x = torch.randn(10, 3, 2, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="batch 1 fails"):
        ThreadedDataParallel(ours, ["cpu"] * 4)(x)
    ref_first(x)
    assert_buffers_equal(buffers_of(first), buffers_of(ref_first))
    assert_buffers_equal(buffers_of(second), buffers_of(nn.BatchNorm2d(3).double()))


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.fail = x.size(0) == 1
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.fail:
            raise ArithmeticError("backward of the small replica fails")
        return grad


class FailInBackward(nn.Module):
    def forward(self, x):
        return FailingBackward.apply(x)


def test_backward_failure_releases_the_others_and_recovers() -> None:
    bn = NN.SyncBatchNorm2d(3, timeout=30).double()
    model = ThreadedDataParallel(nn.Sequential(bn, FailInBackward()), ["cpu"] * 4)
    x = torch.randn(10, 3, 2, 2, dtype=torch.float64, requires_grad=True)
    start = time.monotonic()
    with pytest.raises(ArithmeticError, match="small replica"):
        model(x).sum().backward()
    assert time.monotonic() - start < 30 / 2  # at once: well within the 30 s timeout it guards
    # the next step is normal
    ref = nn.BatchNorm2d(3).double()
    ref.load_state_dict(bn.state_dict())
    x = torch.randn(9, 3, 2, 2, dtype=torch.float64, requires_grad=True)  # chunks 3,3,3
    x_ref = x.detach().clone().requires_grad_()
    model(x).square().sum().backward()
    ref(x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-12, rtol=1e-12)


def test_failure_inside_the_layer_backward_releases_the_others() -> None:
    bn = NN.SyncBatchNorm1d(2, timeout=30).double()
    replicas = stock_replicas(bn, 2)
    chunks = [torch.randn(n, 2, dtype=torch.float64, requires_grad=True) for n in (2, 1)]
    inputs = [chunk * 1 for chunk in chunks]
    outputs = run_threads([lambda r=r, x=x: r(x) for r, x in zip(replicas, inputs)])
    inputs[1].add_(1)  # replica 1's saved input changed: its backward raises before it meets the others
    start = time.monotonic()
    results = run_threads([lambda o=o, c=c: torch.autograd.grad(o.square().sum(), c) for o, c in zip(outputs, chunks)])
    assert time.monotonic() - start < 30 / 2  # at once: well within the 30 s timeout it guards
    assert isinstance(results[1], RuntimeError) and "modified by an inplace operation" in str(results[1])
    assert isinstance(results[0], ReplicaSyncError) and "replica 1 failed: RuntimeError" in str(results[0])
