"""The compiled kernels of every device (src/cpu, src/cuda) against the pure-PyTorch reference
(functions/operators/reference.py), op by op: one suite, parametrized over the device, whose kernels are
the backend under test (they skip under ``pytest --kernels reference``, which registers none). The
shapes, layouts and dtypes are chosen per device to hit every code path: C = 1 and C = 65, one
value per channel, an empty batch, sizes that are no multiple of the vector width, rows long
enough to be cut into several pieces, threads (CPU), tiles and two-stage reductions (CUDA);
plus hypothesis-generated shapes, gradcheck through the compiled path, and how the CPU backend
is chosen. The CUDA cases need a GPU and ``pytest --cuda-kernels compiled``; elsewhere they skip."""
from __future__ import annotations

import importlib
import itertools
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from syncbn.functions import sync_batch_norm
from syncbn.functions.operators import backend
from syncbn.functions.operators.ops import affine_act_grads
from syncbn.functions.operators import reference as ref
from syncbn.functions.operators.reference import memory_format_of

COMPILED = backend.EXTENSION if backend.SERVING["cpu"] == "compiled" else None
OPS = torch.ops.syncbn  # dispatches to the kernels of the input's device
needs_compiled = pytest.mark.skipif(COMPILED is None, reason="compiled kernels not built or the reference serves (--kernels reference)")
needs_cuda_kernels = pytest.mark.skipif(
    not torch.cuda.is_available() or backend.SERVING["cuda"] != "compiled",
    reason=f"needs a GPU and our CUDA kernels serving (pytest --cuda-kernels compiled; {backend.CUDA_BUILD_HINT})",
)
DEVICES = [pytest.param("cpu", marks=needs_compiled), pytest.param("cuda", marks=needs_cuda_kernels)]

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


def tolerance(dtype: torch.dtype) -> dict:
    """Elementwise results: the reference rounds once to dtype, so do we (bf16/half: 1 ulp)."""
    return {
        torch.float64: dict(atol=1e-12, rtol=1e-12),
        torch.float32: dict(atol=1e-5, rtol=1e-5),
        torch.bfloat16: dict(atol=2e-2, rtol=1e-2),
        torch.float16: dict(atol=2e-3, rtol=1e-3),
    }[dtype]


def stats_tolerance(dtype: torch.dtype) -> dict:
    """(mean, M2) in float64 of an input of ``dtype``: float32 accumulation below float64
    (the CUDA kernels fold float32 Welford partials into float64)."""
    return dict(atol=1e-12, rtol=1e-12) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)


def sum_tolerance(dtype: torch.dtype, count: int) -> dict:
    """Sums of `count` values: float64 near exact, float32 accumulation otherwise."""
    scale = 1e-12 if dtype == torch.float64 else 1e-5
    return dict(atol=scale * max(count, 1), rtol=scale * 10)


