"""Our CUDA kernels where only CUDA can test them: the operators on the current stream and on the
input's device (a guard test that fails without the guard, on two GPUs), and the in-place
activated batch norm's kernels (abn_*, src/cuda/inplace_abn.cu): each op on CUDA tensors against the
reference (functions/operators/reference_abn.py, run on the same CUDA tensors), and
torch.library.opcheck of each on CUDA inputs. The other CUDA kernels op by op against the reference
are in the one kernel suite, tests/test_kernels_*.py (its ``cuda`` cases).

Needs a GPU: the whole file is skipped where ``torch.cuda.is_available()`` is false. These tests
also need our CUDA kernels registered as the CUDA kernels of torch.ops.syncbn (built by
``./make_ext.sh`` where torch is a CUDA build and a toolkit is found, loaded with
``pytest --cuda-kernels compiled``).
"""
from __future__ import annotations

import pytest
import torch

from syncbn.functions.operators import backend
from syncbn.functions.operators import reference as ref
from syncbn.functions.operators import reference_abn as ref_abn
from testkit import kernel_cases as kernel_tests  # its tolerances and inputs
from testkit.cuda_cases import DEVICE, NEEDS_GPU

pytestmark = NEEDS_GPU


OPS = torch.ops.syncbn  # on CUDA tensors: our CUDA kernels where they are loaded
needs_ops = pytest.mark.skipif(
    backend.SERVING["cuda"] != "compiled",
    reason=f"our CUDA kernels do not serve (pytest --cuda-kernels compiled, and {backend.CUDA_BUILD_HINT})",
)


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
