"""The compiled kernels of every device (src/cpu, src/cuda) against the pure-PyTorch reference
(functions/operators/reference.py), op by op: one suite, parametrized over the device, whose kernels are
the backend under test (they skip under ``pytest --kernels reference``, which registers none). The
shapes, layouts and dtypes are chosen per device to hit every code path: C = 1 and C = 65, one
value per channel, an empty batch, sizes that are no multiple of the vector width, rows long
enough to be cut into several pieces, threads (CPU), tiles and two-stage reductions (CUDA); strides
of neither layout and misaligned data, the fused activation's backward, hypothesis-generated
shapes, and the errors of bad arguments. The CUDA cases need a GPU and ``pytest --cuda-kernels
compiled``; elsewhere they skip. The merges and rows: tests/test_kernels_rows.py; precision and
gradcheck: tests/test_kernels_numerics.py; which kernels serve: tests/test_kernels_backend.py."""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from syncbn.functions.operators.ops import affine_act_grads
from syncbn.functions.operators import reference as ref
from testkit.kernel_cases import (
    DEVICES, OPS, expected_stride, make_input, needs_compiled, per_channel_args, stats_tolerance, sum_tolerance, tolerance,
)


# (shape, memory format) per device: the contiguous and channels_last kernel layouts, and the odd
# ones; CUDA's hit its packs, tiles and two-stage reductions (src/cuda/elementwise.cuh, reduction.cuh)
LAYOUTS = {
    "cpu": [
        ((4, 3, 5, 7), torch.contiguous_format),
        ((4, 3, 5, 7), torch.channels_last),
        ((5, 65), torch.contiguous_format),  # rank 2: channels_last layout, C not a multiple of any width
        ((3, 65, 2, 3), torch.channels_last),
        ((2, 1, 1000), torch.contiguous_format),  # C = 1
        ((1000, 1), torch.contiguous_format),
        ((1, 5, 1, 1), torch.contiguous_format),  # one value per channel
        ((6, 16, 1, 1), torch.contiguous_format),  # NCHW with S = 1 takes the channels_last layout
        ((0, 4, 3, 3), torch.contiguous_format),  # empty local batch
        ((0, 4, 3, 3), torch.channels_last),
        ((2, 3, 4, 5, 6), torch.channels_last_3d),
        ((2, 3, 4, 5, 6), torch.contiguous_format),
        ((3, 17, 33), torch.contiguous_format),  # rank 3 (N, C, L)
        ((2, 3, 4, 5, 2, 3), torch.contiguous_format),  # rank 6
        ((3, 2, 70000), torch.contiguous_format),  # several pieces per channel
        ((5000, 3), torch.contiguous_format),  # several pieces of rows
        ((4, 20, 40, 40), torch.channels_last),
    ],
    "cuda": [
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
    ],
}


def device_layouts() -> list:
    """(device, shape, memory format) of every device, marked to skip where it cannot run."""
    return [
        pytest.param(device.values[0], shape, fmt, marks=device.marks, id=f"{device.values[0]}-{shape}-{str(fmt).replace('torch.', '')}")
        for device in DEVICES
        for shape, fmt in LAYOUTS[device.values[0]]
    ]


DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def assert_all_ops_match(x: torch.Tensor) -> None:
    """Every operator (whatever kernels serve x's device) against the reference, on x's device."""
    ops, dtype, count = OPS, x.dtype, x.numel() // x.size(1)
    stride = expected_stride(x)
    mean, m2 = ops.local_stats(x)
    mean_ref, m2_ref = ref.local_stats(x)
    assert mean.dtype == m2.dtype == torch.float64 and mean.device == x.device
    stats_tol = stats_tolerance(dtype)
    torch.testing.assert_close(mean, mean_ref, **stats_tol)
    torch.testing.assert_close(m2, m2_ref, atol=stats_tol["atol"] * max(count, 1), rtol=stats_tol["rtol"])

    mean, invstd, weight, bias = per_channel_args(x)
    for w, b in [(weight, bias), (None, None), (weight.to(dtype), bias.to(dtype))]:
        y = ops.elemt_forward(x, mean, invstd, w, b)
        assert y.dtype == dtype and y.shape == x.shape and (x.numel() == 0 or y.stride() == stride)
        torch.testing.assert_close(y, ref.elemt_forward(x, mean, invstd, w, b), **tolerance(dtype))

    dy = make_input(x.shape, torch.contiguous_format, dtype, seed=2, device=x.device)  # a layout other than x's
    sum_dy, sum_dy_xmu = ops.backward_reduce(dy, x, mean)
    sum_dy_ref, sum_dy_xmu_ref = ref.backward_reduce(dy, x, mean)
    assert sum_dy.dtype == sum_dy_xmu.dtype == mean.dtype
    torch.testing.assert_close(sum_dy, sum_dy_ref, **sum_tolerance(dtype, count))
    torch.testing.assert_close(sum_dy_xmu, sum_dy_xmu_ref, **sum_tolerance(dtype, 10 * count))

    total = max(count, 1)
    for w in [weight, None]:
        dx = ops.backward_elemt(dy, x, mean, invstd, w, sum_dy_ref, sum_dy_xmu_ref, total)
        assert dx.dtype == dtype and (x.numel() == 0 or dx.stride() == stride)
        expected = ref.backward_elemt(dy, x, mean, invstd, w, sum_dy_ref, sum_dy_xmu_ref, total)
        torch.testing.assert_close(dx, expected, **tolerance(dtype))


def clear_of_the_kink(x, mean, invstd, weight, bias, residual) -> torch.Tensor:
    """Where the activation's input is not so near 0 that rounding may put it on either side
    (there the activation's derivative jumps)."""
    scale, shift = ref.affine_params(mean, invstd, weight, bias)
    return ref.pre_activation(x, scale, shift, residual).abs() > 1e-2


def assert_fused_ops_match(x: torch.Tensor) -> None:
    """elemt_forward with a residual and an activation, and backward_affine_act with every
    combination of outputs, against the reference (``ops`` as in assert_all_ops_match)."""
    ops, dtype, count = OPS, x.dtype, x.numel() // x.size(1)
    stride = expected_stride(x)
    mean, invstd, weight, bias = per_channel_args(x)
    bias = bias - 5  # about half the values below 0
    z = make_input(x.shape, torch.contiguous_format, dtype, seed=3, device=x.device) - 5  # another layout than x's
    dy = make_input(x.shape, torch.contiguous_format, dtype, seed=2, device=x.device)
    for residual, slope in [(z, 0.0), (None, 0.1), (z, None), (None, None)]:
        args = (x, mean, invstd, weight, bias, residual, slope)
        y = ops.elemt_forward(*args)
        assert y.dtype == dtype and (x.numel() == 0 or y.stride() == stride)
        torch.testing.assert_close(y, ref.elemt_forward(*args), **tolerance(dtype))
        # no gradient where rounding may put the activation's input on either side of 0
        dy_clear = dy * clear_of_the_kink(*args[:6]).to(dtype)
        for input_grad, residual_grad, sums in [(True, True, True), (True, False, False), (False, True, True),
                                                (False, False, True), (False, False, False)]:
            flags = (input_grad, residual_grad, sums)
            got = affine_act_grads(ops.backward_affine_act(dy_clear, *args, *flags), *flags)
            expected = affine_act_grads(ref.backward_affine_act(dy_clear, *args, *flags), *flags)
            for name, a, b in zip(["dx", "g"], got[:2], expected[:2]):
                assert (a is None) == (b is None), name
                if a is not None:
                    assert a.dtype == dtype and (x.numel() == 0 or a.stride() == stride), name
                    torch.testing.assert_close(a, b, **tolerance(dtype))
            if sums:
                assert got[2].dtype == got[3].dtype == mean.dtype
                torch.testing.assert_close(got[2], expected[2], **sum_tolerance(dtype, count))
                torch.testing.assert_close(got[3], expected[3], **sum_tolerance(dtype, 10 * count))
            else:
                assert got[2] is None and got[3] is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device,shape,memory_format", device_layouts())
