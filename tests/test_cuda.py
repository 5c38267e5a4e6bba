"""The CUDA kernels (src/cuda, ``functions._C_cuda``) against the pure-PyTorch reference
(functions/reference.py), op by op, over layouts, shapes and dtypes chosen to hit every code
path (NCHW and channels_last 2d/3d, C = 1, 3, 65, packs and scalar accesses, one and two
reduction stages, an empty batch, non-contiguous and misaligned input); and our layers on CUDA
against cuDNN's ``nn.BatchNorm2d``, alone and under ``ThreadedDataParallel`` on one GPU repeated.

Needs a GPU: the whole file is skipped where ``torch.cuda.is_available()`` is false. The kernel
tests also need our CUDA kernels registered as the CUDA kernels of torch.ops.syncbn (built by
``./make_ext.sh`` where torch is a CUDA build and a toolkit is found, loaded with
``SYNCBN_CUDA_KERNELS=compiled``); the module tests run through whichever CUDA backend serves.
"""
from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

from functions import ReplicaSyncError, backend, devices, sync_batch_norm
from functions import reference as ref
from functions.ops import affine_act_grads
import test_kernels as kernel_tests  # its tolerances and inputs (tests/ is on the path: pytest.ini)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA is not available: these tests need a GPU"
)

OPS = torch.ops.syncbn  # on CUDA tensors: our CUDA kernels where they are loaded
needs_ops = pytest.mark.skipif(
    backend.COMPILED_CUDA is None,
    reason=f"our CUDA kernels are not loaded (SYNCBN_CUDA_KERNELS=compiled, and {backend.CUDA_BUILD_HINT})",
)
DEVICE = "cuda"
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]

# (shape, memory format): what each one exercises in the kernels (see src/cuda/elementwise.cuh and reduction.cuh)
LAYOUTS = [
    ((4, 3, 5, 7), torch.contiguous_format),  # contiguous, S odd: scalar accesses
    ((4, 3, 5, 7), torch.channels_last),  # channels_last, C = 3 odd: scalar, TX = 3
    ((8, 1, 16, 16), torch.contiguous_format),  # C = 1, contiguous packs
    ((2, 1, 1000), torch.contiguous_format),  # C = 1, rank 3
    ((1000, 1), torch.contiguous_format),  # (N, C) with C = 1
    ((5, 65), torch.contiguous_format),  # rank 2, C = 65
    ((3, 65, 4, 4), torch.channels_last),  # odd C, channels_last
    ((3, 64, 4, 4), torch.channels_last),  # channels_last packs
    ((2, 520, 3, 3), torch.channels_last),  # more than 64 packs of channels: several tiles
    ((6, 16, 1, 1), torch.contiguous_format),  # S = 1: channels_last layout
    ((1, 5, 1, 1), torch.contiguous_format),  # one value per channel
    ((0, 4, 3, 3), torch.contiguous_format),  # empty batch
    ((0, 4, 3, 3), torch.channels_last),
    ((2, 3, 4, 5, 6), torch.channels_last_3d),
    ((2, 8, 4, 4, 4), torch.channels_last_3d),
    ((2, 3, 4, 5, 6), torch.contiguous_format),
    ((3, 17, 33), torch.contiguous_format),
    ((32, 96, 7, 7), torch.contiguous_format),  # small spatial size, many channels
    ((64, 4, 64, 64), torch.contiguous_format),  # large N*HW, few channels: two stages
    ((16, 8, 96, 96), torch.channels_last),  # many rows: two stages, channels_last
    ((2, 2, 600_000), torch.contiguous_format),  # splits forced by the float32 bound
]
LAYOUT_IDS = [f"{tuple(s)}-{str(f).replace('torch.', '')}" for s, f in LAYOUTS]


def make_input(shape, memory_format, dtype, seed=0) -> torch.Tensor:
    return kernel_tests.make_input(shape, memory_format, dtype, seed, DEVICE)


per_channel_args = kernel_tests.per_channel_args
expected_stride = kernel_tests.expected_stride


