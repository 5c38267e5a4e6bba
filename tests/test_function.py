"""The math: reference kernels against float64 formulas, the merge, gradcheck, precision with a
large mean, and half-precision inputs."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from syncbn.functions import SyncBatchNormFunction, sync_batch_norm
from syncbn.functions.operators import reference as ref
from syncbn import nn as NN
from syncbn.modules.parallel import ThreadedDataParallel


def direct_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dims = [0, *range(2, x.dim())]
    x = x.double()
    return x.mean(dims), x.var(dims, correction=0)


@settings(max_examples=40, deadline=None)
@given(
    parts=st.lists(st.integers(0, 5), min_size=1, max_size=5).filter(lambda p: sum(p) > 0),
    channels=st.integers(1, 9),
    spatial=st.lists(st.integers(1, 4), max_size=3),
    offset=st.floats(-1e3, 1e3),
)
def test_local_stats_and_merge_match_the_whole_batch(parts, channels, spatial, offset) -> None:
    x = torch.randn(sum(parts), channels, *spatial, dtype=torch.float64) * 2 + offset
    pieces = [ref.local_stats(p) for p in x.split(parts)]
    counts = torch.tensor([ref.values_per_channel(p) for p in x.split(parts)], dtype=torch.float64)
    mean, var = ref.merge_stats(counts, torch.stack([m for m, _ in pieces]), torch.stack([s for _, s in pieces]))
    mean_ref, var_ref = direct_stats(x)
    torch.testing.assert_close(mean, mean_ref, atol=1e-9, rtol=1e-12)
    torch.testing.assert_close(var, var_ref, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("shape", [(5, 3), (4, 65, 3), (2, 1, 3, 5), (1, 4, 1, 1), (3, 2, 2, 3, 2), (0, 3, 2)])
@pytest.mark.parametrize("affine", [True, False])
def test_elementwise_kernels_match_the_formulas(shape, affine: bool) -> None:
    torch.manual_seed(0)
    x, dy = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    c = shape[1]
    mean, invstd = torch.randn(c, dtype=torch.float64), torch.rand(c, dtype=torch.float64) + 0.5
    weight, bias = (torch.randn(c, dtype=torch.float64), torch.randn(c, dtype=torch.float64)) if affine else (None, None)
    view = [1, c] + [1] * (len(shape) - 2)
    w = weight.view(view) if affine else 1.0
    b = bias.view(view) if affine else 0.0
    xmu = x - mean.view(view)
    torch.testing.assert_close(ref.elemt_forward(x, mean, invstd, weight, bias), xmu * invstd.view(view) * w + b)
    sum_dy, sum_dy_xmu = ref.backward_reduce(dy, x, mean)
    dims = [0, *range(2, len(shape))]
    torch.testing.assert_close(sum_dy, dy.sum(dims))
    torch.testing.assert_close(sum_dy_xmu, (dy * xmu).sum(dims))
    n = max(x.numel() // c, 1)
    dx = ref.backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, n)
    expected = (dy - sum_dy.view(view) / n - xmu * invstd.view(view) ** 2 * sum_dy_xmu.view(view) / n) * invstd.view(view) * w
    torch.testing.assert_close(dx, expected)


@pytest.mark.parametrize("affine, bias", [(True, True), (True, False), (False, False)])
def test_gradcheck_function(affine: bool, bias: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64, requires_grad=True)
    w = torch.rand(3, dtype=torch.float64, requires_grad=True) + 0.5 if affine else None
    b = torch.randn(3, dtype=torch.float64, requires_grad=True) if bias else None
    inputs = tuple(t for t in (x, w, b) if t is not None)

    def fn(*args):
        it = iter(args)
        x = next(it)
        weight = next(it) if affine else None
        bias_ = next(it) if bias else None
        return SyncBatchNormFunction.apply(x, weight, bias_, None, None, None, 0.1, 1e-5, "gradcheck")[0]

    assert torch.autograd.gradcheck(fn, inputs)


def test_gradcheck_through_replicas() -> None:
    # the synchronized backward (3 replicas, chunks 2,2,1, one exchange) is the true gradient
    torch.manual_seed(0)
    layer = NN.SyncBatchNorm2d(3, track_running_stats=False).double()
    model = ThreadedDataParallel(layer, ["cpu"] * 3)
    x = torch.randn(5, 3, 2, 1, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(model, (x,))


def test_large_mean_variance_is_precise() -> None:
    # mean 1e4, std 1 in float32: E[x^2] - E[x]^2 would lose every digit
    torch.manual_seed(0)
    x = torch.randn(16, 8, 6, 6) + 1e4
    layer = NN.SyncBatchNorm2d(8, momentum=1.0)
    ThreadedDataParallel(layer, ["cpu"] * 4)(x)
    expected = x.double().var(dim=(0, 2, 3), correction=1)
    # asked: 1e-4 relative; the float64 residue of each local mean gives ~1e-7 (torch: ~2e-7)
    torch.testing.assert_close(layer.running_var.double(), expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(layer.running_mean.double(), x.double().mean(dim=(0, 2, 3)), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_half_inputs_with_float32_parameters(dtype, memory_format) -> None:
    # as under autocast: float32 parameters and running stats, half input and output
    torch.manual_seed(0)
    theirs = nn.BatchNorm2d(4)
    with torch.no_grad():
        theirs.weight.uniform_(0.5, 1.5)
        theirs.bias.normal_()
    ours = NN.convert_sync_batchnorm(nn.BatchNorm2d(4))
    ours.load_state_dict(theirs.state_dict())
    x = (torch.randn(10, 4, 5, 5) * 2 + 3).to(dtype=dtype, memory_format=memory_format)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = theirs(x_ref.float())  # the float32 truth of the half input
    y = ThreadedDataParallel(ours, ["cpu"] * 4)(x_ours)
    assert y.dtype == dtype and y.is_contiguous(memory_format=memory_format)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(y.float(), y_ref, **tol)
    probe = torch.randn_like(y_ref)
    (y.float() * probe).sum().backward()
    (y_ref * probe).sum().backward()
    assert x_ours.grad.dtype == dtype and ours.weight.grad.dtype == torch.float32
    torch.testing.assert_close(x_ours.grad.float(), x_ref.grad.float(), **tol)
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, atol=0.2, rtol=2e-2)
    torch.testing.assert_close(ours.bias.grad, theirs.bias.grad, atol=0.2, rtol=2e-2)
    for key in ("running_mean", "running_var"):
        assert getattr(ours, key).dtype == torch.float32
        torch.testing.assert_close(getattr(ours, key), getattr(theirs, key), atol=1e-3, rtol=1e-3)


def test_functional_entry_point_updates_running_stats() -> None:
    x = torch.randn(6, 3, 4, dtype=torch.float64)
    mean, var, count = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64), torch.tensor(0)
    theirs = nn.BatchNorm1d(3, momentum=None).double()
    y = sync_batch_norm(x, mean, var, momentum=None, num_batches_tracked=count)
    torch.testing.assert_close(y, theirs(x))
    torch.testing.assert_close(mean, theirs.running_mean)
    torch.testing.assert_close(var, theirs.running_var)
    assert int(count) == 1