def test_each_op_matches_reference(device, shape, memory_format, dtype) -> None:
    assert_all_ops_match(make_input(shape, memory_format, dtype, device=device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device,shape,memory_format", device_layouts())
def test_fused_ops_match_reference(device, shape, memory_format, dtype) -> None:
    assert_fused_ops_match(make_input(shape, memory_format, dtype, device=device))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_strides_of_neither_layout_and_misaligned_data(device, dtype) -> None:
    x = make_input((6, 5, 8, 8), torch.contiguous_format, dtype, device=device)
    views = [x[:, :, ::2], x.transpose(2, 3), x.permute(0, 2, 3, 1)[..., :3].permute(0, 3, 1, 2)]
    # contiguous, but 1 element past a 16-byte boundary: no aligned vector access
    flat = torch.empty(x.numel() + 1, dtype=dtype, device=device)
    views.append(flat[1:].view(x.shape).copy_(x))
    cl = torch.empty(6 * 8 * 8 * 8 + 1, dtype=dtype, device=device)[1:]  # channels_last, misaligned
    views.append(cl.as_strided((6, 8, 8, 8), (512, 1, 64, 8)).copy_(make_input((6, 8, 8, 8), torch.channels_last, dtype)))
    for view in views[:3]:
        assert not view.is_contiguous()
    for view in views:
        assert_all_ops_match(view)
        assert_fused_ops_match(view)


@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=3)), ids=str)
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_backward_affine_act_returns_what_is_asked(device, flags, memory_format) -> None:
    x = make_input((4, 6, 5, 8), memory_format, torch.float32, device=device)
    dy = make_input(x.shape, memory_format, torch.float32, seed=4, device=device)
    residual = make_input(x.shape, memory_format, torch.float32, seed=5, device=device)
    mean, invstd, weight, bias = per_channel_args(x)
    for slope in [None, 0.0, 0.2]:
        args = (dy, x, mean, invstd, weight, bias, residual, slope, *flags)
        got = affine_act_grads(OPS.backward_affine_act(*args), *flags)
        want = affine_act_grads(ref.backward_affine_act(*args), *flags)
        for a, b in zip(got, want):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_backward_takes_the_forwards_side_of_the_activation(device, dtype, memory_format) -> None:
    # pre-activation values near 0: the backward recomputes pre exactly as the forward did
    x = make_input((8, 16, 9, 9), memory_format, dtype, device=device)
    mean, invstd, weight, bias = per_channel_args(x)
    mean = x.to(ref.accumulation_dtype(dtype)).mean(ref.reduction_dims(x))
    residual = -ref.elemt_forward(x, mean, invstd, weight, bias) * (1 + 1e-7)
    residual = residual.contiguous(memory_format=memory_format)
    y = OPS.elemt_forward(x, mean, invstd, weight, bias, residual, 0.0)
    _, g, _, _ = OPS.backward_affine_act(
        torch.ones_like(x), x, mean, invstd, weight, bias, residual, 0.0, input_grad=False, residual_grad=True, sums=False
    )
    assert torch.equal(g == 1, y > 0)


@needs_compiled
@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 9), min_size=2, max_size=5),
    channels_last=st.booleans(),
    dtype=st.sampled_from([torch.float64, torch.float32]),
)
def test_hypothesis_shapes_match_reference(sizes, channels_last, dtype) -> None:
    x = make_input(tuple(sizes), torch.contiguous_format, dtype)
    if channels_last and x.dim() in (4, 5):
        x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    assert_all_ops_match(x)


BAD_CALLS = {
    "integer dtype": lambda ops, d: ops.local_stats(torch.ones(4, 3, dtype=torch.int64, device=d)),
    "rank 1": lambda ops, d: ops.local_stats(torch.ones(4, device=d)),
    "wrong channel count": lambda ops, d: ops.elemt_forward(
        torch.ones(4, 3, device=d), torch.zeros(2, device=d), torch.ones(3, device=d), None, None
    ),
    "dy shape": lambda ops, d: ops.backward_reduce(torch.ones(4, 3, device=d), torch.ones(4, 2, device=d), torch.zeros(2, device=d)),
    "dy dtype": lambda ops, d: ops.backward_reduce(
        torch.ones(4, 3, dtype=torch.float64, device=d), torch.ones(4, 3, device=d), torch.zeros(3, device=d)
    ),
}


@pytest.mark.parametrize("what", list(BAD_CALLS))
@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_raise(device, what) -> None:
    with pytest.raises(RuntimeError, match="syncbn"):
        BAD_CALLS[what](OPS, device)
