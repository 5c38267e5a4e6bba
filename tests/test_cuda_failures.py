"""A replica failing on the GPU under stock ``nn.DataParallel``'s threading: before a layer (the
others, waiting on cuda:0, released at once), and in backward on one device (the other device's
autograd thread, waiting at the layer, released within seconds).

Needs a GPU: the whole file is skipped where ``torch.cuda.is_available()`` is false.
"""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from syncbn import nn as NN
from testkit.cuda_cases import DEVICE, NEEDS_GPU

pytestmark = NEEDS_GPU


class _RaiseOnBatch(nn.Module):
    """Raises (an out-of-memory error, as a convolution would) in the replica whose chunk has
    ``batch`` samples."""

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch = batch

    def forward(self, x):
        if x.size(0) == self.batch:
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")
        return x


def test_a_replica_failing_before_a_layer_releases_the_others_on_the_gpu() -> None:
    """Stock DataParallel's forward threading on one GPU, replicas made by torch's replicate():
    replica 2 raises before the first layer; replicas 0 and 1, waiting there on cuda:0, raise
    ReplicaSyncError naming it within a second, not after their 30 s timeout."""
    from syncbn.functions import ReplicaSyncError
    from helpers import run_threads, stock_replicas

    model = nn.Sequential(_RaiseOnBatch(1), NN.SyncBatchNorm2d(4, timeout=30)).to(DEVICE)
    replicas = stock_replicas(model, 3)
    chunks = torch.randn(5, 4, 3, 3, device=DEVICE).split([2, 2, 1])
    start = time.monotonic()
    results = run_threads([lambda r=r, c=c: r(c) for r, c in zip(replicas, chunks)])
    assert time.monotonic() - start < 1
    assert isinstance(results[2], torch.OutOfMemoryError)
    assert all(isinstance(e, ReplicaSyncError) and "replica 2 failed: OutOfMemoryError" in str(e) for e in results[:2])
    assert int(model[1].num_batches_tracked) == 0


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise MemoryError("replica 1's backward fails")


def test_a_backward_failing_on_one_device_releases_the_other_devices_thread() -> None:
    """Stock nn.DataParallel's threading on one GPU: replica 0 on cuda:0, replica 1 on the CPU,
    their forwards in two threads, one loss.backward() from this thread, so that replica 0's
    nodes run on CUDA's autograd thread and replica 1's on this one. Replica 1's backward raises
    before its layer: loss.backward() raises at once, and the CUDA thread, waiting for replica
    1's sums at the layer, must leave within a few seconds (not its 30 s timeout), so that the
    next backward on the GPU runs."""
    from syncbn.functions.synchronization.replicas import replicas_in_order
    from helpers import run_threads

    bn = NN.SyncBatchNorm1d(3, timeout=30).to(DEVICE)
    replicas = replicas_in_order(bn, 2)
    for name, param in bn.named_parameters():
        setattr(replicas[0], name, param.view_as(param))
        setattr(replicas[1], name, param.to("cpu"))  # differentiable copies, as replicate() broadcasts
    for name, buffer in bn.named_buffers():
        replicas[1]._buffers[name] = buffer.to("cpu")
    x0 = torch.randn(4, 3, device=DEVICE, requires_grad=True)
    x1 = torch.randn(4, 3, requires_grad=True)
    outputs = run_threads([lambda: replicas[0](x0), lambda: _RaiseInBackward.apply(replicas[1](x1))])
    loss = outputs[0].sum() + outputs[1].to(DEVICE).sum()
    with pytest.raises(MemoryError):
        loss.backward()
    start = time.monotonic()
    probe = torch.ones(3, device=DEVICE, requires_grad=True)
    (probe * 2).sum().backward()  # runs on the CUDA autograd thread: behind the waiter, if it still waits
    torch.cuda.synchronize()
    assert time.monotonic() - start < 5