def make_input(shape, memory_format, dtype, seed=0, device="cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator, dtype=torch.float64) * 3 + 5
    return x.to(dtype).contiguous(memory_format=memory_format).to(device)


def per_channel_args(x: torch.Tensor) -> tuple:
    """mean and invstd in the accumulation dtype, float32 weight and bias (as under autocast),
    on x's device."""
    C, acc = x.size(1), ref.accumulation_dtype(x.dtype)
    generator = torch.Generator().manual_seed(1)
    mean = (torch.randn(C, generator=generator, dtype=torch.float64) + 5).to(acc)
    invstd = (torch.rand(C, generator=generator, dtype=torch.float64) + 0.5).to(acc)
    weight = torch.randn(C, generator=generator)
    bias = torch.randn(C, generator=generator)
    return tuple(t.to(x.device) for t in (mean, invstd, weight, bias))


def expected_stride(x: torch.Tensor) -> tuple:
    """Outputs keep x's layout where it is one (NCHW or channels_last), else are contiguous."""
    return x.contiguous(memory_format=memory_format_of(x)).stride()


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


@pytest.mark.parametrize("device", DEVICES)
def test_merge_stats_matches_reference(device) -> None:
    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([3.0, 0.0, 7.0, 1.0], dtype=torch.float64)
    means = torch.randn(4, 6, generator=generator, dtype=torch.float64) * 100
    m2s = torch.rand(4, 6, generator=generator, dtype=torch.float64) * counts.unsqueeze(1)
    means[1], m2s[1] = 0, 0  # an empty part carries zeros
    got = OPS.merge_stats(counts.to(device), means.to(device), m2s.to(device))
    for a, b in zip(got, ref.merge_stats(counts, means, m2s)):
        assert a.device.type == device
        torch.testing.assert_close(a.cpu(), b, atol=1e-10, rtol=1e-13)


def gathered_rows(counts: list[float], channels: int, heads: list[list[float]] | None = None) -> torch.Tensor:
    """Rows as an all_gather over ranks brings them: header [layer, call, failed, count], mean
    and M2 per rank (an empty rank carries zeros)."""
    generator = torch.Generator().manual_seed(len(counts) * 100 + channels)
    n = torch.tensor(counts, dtype=torch.float64).unsqueeze(1)
    means = torch.randn(len(counts), channels, generator=generator, dtype=torch.float64) * 100 * (n > 0)
    m2s = torch.rand(len(counts), channels, generator=generator, dtype=torch.float64) * n
    head = torch.tensor(heads if heads is not None else [[7.0, 2.0, 0.0]] * len(counts), dtype=torch.float64)
    return torch.cat([head, n, means, m2s], dim=1)


GATHERED_CASES = {  # rows, and whether they are valid (agreeing: the first 2 columns, flag: column 2)
    "valid": (gathered_rows([3.0, 0.0, 7.0, 1.0], 6), True),
    "all empty": (gathered_rows([0.0, 0.0], 5), True),
    "one value in all": (gathered_rows([0.0, 1.0, 0.0], 4), False),
    "ranks at other calls": (gathered_rows([2.0, 2.0], 3, [[7.0, 2.0, 0.0], [7.0, 3.0, 0.0]]), False),
    "a rank failed": (gathered_rows([2.0, 0.0, 2.0], 3, [[7.0, 2.0, 0.0], [7.0, 2.0, 1.0], [7.0, 2.0, 0.0]]), False),
    "no channels": (gathered_rows([2.0, 3.0], 0), True),
    # malformed counts (no rank sends these): not valid, so nothing updates (mean and variance
    # are not specified)
    "a fractional total": (gathered_rows([2.5, 1.0], 3), False),
    "a negative total": (gathered_rows([-3.0, 0.0], 3), False),
    "a NaN count": (gathered_rows([float("nan"), 2.0], 3), False),
}


MALFORMED = {"a fractional total", "a negative total", "a NaN count"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(GATHERED_CASES))
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("running_dtype", [torch.float64, torch.float32, torch.float16], ids=str)
def test_merge_gathered_stats_matches_reference(device, case, momentum, running_dtype) -> None:
    rows, valid = GATHERED_CASES[case]
    channels = (rows.size(1) - 4) // 2
    ours = [torch.linspace(-1, 1, channels, dtype=running_dtype), torch.linspace(1, 2, channels, dtype=running_dtype), torch.tensor(4)]
    theirs = [t.clone() for t in ours]
    ours = [t.to(device) for t in ours]
    got = OPS.merge_gathered_stats(rows.to(device), 4, 2, 2, *ours, momentum)
    expected = ref.merge_gathered_stats(rows, 4, 2, 2, *theirs, momentum)
    assert [t.device.type for t in got] == [device] * 4
    assert bool(got[3]) == bool(expected[3]) == valid
    torch.testing.assert_close(got[0].cpu(), expected[0], equal_nan=True)
    if valid or case not in MALFORMED:
        for a, b in zip(got[1:3], expected[1:3]):
            torch.testing.assert_close(a.cpu(), b, atol=1e-10, rtol=1e-13)
    tolerance = {"atol": 1e-3, "rtol": 1e-3} if running_dtype == torch.float16 else {"atol": 1e-6, "rtol": 1e-6}
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.cpu(), b, **tolerance)
    assert ours[2].item() == theirs[2].item() == 4 + valid


