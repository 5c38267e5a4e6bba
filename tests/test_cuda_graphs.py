"""CUDA graph capture: a step that meets other replicas (or ranks), forward or backward alone, is
refused before any work with an error naming the layer, and releases the other replica; a lone
replica's training step captures and replays with the same bits as eager.

Needs a GPU: the whole file is skipped where ``torch.cuda.is_available()`` is false.
"""
from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from syncbn import nn as NN
from testkit.cuda_cases import DEVICE, NEEDS_GPU, native_rounds  # noqa: F401 - native_rounds: a fixture

pytestmark = NEEDS_GPU


def test_capturing_a_synchronized_step_raises_a_clear_error() -> None:
    """A step that meets other replicas (or ranks) cannot be captured in a CUDA graph: the layer
    refuses before any work, naming itself, and its round breaks for the other replica."""
    from helpers import stock_replicas

    bn = NN.SyncBatchNorm2d(4, timeout=30).to(DEVICE)
    replicas = stock_replicas(bn, 2)
    x = torch.randn(2, 4, 3, 3, device=DEVICE)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph") as raised:
        with torch.cuda.graph(graph, stream=stream):
            replicas[0](x)
    assert "SyncBatchNorm2d" in str(raised.value)
    from syncbn.functions import ReplicaSyncError

    with pytest.raises(ReplicaSyncError, match="replica 0 failed: RuntimeError"):
        replicas[1](x)  # released at once, not after 30 s
    assert int(bn.num_batches_tracked) == 0


def test_capturing_a_synchronized_backward_alone_raises_a_clear_error(native_rounds) -> None:
    """The forward ran eagerly on a side stream; capturing the backward on it is refused as the
    forward's capture is, naming the layer, and the other replica's backward is released."""
    from helpers import run_threads, stock_replicas
    from syncbn.functions import ReplicaSyncError

    bn = NN.SyncBatchNorm2d(4, timeout=30).to(DEVICE)
    replicas = stock_replicas(bn, 2)
    xs = [torch.randn(2, 4, 3, 3, device=DEVICE, requires_grad=True) for _ in replicas]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())

    def forward(replica: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.cuda.stream(stream):
            return replica(x)

    outputs = run_threads([lambda r=r, x=x: forward(r, x) for r, x in zip(replicas, xs)])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="its backward meets the other replicas or ranks on the host") as raised:
        with torch.cuda.graph(graph, stream=stream):
            outputs[0].sum().backward()
    assert "SyncBatchNorm2d" in str(raised.value)
    start = time.monotonic()
    with pytest.raises(ReplicaSyncError, match="replica 0 failed: RuntimeError"):
        with torch.cuda.stream(stream):
            outputs[1].sum().backward()
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
def test_a_lone_training_step_captures_and_replays_exactly(momentum) -> None:
    """A lone replica's training step (forward, backward, running statistics) in a CUDA graph,
    replayed on new inputs, against the same model run eagerly: the same bits."""
    torch.manual_seed(0)
    captured = nn.Sequential(NN.SyncBatchNorm2d(6, momentum=momentum), nn.ReLU()).to(DEVICE)
    eager = copy.deepcopy(captured)
    inputs = [torch.randn(4, 6, 5, 5, device=DEVICE) * 2 + 1 for _ in range(6)]
    static_x = inputs[0].clone().requires_grad_()

    def step(model, x):
        for p in model.parameters():
            p.grad = None
        y = model(x)
        y.square().sum().backward()
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graph asks, mirrored in the eager model
        for x in inputs[:2]:
            static_x.grad = None
            static_x.data.copy_(x)
            step(captured, static_x)
            step(eager, x.clone().requires_grad_())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    static_x.grad = None
    for p in captured.parameters():
        p.grad = None
    with torch.cuda.graph(graph):
        static_y = captured(static_x)
        static_y.square().sum().backward()
    # capturing ran nothing; replay the captured step on each later input
    for x in inputs[2:]:
        static_x.data.copy_(x)
        graph.replay()
        x_eager = x.clone().requires_grad_()
        y = step(eager, x_eager)
        torch.cuda.synchronize()
        torch.testing.assert_close(static_y, y, atol=0, rtol=0)
        torch.testing.assert_close(static_x.grad, x_eager.grad, atol=0, rtol=0)
        for (name, a), b in zip(captured.named_parameters(), eager.parameters()):
            torch.testing.assert_close(a.grad, b.grad, atol=0, rtol=0, msg=name)
        for (name, a), b in zip(captured.named_buffers(), eager.buffers()):
            torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
