"""The compiled CPU kernels of the in-place activated batch norm (src/cpu/inplace_abn.cpp:
``abn_forward_``, ``abn_backward_reduce``, ``abn_backward_elemt``) against the pure-PyTorch
reference (the ``abn_*`` functions of functions/operators/reference.py), called directly: every dtype,
activation (leaky_relu, elu, identity), affine (none, positive and negative weights), the
contiguous and channels_last layouts and a non-contiguous input, sizes with vector tails and
several pieces and threads, an empty batch; that the forward writes over x in place; that the
sums do not depend on the number of threads; the argument checks; and ``torch.library.opcheck``
of the three operators. They skip where the compiled kernels are not loaded."""
from __future__ import annotations

import pytest
import torch

from syncbn.functions.operators import backend
from syncbn.functions.operators import reference as ref
from syncbn.functions.operators import reference_abn as ref_abn
from syncbn.functions.operators.reference import memory_format_of

OPS = torch.ops.syncbn
pytestmark = pytest.mark.skipif(
    not backend.serves_single_device(torch.device("cpu")),
    reason="compiled CPU kernels not built or the reference serves (--kernels reference)",
)

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
ACTIVATIONS = [("leaky_relu", 0.01), ("leaky_relu", 0.3), ("elu", 1.0), ("elu", 0.5), ("identity", 0.0)]
EPS = 1e-5


# (shape, memory format or a function making the layout from a contiguous tensor)
LAYOUTS = [
    ((7, 3), torch.contiguous_format),  # rank 2: the channels_last walk
    ((4, 3, 37), torch.contiguous_format),  # rank 3, S odd: vector tails
    ((3, 3, 5, 7), torch.contiguous_format),
    ((2, 3, 3, 5, 7), torch.contiguous_format),
    ((3, 3, 5, 7), torch.channels_last),  # C = 3: only a partial vector of channels
    ((2, 35, 3, 5, 3), torch.channels_last_3d),  # C = 35: whole vectors of channels and a tail
    ((3, 4, 5, 7), "transposed"),  # neither layout: read from a contiguous copy
    ((3, 3, 5, 14), "sliced"),  # (3, 3, 5, 7), every other value of the last dimension
    ((0, 3, 4, 4), torch.contiguous_format),  # an empty batch
    ((0, 3, 4, 4), torch.channels_last),
    ((4, 3, 67, 67), torch.contiguous_format),  # several pieces per channel, several threads
    ((8, 40, 33, 33), torch.channels_last),  # many pieces of rows
]
LAYOUT_IDS = [f"{shape}-{str(fmt).replace('torch.', '')}" for shape, fmt in LAYOUTS]


def laid_out(t: torch.Tensor, fmt) -> torch.Tensor:
    """t in the layout `fmt`: a memory format, "transposed" or "sliced" (neither layout)."""
    if fmt == "transposed":
        return t.transpose(0, -1).contiguous().transpose(0, -1)
    if fmt == "sliced":
        return t.contiguous()[..., ::2]
    return t.contiguous(memory_format=fmt)


def make(shape, fmt, dtype, seed: int, scale: float = 1.0, offset: float = 0.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=generator, dtype=torch.float64) * scale + offset
    return laid_out(t.to(dtype), fmt)


def affines(C: int, dtype: torch.dtype):
    """(weight, bias) variants: none, float32 (as under autocast) with negative weights, x's dtype."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(C, generator=generator, dtype=torch.float64) * 1.5  # about half negative
    bias = torch.randn(C, generator=generator, dtype=torch.float64)
    return [
        (None, None),
        (weight.float(), bias.float()),
        (weight.to(dtype), bias.to(dtype)),
        (weight.abs().to(dtype), None),
    ]


def stats(C: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(3)
    acc = ref.accumulation_dtype(dtype)
    mean = (torch.randn(C, generator=generator, dtype=torch.float64) * 0.5).to(acc)
    invstd = (torch.rand(C, generator=generator, dtype=torch.float64) + 0.5).to(acc)
    return mean, invstd


def tolerance(dtype: torch.dtype) -> dict:
    """Elementwise results: both round once to dtype (bfloat16 and float16: 1 ulp apart at most)."""
    return {
        torch.float64: dict(atol=1e-12, rtol=1e-12),
        torch.float32: dict(atol=1e-5, rtol=1e-5),
        torch.bfloat16: dict(atol=1.6e-2, rtol=8e-3),
        torch.float16: dict(atol=2e-3, rtol=1e-3),
    }[dtype]


def acc_tolerance(dtype: torch.dtype) -> float:
    return 1e-12 if dtype == torch.float64 else 1e-5


def backward_inputs(shape, fmt, dtype, activation, param, weight, bias):
    """(y, dy): y an output of the activation (elu: some values exactly -alpha, its flat end,
    where z is -inf); dy in another layout than y's where y has one."""
    pre = make(shape, torch.contiguous_format, torch.float64, seed=11, scale=2.0)
    y = ref_abn.abn_activation(pre, activation, param)
    if activation == "elu" and y.numel():
        y.view(-1)[::7] = -param
    y = laid_out(y.to(dtype), fmt)
    other = torch.channels_last if fmt == torch.contiguous_format and len(shape) == 4 else torch.contiguous_format
    return y, make(y.shape, other, dtype, seed=12)


