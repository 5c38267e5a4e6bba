"""What only CUDA has: the operators on the current stream and the input's device (a guard test
that fails without the guard, on two GPUs), the fences of functions.devices, our layers on CUDA
against cuDNN's ``nn.BatchNorm2d``, alone, under ``ThreadedDataParallel`` on one GPU repeated and
across a GPU and the CPU, under stock ``nn.DataParallel`` on a side stream, and a synchronized
step under ``torch.cuda.set_sync_debug_mode("error")`` (no host synchronization). The CUDA kernels op by op against the reference are
in the one kernel suite, tests/test_kernels.py (its ``cuda`` cases).

Needs a GPU: the whole file is skipped where ``torch.cuda.is_available()`` is false. The kernel
tests also need our CUDA kernels registered as the CUDA kernels of torch.ops.syncbn (built by
``./make_ext.sh`` where torch is a CUDA build and a toolkit is found, loaded with
``pytest --cuda-kernels compiled``); the module tests run through whichever CUDA backend serves.
"""
from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from syncbn.functions import devices, sync_batch_norm
from syncbn.functions.operators import backend
from syncbn.functions.operators import reference as ref
from syncbn.functions.operators import reference_abn as ref_abn
from syncbn import nn as NN
import test_kernels as kernel_tests  # its tolerances and inputs (tests/ is on the path: pytest.ini)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA is not available: these tests need a GPU"
)

OPS = torch.ops.syncbn  # on CUDA tensors: our CUDA kernels where they are loaded
needs_ops = pytest.mark.skipif(
    backend.SERVING["cuda"] != "compiled",
    reason=f"our CUDA kernels do not serve (pytest --cuda-kernels compiled, and {backend.CUDA_BUILD_HINT})",
)
DEVICE = "cuda"


@pytest.fixture
def native_rounds() -> None:
    """The replicas meet natively (src/sync_batch_norm.cpp: device-generic events and
    record_stream), where the compiled module is loaded."""
    if backend.NATIVE_ROUNDS is None:
        pytest.skip("the compiled module is not loaded: replicas cannot meet")


def make_input(shape, memory_format, dtype, seed=0) -> torch.Tensor:
    return kernel_tests.make_input(shape, memory_format, dtype, seed, DEVICE)


@needs_ops
def test_ops_run_on_the_current_stream() -> None:
    # the input is made on the side stream too: the kernels must be queued there (on the default
    # stream they could run before it is written); compared after that stream alone is synced
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x = make_input((4, 8, 16, 16), torch.contiguous_format, torch.float32)
        mean, m2 = OPS.local_stats(x)
    stream.synchronize()
    mean_ref, m2_ref = ref.local_stats(x)
    torch.testing.assert_close(mean, mean_ref, **kernel_tests.stats_tolerance(x.dtype))
    torch.testing.assert_close(m2, m2_ref, **kernel_tests.stats_tolerance(x.dtype))