@needs_compiled
@pytest.mark.parametrize("momentum", [0.1, None])
def test_merge_gathered_stats_has_the_bits_of_merge_stats_and_update_running_stats(momentum) -> None:
    """On the CPU, checks read at once (merge_stats, then update_running_stats with the host
    count) and deferred (merge_gathered_stats) give every rank the same bits."""
    rows = gathered_rows([3.0, 0.0, 7.0, 5.0], 9)
    heads, means, m2s = rows.split([4, 9, 9], dim=1)
    ours = [torch.rand(9, dtype=torch.float32), torch.rand(9, dtype=torch.float32) + 1, torch.tensor(2)]
    theirs = [t.clone() for t in ours]
    total, mean, var, _ = OPS.merge_gathered_stats(rows, 4, 2, 2, *ours, momentum)
    expected_mean, expected_var = OPS.merge_stats(heads[:, 3], means, m2s)
    OPS.update_running_stats(*theirs, momentum, expected_mean, expected_var, 15)
    assert total.item() == 15
    for a, b in zip([mean, var, *ours], [expected_mean, expected_var, *theirs]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", [(torch.float64, torch.float64), (torch.float32, torch.float16), (torch.bfloat16, torch.float32)], ids=str)
@pytest.mark.parametrize("head", [[7.0, 2.0**52 + 1, -0.5, 3], []], ids=["head", "no head"])
def test_pack_row_matches_reference(device, dtypes, head) -> None:
    a = torch.randn(5, dtype=torch.float64).to(dtypes[0])
    b = torch.randn(9, dtype=torch.float64)[::3].to(dtypes[1])  # not contiguous
    got = OPS.pack_row(head, a.to(device), b.to(device))
    expected = ref.pack_row(head, a, b)
    assert got.device.type == device and got.dtype == torch.float64 and got.shape == (len(head) + 5 + 3,)
    assert torch.equal(got.cpu(), expected)
    assert expected[: len(head)].tolist() == [float(v) for v in head]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16], ids=str)
def test_unpack_row_is_pack_rows_inverse(device, dtype) -> None:
    a, b = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    row = ref.pack_row([3.0, 9.0], a, b).to(device)
    got = OPS.unpack_row(row, 2, dtype)
    expected = ref.unpack_row(row.cpu(), 2, dtype)
    for g, e, original in zip(got, expected, (a, b)):
        assert g.device.type == device and g.dtype == dtype and torch.equal(g.cpu(), e)
        assert torch.equal(e, original.to(dtype))
    got[0].fill_(0)  # new tensors, not views of the row
    assert torch.equal(row[2:8].cpu(), a)


@pytest.mark.parametrize("unpack_row", [OPS.unpack_row, ref.unpack_row], ids=["dispatched", "reference"])
def test_unpack_row_refuses_what_is_no_row(unpack_row) -> None:
    with pytest.raises(RuntimeError, match="expected a 1-D float64 row"):
        unpack_row(torch.zeros(6), 2, torch.float32)
    with pytest.raises(RuntimeError, match="two halves of equal size"):
        unpack_row(torch.zeros(7, dtype=torch.float64), 2, torch.float32)
    with pytest.raises(RuntimeError, match="expected a floating dtype"):
        unpack_row(torch.zeros(6, dtype=torch.float64), 2, torch.int32)


@pytest.mark.parametrize("pack_row", [OPS.pack_row, ref.pack_row], ids=["dispatched", "reference"])
def test_pack_row_refuses_what_is_no_row(pack_row) -> None:
    with pytest.raises(RuntimeError, match="expected 1-D a and b"):
        pack_row([1.0], torch.zeros(2, 2), torch.zeros(2))
    with pytest.raises(RuntimeError, match="expected floating a and b"):
        pack_row([1.0], torch.zeros(2), torch.zeros(2, dtype=torch.int64))
    # the dispatcher sends a meta tensor to the fake implementation: only a GPU mixes two real devices
    other = "cuda" if torch.cuda.is_available() else "meta" if pack_row is ref.pack_row else None
    if other is not None:
        with pytest.raises(RuntimeError, match="expected a and b on one device"):
            pack_row([1.0], torch.zeros(2), torch.zeros(2, device=other))


# M2 of float32 data with mean 1e4 and std 1, relative to the truth: the CPU's float lanes fold
# into double every 16 values, CUDA's threads likewise but over more values per thread
LARGE_MEAN_M2_RTOL = {"cpu": 1e-6, "cuda": 1e-5}