def assert_all_ops_match(x: torch.Tensor) -> None:
    """The CPU kernel tests' op-by-op and fused-op checks, run on the CUDA kernels."""
    kernel_tests.assert_all_ops_match(x, OPS)
    kernel_tests.assert_fused_ops_match(x, OPS)


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,memory_format", LAYOUTS, ids=LAYOUT_IDS)
def test_each_op_matches_reference(shape, memory_format, dtype) -> None:
    assert_all_ops_match(make_input(shape, memory_format, dtype))


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16], ids=str)
def test_strides_of_neither_layout_and_misaligned_data(dtype) -> None:
    x = make_input((6, 5, 8, 8), torch.contiguous_format, dtype)
    views = [x[:, :, ::2], x.transpose(2, 3), x.permute(0, 2, 3, 1)[..., :3].permute(0, 3, 1, 2)]
    # contiguous, but 1 element past a 16-byte boundary: every access scalar
    flat = torch.empty(x.numel() + 1, dtype=dtype, device=DEVICE)
    views.append(flat[1:].view(x.shape).copy_(x))
    cl = torch.empty(6 * 8 * 8 * 8 + 1, dtype=dtype, device=DEVICE)[1:]  # channels_last, misaligned
    views.append(cl.as_strided((6, 8, 8, 8), (512, 1, 64, 8)).copy_(make_input((6, 8, 8, 8), torch.channels_last, dtype)))
    for view in views:
        assert_all_ops_match(view)


@needs_ops
@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=3)), ids=str)
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=str)
def test_backward_affine_act_returns_what_is_asked(flags, memory_format) -> None:
    x = make_input((4, 6, 5, 8), memory_format, torch.float32)
    dy = make_input(x.shape, memory_format, torch.float32, seed=4)
    residual = make_input(x.shape, memory_format, torch.float32, seed=5)
    mean, invstd, weight, bias = per_channel_args(x)
    for slope in [None, 0.0, 0.2]:
        got = affine_act_grads(OPS.backward_affine_act(dy, x, mean, invstd, weight, bias, residual, slope, *flags), *flags)
        want = affine_act_grads(ref.backward_affine_act(dy, x, mean, invstd, weight, bias, residual, slope, *flags), *flags)
        for a, b in zip(got, want):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=str)
def test_backward_takes_the_forwards_side_of_the_activation(dtype, memory_format) -> None:
    # pre-activation values near 0: the backward recomputes pre exactly as the forward did
    x = make_input((8, 16, 9, 9), memory_format, dtype)
    mean, invstd, weight, bias = per_channel_args(x)
    mean = x.to(ref.accumulation_dtype(dtype)).mean(ref.reduction_dims(x))
    residual = -ref.elemt_forward(x, mean, invstd, weight, bias) * (1 + 1e-7)
    residual = residual.contiguous(memory_format=memory_format)
    y = OPS.elemt_forward(x, mean, invstd, weight, bias, residual, 0.0)
    _, g, _, _ = OPS.backward_affine_act(
        torch.ones_like(x), x, mean, invstd, weight, bias, residual, 0.0, input_grad=False, residual_grad=True, sums=False
    )
    assert torch.equal(g == 1, y > 0)


@needs_ops
@pytest.mark.parametrize(
    "shape,memory_format",
    [((2000, 3), torch.contiguous_format), ((8, 4, 30, 30), torch.channels_last), ((3, 2, 700_000), torch.contiguous_format)],
    ids=str,
)
def test_float32_statistics_of_a_large_mean_are_precise(shape, memory_format) -> None:
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) + 1e4).contiguous(memory_format=memory_format)
    mean, m2 = OPS.local_stats(x.to(DEVICE))
    count = ref.values_per_channel(x)
    truth = x.double()
    dims = ref.reduction_dims(x)
    torch.testing.assert_close(mean.cpu(), truth.mean(dims), rtol=1e-9, atol=0)
    torch.testing.assert_close(m2.cpu() / count, truth.var(dims, correction=0), rtol=1e-5, atol=0)


@needs_ops
def test_non_finite_values_propagate_like_torch() -> None:
    x = torch.randn(8, 4, 3, 3, dtype=torch.float64)
    x[0, 0, 0, 0] = float("nan")
    x[0, 1, 0, 0] = float("inf")  # the channel's first value: no finite pivot
    x[5, 2, 1, 1] = float("-inf")
    for layout in [torch.contiguous_format, torch.channels_last]:
        for dtype in [torch.float64, torch.float32, torch.float16]:
            mean, m2 = OPS.local_stats(x.to(dtype).contiguous(memory_format=layout).to(DEVICE))
            mean_ref, m2_ref = ref.local_stats(x.to(dtype))
            torch.testing.assert_close(mean.cpu(), mean_ref, equal_nan=True, atol=1e-3, rtol=1e-3)
            assert mean[1] == float("inf") and mean[2] == float("-inf") and m2[:3].isnan().all()