@needs_ops
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=str)
def test_ops_run_on_the_inputs_device_not_the_current_one(memory_format) -> None:
    # without a device guard the launch would go to cuda:0 with cuda:1's pointers: an illegal
    # address or wrong values, which the comparison catches (not only the output's device)
    x1 = make_input((4, 8, 6, 6), memory_format, torch.float32).to("cuda:1")
    dy1 = torch.randn_like(x1)
    with torch.cuda.device(0):
        mean, m2 = OPS.local_stats(x1)
        m, invstd = mean.float(), torch.rsqrt(m2 / (x1.numel() // 8) + 1e-5).float()
        y = OPS.elemt_forward(x1, m, invstd, None, None)
        sums = OPS.backward_reduce(dy1, x1, m)
        dx = OPS.backward_elemt(dy1, x1, m, invstd, None, *sums, x1.numel() // 8)
    assert {t.device for t in (mean, m2, y, *sums, dx)} == {x1.device}
    torch.cuda.synchronize(1)
    tol = kernel_tests.tolerance(torch.float32)
    torch.testing.assert_close(mean, ref.local_stats(x1)[0], **tol)
    torch.testing.assert_close(y, ref.elemt_forward(x1, m, invstd, None, None), **tol)
    torch.testing.assert_close(sums, ref.backward_reduce(dy1, x1, m), **kernel_tests.sum_tolerance(torch.float32, x1.numel() // 8))
    torch.testing.assert_close(dx, ref.backward_elemt(dy1, x1, m, invstd, None, *sums, x1.numel() // 8), **tol)


def test_host_values_reach_the_device() -> None:
    torch.testing.assert_close(devices.host_values_on([3, 0, 7], DEVICE).cpu(), torch.tensor([3.0, 0.0, 7.0], dtype=torch.float64))


# ---- the layers on CUDA against cuDNN -----------------------------------------------------


PARITY_TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=6e-2, rtol=3e-2),
    torch.float16: dict(atol=1e-2, rtol=5e-3),
}


@pytest.fixture
def cuda_backend() -> str:
    """The CUDA backend that serves (run once with --cuda-kernels compiled too)."""
    return backend.backend_name(torch.device(DEVICE))


def make_pair(dtype, memory_format, channels=6):
    torch.manual_seed(0)
    ref_bn = nn.BatchNorm2d(channels).to(DEVICE)
    with torch.no_grad():
        ref_bn.weight.uniform_(0.5, 1.5)
        ref_bn.bias.normal_()

    ours = NN.convert_sync_batchnorm(copy.deepcopy(ref_bn))
    return ref_bn, ours


@pytest.mark.parametrize("dtype", list(PARITY_TOLERANCE), ids=str)
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=str)
def test_function_matches_cudnn(cuda_backend, dtype, memory_format) -> None:
    """Our Function (the synchronized path, one replica) against cuDNN's training batch norm;
    half inputs with float32 parameters, as under autocast."""
    ref_bn, _ = make_pair(dtype, memory_format)
    x = (torch.randn(8, 6, 20, 20, device=DEVICE) * 3 + 1).to(dtype).contiguous(memory_format=memory_format)
    dy = torch.randn_like(x)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    w = ref_bn.weight.detach().clone().requires_grad_()
    b = ref_bn.bias.detach().clone().requires_grad_()
    rm, rv = torch.zeros(6, device=DEVICE), torch.ones(6, device=DEVICE)
    rm_ref, rv_ref = rm.clone(), rv.clone()
    y_ref = torch.nn.functional.batch_norm(x_ref, rm_ref, rv_ref, ref_bn.weight, ref_bn.bias, True, 0.1, 1e-5)
    y = sync_batch_norm(x_ours, rm, rv, w, b, 0.1, 1e-5)
    tol = PARITY_TOLERANCE[dtype]
    torch.testing.assert_close(y, y_ref, **tol)
    assert y.is_contiguous(memory_format=memory_format)
    grads_ref = torch.autograd.grad(y_ref, [x_ref, ref_bn.weight, ref_bn.bias], dy)
    grads = torch.autograd.grad(y, [x_ours, w, b], dy)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, atol=tol["atol"] * 20, rtol=tol["rtol"] * 10)
    torch.testing.assert_close(rm, rm_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rv, rv_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", list(PARITY_TOLERANCE), ids=str)
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=str)
def test_module_matches_cudnn_alone(cuda_backend, dtype, memory_format) -> None:
    """modules.nn on one device (a lone replica: cuDNN unless the backend serves it), under autocast-like dtypes."""
    ref_bn, ours = make_pair(dtype, memory_format)
    x = (torch.randn(8, 6, 20, 20, device=DEVICE) * 3 + 1).to(dtype).contiguous(memory_format=memory_format)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y = ref_bn(x_ref), ours(x_ours)
    torch.testing.assert_close(y, y_ref, **PARITY_TOLERANCE[dtype])
    dy = torch.randn_like(y)
    y_ref.backward(dy)
    y.backward(dy)
    torch.testing.assert_close(x_ours.grad, x_ref.grad, **PARITY_TOLERANCE[dtype])
    torch.testing.assert_close(ours.running_var, ref_bn.running_var, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("dtype", list(PARITY_TOLERANCE), ids=str)
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=str)
def test_threaded_replicas_on_one_gpu_match_cudnn_forward(cuda_backend, replicas, dtype, memory_format) -> None:
    """ThreadedDataParallel over ['cuda:0'] * R: the replicas' forward exchange (statistics over
    the whole batch, running statistics updated once) against cuDNN on the full batch."""
    from syncbn.modules.parallel import ThreadedDataParallel

    ref_bn, ours = make_pair(dtype, memory_format)
    runner = ThreadedDataParallel(ours, ["cuda:0"] * replicas)
    for _ in range(2):
        x = (torch.randn(10, 6, 12, 12, device=DEVICE) * 3 + 1).to(dtype).contiguous(memory_format=memory_format)
        with torch.no_grad():
            y_ref, y = ref_bn(x), runner(x)
        torch.testing.assert_close(y, y_ref, **PARITY_TOLERANCE[dtype])
    torch.testing.assert_close(ours.running_mean, ref_bn.running_mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.running_var, ref_bn.running_var, atol=1e-5, rtol=1e-5)
    assert int(ours.num_batches_tracked) == int(ref_bn.num_batches_tracked)


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_threaded_replicas_on_one_gpu_backward(cuda_backend, replicas, dtype, monkeypatch) -> None:
    """Forward and backward under ThreadedDataParallel(['cuda:0'] * R) against cuDNN: each
    replica runs its backward on its own thread (not on the engine's thread of the GPU, which
    runs the gather's backward and waits for them), so the replicas meet in backward. A short
    timeout turns a regression into an error instead of a hang."""
    from syncbn.modules.parallel import ThreadedDataParallel

    monkeypatch.setenv("SYNCBN_TIMEOUT", "10")
    ref_bn, ours = make_pair(dtype, torch.contiguous_format)
    runner = ThreadedDataParallel(ours, ["cuda:0"] * replicas)
    x = (torch.randn(10, 6, 12, 12, device=DEVICE) * 3 + 1).to(dtype)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y = ref_bn(x_ref), runner(x_ours)
    tol = PARITY_TOLERANCE[dtype]
    torch.testing.assert_close(y, y_ref, **tol)
    dy = torch.randn_like(y)
    y_ref.backward(dy)
    y.backward(dy)
    torch.testing.assert_close(x_ours.grad, x_ref.grad, atol=tol["atol"] * 20, rtol=tol["rtol"] * 10)
    torch.testing.assert_close(ours.weight.grad, ref_bn.weight.grad, atol=tol["atol"] * 100, rtol=tol["rtol"] * 10)
    torch.testing.assert_close(ours.bias.grad, ref_bn.bias.grad, atol=tol["atol"] * 100, rtol=tol["rtol"] * 10)


def resnet_block(channels: int = 6) -> nn.Module:

    return NN.convert_sync_batchnorm(
        nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 1, bias=False),
            nn.BatchNorm2d(channels, momentum=None),
        )
    ).to(DEVICE)


@pytest.mark.parametrize("devices_", [["cuda:0", "cuda:0"], ["cuda:0", "cpu"]], ids=["two-on-one-gpu", "gpu-and-cpu"])
def test_threaded_step_matches_the_full_batch(devices_, monkeypatch, native_rounds) -> None:
    """A replica exchange on one GPU, and across a GPU and the CPU (the events, record_stream
    and copies of functions.devices), against torch's layers on the full batch, float32."""
    from syncbn.modules.parallel import ThreadedDataParallel

    monkeypatch.setenv("SYNCBN_TIMEOUT", "10")
    torch.manual_seed(0)
    ours = resnet_block()
    theirs = copy.deepcopy(ours)

    theirs = NN.revert_sync_batchnorm(theirs)
    runner = ThreadedDataParallel(ours, devices_)
    for step in range(2):
        x = torch.randn(5, 3, 8, 8, device=DEVICE)
        x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
        y, y_ref = runner(x_ours), theirs(x_ref)
        torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
        y.backward(torch.ones_like(y))
        y_ref.backward(torch.ones_like(y_ref))
        torch.testing.assert_close(x_ours.grad, x_ref.grad, atol=1e-4, rtol=1e-4)
    for (name, a), b in zip(ours.named_buffers(), theirs.buffers()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


def test_a_synchronized_step_never_synchronizes_the_host(native_rounds) -> None:
    """torch's sync debug mode raises on any host synchronization (a device value read on the
    host, a pageable copy, a stream synchronize) during a threaded step on one GPU, forward and
    backward, running statistics with momentum None included."""
    from syncbn.modules.parallel import ThreadedDataParallel

    runner = ThreadedDataParallel(resnet_block(), ["cuda:0"] * 2)
    x = torch.randn(6, 3, 8, 8, device=DEVICE, requires_grad=True)
    runner(x).sum().backward()  # the first step may load kernels and warm the caches
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            runner(x).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nn.DataParallel replicates on two GPUs or more")
def test_stock_data_parallel_on_a_side_stream(native_rounds) -> None:
    """Stock nn.DataParallel over every visible GPU, called on a non-default stream: the
    replicas run on that stream (parallel_apply enters it), so must our fences and copies."""
    torch.manual_seed(0)
    ours = resnet_block()

    theirs = NN.revert_sync_batchnorm(copy.deepcopy(ours))
    runner = nn.DataParallel(ours, device_ids=list(range(torch.cuda.device_count())))
    x = torch.randn(8, 3, 8, 8, device=DEVICE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x_ours = x.clone().requires_grad_()
        y = runner(x_ours)
        y.backward(torch.ones_like(y))
    stream.synchronize()
    x_ref = x.clone().requires_grad_()
    y_ref = theirs(x_ref)
    y_ref.backward(torch.ones_like(y_ref))
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(x_ours.grad, x_ref.grad, atol=1e-4, rtol=1e-4)


def test_replicas_read_the_masters_results_only_after_they_are_computed() -> None:
    """The master publishes mean and invstd behind an event that must follow their computation:
    replica 1 (on the CPU) copies them on its own thread's stream of cuda:0 while the master runs
    on a side stream. With the event recorded before ``(var + eps).rsqrt()`` was queued, the copy
    of 2**25 channels starts while that kernel still writes them, and replica 1 normalizes with
    stale memory. float64, so that the only work after the event is that kernel."""
    from syncbn.modules.parallel import ThreadedDataParallel

    channels = 2**25
    ours = NN.SyncBatchNorm1d(channels, affine=False, timeout=60).double().to(DEVICE)
    theirs = nn.BatchNorm1d(channels, affine=False).double().to(DEVICE)
    runner = ThreadedDataParallel(ours, ["cuda:0", "cpu"])
    x = torch.randn(4, channels, device=DEVICE, dtype=torch.float64) * 3 + 1
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        y = runner(x)
        y_ref = theirs(x)
    stream.synchronize()
    torch.testing.assert_close(y, y_ref, atol=1e-10, rtol=1e-10)


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


# ---- the in-place activated batch norm's kernels (abn_*, src/cuda/inplace_abn.cu) ----------
# Each op on CUDA tensors against the reference (functions.operators.reference, run on the same CUDA
# tensors), and torch.library.opcheck of each on CUDA inputs.

ABN_ACTIVATIONS = [("leaky_relu", 0.01), ("leaky_relu", 0.3), ("elu", 1.0), ("elu", 0.5), ("identity", 0.0)]
ABN_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
ABN_LAYOUTS = [
    ((4, 6, 5, 7), torch.contiguous_format),  # S = 35: scalar accesses
    ((4, 6, 8, 8), torch.contiguous_format),  # 16-byte packs along S
    ((4, 6, 5, 7), torch.channels_last),  # C = 6: scalar accesses
    ((3, 16, 4, 5), torch.channels_last),  # 16-byte packs of channels
    ((2, 8, 2, 3, 4), torch.channels_last_3d),
    ((7, 5), torch.contiguous_format),  # (N, C)
    ((0, 6, 5, 7), torch.contiguous_format),  # an empty batch
    ((0, 16, 4, 5), torch.channels_last),
]
ABN_EPS = 1e-5


def abn_layout_id(value) -> str:
    return str(value).replace("torch.", "")


def abn_channel_args(x: torch.Tensor, affine: bool = True) -> tuple:
    """mean and invstd in the accumulation dtype, float32 weight (channel 0 negative: gamma =
    |weight| + eps) and bias, on x's device; weight and bias None without ``affine``."""
    mean, invstd, weight, bias = kernel_tests.per_channel_args(x)
    weight = weight.clone()
    weight[0] = -1.5
    return (mean, invstd, weight, bias) if affine else (mean, invstd, None, None)


def abn_output(shape, memory_format, dtype, activation, param, affine=True, flat_end=False) -> tuple:
    """(y, dy, mean, invstd, weight, bias): y an output of the reference forward, laid out as
    asked; with ``flat_end`` (elu) some values of y exactly -alpha (z = -inf, act'(z) = 0)."""
    x = make_input(shape, memory_format, dtype)
    mean, invstd, weight, bias = abn_channel_args(x, affine)
    y = x.clone()
    ref_abn.abn_forward_(y, mean, invstd, weight, bias, ABN_EPS, activation, param)
    if flat_end:
        generator = torch.Generator().manual_seed(3)
        mask = (torch.rand(shape, generator=generator) < 0.2).to(DEVICE)
        y = torch.where(mask, torch.full_like(y, -param), y).contiguous(memory_format=memory_format)
    dy = make_input(shape, memory_format, dtype, seed=2) - 5
    return y, dy, mean, invstd, weight, bias


@needs_ops
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no-affine"])
@pytest.mark.parametrize("activation,param", ABN_ACTIVATIONS)
@pytest.mark.parametrize("dtype", ABN_DTYPES, ids=str)
@pytest.mark.parametrize("shape,memory_format", ABN_LAYOUTS, ids=abn_layout_id)
def test_abn_forward_matches_reference_in_place(shape, memory_format, dtype, activation, param, affine) -> None:
    x = make_input(shape, memory_format, dtype)
    mean, invstd, weight, bias = abn_channel_args(x, affine)
    expected = x.clone()
    ref_abn.abn_forward_(expected, mean, invstd, weight, bias, ABN_EPS, activation, param)
    ptr, strides, version = x.data_ptr(), x.stride(), x._version
    assert OPS.abn_forward_(x, mean, invstd, weight, bias, ABN_EPS, activation, param) is None
    assert x.data_ptr() == ptr and x.stride() == strides
    assert x._version > version
    torch.testing.assert_close(x, expected, **kernel_tests.tolerance(dtype))


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_abn_forward_of_strides_of_neither_layout_writes_x(dtype) -> None:
    """x transposed (neither layout): computed in a contiguous copy, written back into x."""
    x = make_input((4, 6, 5, 7), torch.contiguous_format, dtype).transpose(2, 3)
    assert not x.is_contiguous() and not x.is_contiguous(memory_format=torch.channels_last)
    mean, invstd, weight, bias = abn_channel_args(x)
    expected = x.clone()
    ref_abn.abn_forward_(expected, mean, invstd, weight, bias, ABN_EPS, "leaky_relu", 0.01)
    ptr, strides, version = x.data_ptr(), x.stride(), x._version
    OPS.abn_forward_(x, mean, invstd, weight, bias, ABN_EPS, "leaky_relu", 0.01)
    assert x.data_ptr() == ptr and x.stride() == strides and x._version > version
    torch.testing.assert_close(x, expected, **kernel_tests.tolerance(dtype))


@needs_ops
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no-affine"])
@pytest.mark.parametrize("activation,param", ABN_ACTIVATIONS)
@pytest.mark.parametrize("dtype", ABN_DTYPES, ids=str)
@pytest.mark.parametrize("shape,memory_format", ABN_LAYOUTS, ids=abn_layout_id)
def test_abn_backward_matches_reference(shape, memory_format, dtype, activation, param, affine) -> None:
    y, dy, _, invstd, weight, bias = abn_output(shape, memory_format, dtype, activation, param, affine)
    count = ref.values_per_channel(y)
    acc = ref.accumulation_dtype(dtype)
    sums = OPS.abn_backward_reduce(y, dy, weight, bias, ABN_EPS, activation, param)
    sums_ref = ref_abn.abn_backward_reduce(y, dy, weight, bias, ABN_EPS, activation, param)
    assert [(s.dtype, s.shape, s.device) for s in sums] == [(acc, (y.size(1),), y.device)] * 2
    torch.testing.assert_close(tuple(sums), tuple(sums_ref), **kernel_tests.sum_tolerance(dtype, count))
    # with the batch's sums (the reference's, so that only the elementwise pass is compared) and without
    for given in (tuple(sums_ref), (None, None)):
        dx = OPS.abn_backward_elemt(y, dy, invstd, weight, bias, ABN_EPS, activation, param, *given, count)
        dx_ref = ref_abn.abn_backward_elemt(y, dy, invstd, weight, bias, ABN_EPS, activation, param, *given, count)
        assert dx.dtype == dtype and dx.shape == y.shape
        assert dx.stride() == kernel_tests.expected_stride(y)
        torch.testing.assert_close(dx, dx_ref, **kernel_tests.tolerance(dtype))


@needs_ops
@pytest.mark.parametrize("dtype", ABN_DTYPES, ids=str)
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=abn_layout_id)
def test_abn_backward_at_elus_flat_end_is_finite(memory_format, dtype) -> None:
    """y = -alpha (where elu is flat, z = -inf): x_hat and dz are 0 there, no nan."""
    for alpha in (1.0, 0.5):
        y, dy, _, invstd, weight, bias = abn_output((4, 8, 6, 6), memory_format, dtype, "elu", alpha, flat_end=True)
        sums = OPS.abn_backward_reduce(y, dy, weight, bias, ABN_EPS, "elu", alpha)
        assert all(bool(torch.isfinite(s).all()) for s in sums)
        sums_ref = ref_abn.abn_backward_reduce(y, dy, weight, bias, ABN_EPS, "elu", alpha)
        torch.testing.assert_close(tuple(sums), tuple(sums_ref), **kernel_tests.sum_tolerance(dtype, y.numel() // 8))
        dx = OPS.abn_backward_elemt(y, dy, invstd, weight, bias, ABN_EPS, "elu", alpha, *sums_ref, y.numel() // 8)
        assert bool(torch.isfinite(dx).all())
        dx_ref = ref_abn.abn_backward_elemt(y, dy, invstd, weight, bias, ABN_EPS, "elu", alpha, *sums_ref, y.numel() // 8)
        torch.testing.assert_close(dx, dx_ref, **kernel_tests.tolerance(dtype))


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=abn_layout_id)
def test_abn_backward_reduce_of_a_large_batch_is_deterministic(memory_format, dtype) -> None:
    """Enough values per channel for several blocks a channel (partials merged by a second
    kernel): against the reference, and the same bits on a second call."""
    y, dy, _, _, weight, bias = abn_output((32, 8, 24, 24), memory_format, dtype, "leaky_relu", 0.01)
    sums = OPS.abn_backward_reduce(y, dy, weight, bias, ABN_EPS, "leaky_relu", 0.01)
    again = OPS.abn_backward_reduce(y, dy, weight, bias, ABN_EPS, "leaky_relu", 0.01)
    sums_ref = ref_abn.abn_backward_reduce(y, dy, weight, bias, ABN_EPS, "leaky_relu", 0.01)
    torch.testing.assert_close(tuple(sums), tuple(sums_ref), **kernel_tests.sum_tolerance(dtype, y.numel() // 8))
    assert all(torch.equal(a, b) for a, b in zip(sums, again))


@needs_ops
def test_abn_ops_refuse_an_unknown_activation() -> None:
    y, dy, mean, invstd, weight, bias = abn_output((2, 4, 3, 3), torch.contiguous_format, torch.float32, "identity", 0.0)
    calls = [
        lambda: OPS.abn_forward_(y, mean, invstd, weight, bias, ABN_EPS, "relu6", 0.0),
        lambda: OPS.abn_backward_reduce(y, dy, weight, bias, ABN_EPS, "relu6", 0.0),
        lambda: OPS.abn_backward_elemt(y, dy, invstd, weight, bias, ABN_EPS, "relu6", 0.0, None, None, 18),
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match="unknown activation 'relu6'"):
            call()


@needs_ops
@pytest.mark.parametrize("dtype", ABN_DTYPES, ids=str)
@pytest.mark.parametrize("shape,memory_format", ABN_LAYOUTS, ids=abn_layout_id)
def test_abn_opcheck(shape, memory_format, dtype) -> None:
    y, dy, mean, invstd, weight, bias = abn_output(shape, memory_format, dtype, "leaky_relu", 0.01)
    count = max(1, ref.values_per_channel(y))
    sums = ref_abn.abn_backward_reduce(y, dy, weight, bias, ABN_EPS, "leaky_relu", 0.01)
    calls = [
        ("abn_forward_", (y.clone(), mean, invstd, weight, bias, ABN_EPS, "leaky_relu", 0.01)),
        ("abn_forward_", (y.clone(), mean, invstd, None, None, ABN_EPS, "elu", 1.0)),
        ("abn_backward_reduce", (y, dy, weight, bias, ABN_EPS, "leaky_relu", 0.01)),
        ("abn_backward_reduce", (y, dy, None, None, ABN_EPS, "identity", 0.0)),
        ("abn_backward_elemt", (y, dy, invstd, weight, bias, ABN_EPS, "leaky_relu", 0.01, *sums, count)),
        ("abn_backward_elemt", (y, dy, invstd, None, bias, ABN_EPS, "elu", 1.0, None, None, count)),
    ]
    for name, args in calls:
        try:
            torch.library.opcheck(getattr(OPS, name).default, args)
        except Exception as error:  # name the failing call
            raise AssertionError(f"opcheck of syncbn::{name} on {tuple(shape)} {dtype}: {error}") from error