@pytest.mark.parametrize("shape,fmt", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("activation,param", ACTIVATIONS, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward(shape, fmt, activation, param, dtype) -> None:
    C = shape[1]
    mean, invstd = stats(C, dtype)
    for weight, bias in affines(C, dtype):
        x = make(shape, fmt, dtype, seed=1, scale=2.0)
        expected = x.clone()
        ref_abn.abn_forward_(expected, mean, invstd, weight, bias, EPS, activation, param)
        ptr, version, stride = x.data_ptr(), x._version, x.stride()
        assert OPS.abn_forward_(x, mean, invstd, weight, bias, EPS, activation, param) is None
        assert x.data_ptr() == ptr and x.stride() == stride, "abn_forward_ must write over x"
        assert x._version > version
        torch.testing.assert_close(x, expected, **tolerance(dtype))


@pytest.mark.parametrize("shape,fmt", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("activation,param", ACTIVATIONS, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward(shape, fmt, activation, param, dtype) -> None:
    C, acc = shape[1], ref.accumulation_dtype(dtype)
    _, invstd = stats(C, dtype)
    tol = acc_tolerance(dtype)
    for weight, bias in affines(C, dtype):
        y, dy = backward_inputs(shape, fmt, dtype, activation, param, weight, bias)
        args, count = (weight, bias, EPS, activation, param), ref.values_per_channel(y)

        sums = OPS.abn_backward_reduce(y, dy, *args)
        expected = ref_abn.abn_backward_reduce(y, dy, *args)
        # sums to within tol of the sum of the terms' magnitudes
        x_hat, dz, _ = ref_abn._abn_recovered(y, dy, *args)
        dims = ref.reduction_dims(y)
        for got, want, terms in zip(sums, expected, [dz, x_hat * dz]):
            assert got.dtype == acc and got.shape == (C,) and got.device == y.device
            assert torch.isfinite(got).all()
            bound = tol * (terms.abs().sum(dims) + want.abs()) + 1e-300
            assert ((got - want).abs() <= bound).all(), ((got - want).abs() / bound).max()

        for with_sums in (True, False):
            sum_args = (*expected, count) if with_sums else (None, None, count)
            dx = OPS.abn_backward_elemt(y, dy, invstd, *args, *sum_args)
            want = ref_abn.abn_backward_elemt(y, dy, invstd, *args, *sum_args)
            assert dx.dtype == dtype and dx.shape == y.shape
            assert dx.stride() == y.contiguous(memory_format=memory_format_of(y)).stride() or dx.numel() == 0
            assert torch.isfinite(dx).all()
            scale = want.abs().amax().item() if want.numel() else 1.0
            t = tolerance(dtype)
            torch.testing.assert_close(dx, want, rtol=t["rtol"], atol=t["atol"] * max(scale, 1.0))


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sums_do_not_depend_on_threads(fmt, dtype) -> None:
    y, dy = backward_inputs((6, 5, 61, 61), fmt, dtype, "elu", 1.0, None, None)
    weight, bias = affines(5, dtype)[1]
    threads = torch.get_num_threads()
    try:
        results = []
        for n in sorted({1, 2, max(threads, 1)}):
            torch.set_num_threads(n)
            results.append(OPS.abn_backward_reduce(y, dy, weight, bias, EPS, "elu", 1.0))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation,param", [("leaky_relu", 0.3), ("elu", 0.5)])
def test_vector_tails_match_the_body(fmt, dtype, activation, param) -> None:
    """One value per channel everywhere, with S and C no multiples of any vector width: the
    values that fall in a tail (zero-padded vectors) come out as those of whole vectors."""
    C = 37
    mean, invstd = stats(C, dtype)
    weight, bias = affines(C, dtype)[1]
    values = torch.randn(1, C, 1, 1, generator=torch.Generator().manual_seed(5), dtype=torch.float64) - 0.5
    x = values.expand(3, C, 7, 11).to(dtype).contiguous(memory_format=fmt)
    OPS.abn_forward_(x, mean, invstd, weight, bias, EPS, activation, param)
    y, dy = x, torch.full_like(x, 0.75)
    sums = OPS.abn_backward_reduce(y, dy, weight, bias, EPS, activation, param)
    dx = OPS.abn_backward_elemt(y, dy, invstd, weight, bias, EPS, activation, param, *sums, 3 * 7 * 11)
    for t in (x, dx):
        assert torch.equal(t, t[:1, :, :1, :1].expand_as(t))


def test_unknown_activation_and_bad_shapes() -> None:
    x = torch.randn(2, 3, 4)
    mean, invstd = stats(3, x.dtype)
    with pytest.raises(RuntimeError, match="unknown activation 'relu'"):
        OPS.abn_forward_(x, mean, invstd, None, None, EPS, "relu", 0.0)
    with pytest.raises(RuntimeError, match="unknown activation"):
        OPS.abn_backward_reduce(x, x, None, None, EPS, "gelu", 0.0)
    with pytest.raises(RuntimeError, match="unknown activation"):
        OPS.abn_backward_elemt(x, x, invstd, None, None, EPS, "tanh", 0.0, None, None, 8)
    with pytest.raises(RuntimeError, match="mean and invstd"):
        OPS.abn_forward_(x, mean[:2], invstd, None, None, EPS, "identity", 0.0)
    with pytest.raises(RuntimeError, match="per-channel values"):
        OPS.abn_backward_reduce(x, x, torch.ones(4), None, EPS, "identity", 0.0)
    with pytest.raises(RuntimeError, match="shape"):
        OPS.abn_backward_reduce(x, x[:1], None, None, EPS, "identity", 0.0)
    with pytest.raises(RuntimeError, match="grad_output is"):
        OPS.abn_backward_elemt(x, x.double(), invstd, None, None, EPS, "identity", 0.0, None, None, 8)
    with pytest.raises(RuntimeError, match="invstd has"):
        OPS.abn_backward_elemt(x, x, invstd[:1], None, None, EPS, "identity", 0.0, None, None, 8)
    with pytest.raises(RuntimeError, match="both sum_dz and sum_xhat_dz"):
        OPS.abn_backward_elemt(x, x, invstd, None, None, EPS, "identity", 0.0, mean, None, 8)
    with pytest.raises(RuntimeError, match="rank >= 2"):
        OPS.abn_forward_(torch.randn(3), mean, invstd, None, None, EPS, "identity", 0.0)
    with pytest.raises(RuntimeError):  # x overlaps itself: it cannot be written over
        OPS.abn_forward_(torch.randn(1, 3, 1).expand(2, 3, 4), mean, invstd, None, None, EPS, "identity", 0.0)


OPCHECK_LAYOUTS = [
    ((4, 3, 5, 5), torch.contiguous_format),
    ((4, 3, 5, 5), torch.channels_last),
    ((2, 3, 2, 3, 4), torch.channels_last_3d),
    ((6, 5), torch.contiguous_format),
    ((0, 3, 2, 2), torch.contiguous_format),
]


@pytest.mark.parametrize("shape,fmt", OPCHECK_LAYOUTS, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck(shape, fmt, dtype) -> None:
    C = shape[1]
    mean, invstd = stats(C, dtype)
    weight, bias = affines(C, dtype)[1]
    count = max(1, ref.values_per_channel(torch.empty(shape, device="meta")))
    for activation, param in [("leaky_relu", 0.01), ("elu", 1.0), ("identity", 0.0)]:
        x = make(shape, fmt, dtype, seed=1)
        y, dy = backward_inputs(shape, fmt, dtype, activation, param, weight, bias)
        sums = ref_abn.abn_backward_reduce(y, dy, weight, bias, EPS, activation, param)
        calls = [
            ("abn_forward_", (x, mean, invstd, weight, bias, EPS, activation, param)),
            ("abn_forward_", (x, mean, invstd, None, None, EPS, activation, param)),
            ("abn_backward_reduce", (y, dy, weight, bias, EPS, activation, param)),
            ("abn_backward_elemt", (y, dy, invstd, weight, bias, EPS, activation, param, *sums, count)),
            ("abn_backward_elemt", (y, dy, invstd, None, None, EPS, activation, param, None, None, count)),
        ]
        for name, args in calls:
            try:
                torch.library.opcheck(getattr(OPS, name).default, args)
            except Exception as error:  # name the failing call
                raise AssertionError(f"opcheck of syncbn::{name} on {tuple(shape)} {dtype} {activation}: {error}") from error