@pytest.mark.parametrize(
    "shape,memory_format",
    [((2000, 3), torch.contiguous_format), ((8, 4, 30, 30), torch.channels_last), ((3, 2, 700_000), torch.contiguous_format)],
    ids=str,
)
@pytest.mark.parametrize("device", DEVICES)
def test_float32_statistics_of_a_large_mean_are_precise(device, shape, memory_format) -> None:
    # mean 1e4, std 1: the pivot shift keeps float32 accumulators as precise as float64 sums
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) + 1e4).contiguous(memory_format=memory_format)
    mean, m2 = OPS.local_stats(x.to(device))
    count = ref.values_per_channel(x)
    truth = x.double()
    dims = ref.reduction_dims(x)
    torch.testing.assert_close(mean.cpu(), truth.mean(dims), rtol=1e-9, atol=0)
    torch.testing.assert_close(m2.cpu() / count, truth.var(dims, correction=0), rtol=LARGE_MEAN_M2_RTOL[device], atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_values_propagate_like_torch(device) -> None:
    x = torch.randn(8, 4, 3, 3, dtype=torch.float64)
    x[0, 0, 0, 0] = float("nan")
    x[0, 1, 0, 0] = float("inf")  # the channel's first value: no finite pivot
    x[5, 2, 1, 1] = float("-inf")
    for layout in [torch.contiguous_format, torch.channels_last]:
        for dtype in [torch.float64, torch.float32, torch.float16]:
            mean, m2 = OPS.local_stats(x.to(dtype).contiguous(memory_format=layout).to(device))
            mean_ref, _ = ref.local_stats(x.to(dtype))
            torch.testing.assert_close(mean.cpu(), mean_ref, equal_nan=True, **tolerance(dtype))
            assert mean[1] == float("inf") and mean[2] == float("-inf") and m2[:3].isnan().all()


@needs_compiled
def test_results_do_not_depend_on_the_thread_count() -> None:
    x = make_input((4, 20, 40, 40), torch.channels_last, torch.float64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = OPS.local_stats(x)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, OPS.local_stats(x)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-12)


@needs_compiled
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_gradcheck_through_compiled_kernels(memory_format) -> None:
    assert backend.backend_name(torch.device("cpu")).startswith("compiled-cpu")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 3, 2, dtype=torch.float64, generator=generator).contiguous(memory_format=memory_format)
    weight = torch.rand(4, dtype=torch.float64, generator=generator) + 0.5
    bias = torch.randn(4, dtype=torch.float64, generator=generator)
    inputs = tuple(t.requires_grad_() for t in (x, weight, bias))
    assert torch.autograd.gradcheck(lambda x, w, b: sync_batch_norm(x, None, None, w, b), inputs)


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


def test_cpu_backend_is_compiled_unless_the_reference_is_forced() -> None:
    if backend.SERVING["cpu"] == "reference":
        assert backend.backend_info()["cpu"] == "reference"
        assert not backend.serves_single_device(torch.device("cpu"))
        return
    assert COMPILED is not None, f"the compiled CPU kernels are not built: {backend.BUILD_HINT}"
    assert COMPILED.capability in backend.usable_cpu_capabilities()
    assert backend.backend_info()["cpu"] == f"compiled-cpu-{COMPILED.capability.lower()}"


@needs_compiled
def test_use_kernels_registers_and_unregisters_the_compiled_kernels() -> None:
    has_cpu_kernel = lambda: torch._C._dispatch_has_kernel_for_dispatch_key("syncbn::local_stats", "CPU")  # noqa: E731
    has_cuda_kernel = lambda: torch._C._dispatch_has_kernel_for_dispatch_key("syncbn::local_stats", "CUDA")  # noqa: E731
    x = torch.randn(6, 3, 4, 4, dtype=torch.float64)
    compiled = OPS.local_stats(x)
    assert has_cpu_kernel() and has_cuda_kernel()
    try:
        backend.use_kernels(cpu="reference", cuda="reference")
        assert not has_cpu_kernel() and not has_cuda_kernel()
        assert backend.backend_info()["cpu"] == backend.backend_info()["cuda"] == "reference"
        assert not backend.serves_single_device(torch.device("cpu"))
        for got, want in zip(OPS.local_stats(x), compiled):  # the reference serves: the same statistics
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        with pytest.raises(ValueError, match="cpu must be one of"):
            backend.use_kernels(cpu="fastest")
    finally:
        backend.use_kernels(cpu="compiled", cuda="torch")
    assert has_cpu_kernel() and has_cuda_kernel()
    assert backend.backend_info()["cuda"] == "torch-cuda-ops"
    if backend.cuda_build_failure() is not None or not backend.extension_files("_C_cuda"):
        with pytest.raises(RuntimeError, match="compiled CUDA kernels are not usable"):
            backend.use_kernels(cuda="compiled")
        assert backend.backend_info()["cuda"] == "torch-cuda-ops" and has_cuda_kernel()


def test_missing_extension_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = importlib.import_module

    def no_extension(name: str, package: str | None = None):
        if name.rpartition(".")[2].startswith("_C_"):
            raise ImportError(f"no module named {name}")
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", no_extension)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert backend.load_extension() is None
    assert len(caught) == 1 and "make_ext.sh" in str(caught[0].message)
    assert "replicas in one process cannot synchronize" in str(caught[0].message)
