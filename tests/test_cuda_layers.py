"""Our layers on CUDA against cuDNN's ``nn.BatchNorm2d``: the Function and the module alone, under
``ThreadedDataParallel`` on one GPU repeated and across a GPU and the CPU (the fences and copies of
functions.devices), under stock ``nn.DataParallel`` on a side stream, replicas reading the master's
results only once computed, and a synchronized step under ``torch.cuda.set_sync_debug_mode("error")``
(no host synchronization); host values reaching the device.

Needs a GPU: the whole file is skipped where ``torch.cuda.is_available()`` is false. The tests run through whichever CUDA backend serves.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from syncbn.functions import devices, sync_batch_norm
from syncbn.functions.operators import backend
from syncbn import nn as NN
from testkit.cuda_cases import DEVICE, NEEDS_GPU, native_rounds  # noqa: F401 - native_rounds: a fixture

pytestmark = NEEDS_GPU


def test_host_values_reach_the_device() -> None:
    torch.testing.assert_close(devices.host_values_on([3, 0, 7], DEVICE).cpu(), torch.tensor([3.0, 0.0, 7.0], dtype=torch.float64))


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