@needs_ops
def test_merge_stats_matches_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([3.0, 0.0, 7.0, 1.0], dtype=torch.float64)
    means = torch.randn(4, 6, generator=generator, dtype=torch.float64) * 100
    m2s = torch.rand(4, 6, generator=generator, dtype=torch.float64) * counts.unsqueeze(1)
    means[1], m2s[1] = 0, 0
    got = OPS.merge_stats(counts.to(DEVICE), means.to(DEVICE), m2s.to(DEVICE))
    for a, b in zip(got, ref.merge_stats(counts, means, m2s)):
        torch.testing.assert_close(a.cpu(), b, atol=1e-10, rtol=1e-13)


@needs_ops
def test_ops_run_on_the_current_stream_and_the_inputs_device() -> None:
    x = make_input((4, 8, 16, 16), torch.contiguous_format, torch.float32)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        mean, m2 = OPS.local_stats(x)
    stream.synchronize()
    mean_ref, m2_ref = ref.local_stats(x)
    torch.testing.assert_close(mean, mean_ref)
    if torch.cuda.device_count() > 1:
        x1 = x.to("cuda:1")
        with torch.cuda.device(0):
            assert OPS.local_stats(x1)[0].device == x1.device


@needs_ops
def test_bad_arguments_raise() -> None:
    x = torch.ones(4, 3, device=DEVICE)
    for call in [
        lambda: OPS.local_stats(torch.ones(4, 3, dtype=torch.int64, device=DEVICE)),
        lambda: OPS.local_stats(torch.ones(4, 3)),
        lambda: OPS.elemt_forward(x, torch.zeros(2, device=DEVICE), torch.ones(3, device=DEVICE), None, None),
        lambda: OPS.backward_reduce(torch.ones(4, 2, device=DEVICE), torch.ones(4, 2, device=DEVICE).t(), torch.zeros(4, device=DEVICE)),
        lambda: OPS.backward_reduce(x.double(), x, torch.zeros(3, device=DEVICE)),
    ]:
        with pytest.raises(RuntimeError, match="syncbn"):
            call()


def test_devices_helpers_copy_in_stream_order() -> None:
    x = torch.randn(5, device=DEVICE)
    ready = devices.mark_ready(x)
    assert devices.fetch(x, x.device, ready) is x
    torch.testing.assert_close(devices.fetch(x, "cpu", ready), x.cpu())
    torch.testing.assert_close(devices.counts_on([3, 0, 7], DEVICE).cpu(), torch.tensor([3.0, 0.0, 7.0], dtype=torch.float64))


# ---- the layers on CUDA against cuDNN -----------------------------------------------------


PARITY_TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=6e-2, rtol=3e-2),
    torch.float16: dict(atol=1e-2, rtol=5e-3),
}


@pytest.fixture
def cuda_backend() -> str:
    """The CUDA backend that serves (set at import: run once with SYNCBN_CUDA_KERNELS=compiled too)."""
    return backend.backend_name(torch.device(DEVICE))


def make_pair(dtype, memory_format, channels=6):
    torch.manual_seed(0)
    ref_bn = nn.BatchNorm2d(channels).to(DEVICE)
    with torch.no_grad():
        ref_bn.weight.uniform_(0.5, 1.5)
        ref_bn.bias.normal_()
    from modules import nn as NN

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
    from modules.parallel import ThreadedDataParallel

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
    """Forward and backward under ThreadedDataParallel(['cuda:0'] * R) against cuDNN. Replicas
    that share a GPU share the autograd engine's worker thread of that device (README, Limits),
    so their backward exchange may not meet: that is tolerated as an expected failure with a
    ReplicaSyncError (short timeout), never a hang; where it does meet, it must match."""
    from modules.parallel import ThreadedDataParallel

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
    try:
        y.backward(dy)
    except ReplicaSyncError as error:
        pytest.xfail(f"replicas on one GPU did not meet in backward (README, Limits): {error}")
    torch.testing.assert_close(x_ours.grad, x_ref.grad, atol=tol["atol"] * 20, rtol=tol["rtol"] * 10)
    torch.testing.assert_close(ours.weight.grad, ref_bn.weight.grad, atol=tol["atol"] * 100, rtol=tol["rtol"] * 10)
    torch.testing.assert_close(ours.bias.grad, ref_bn.bias.grad, atol=tol["atol"] * 100, rtol=tol["rtol"] * 10)
