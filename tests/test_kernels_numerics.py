"""The kernels' numerics on every device: float32 statistics of a large mean as precise as float64
sums, non-finite values propagating as in torch, results that do not depend on the thread count,
and gradcheck through the compiled kernels."""
from __future__ import annotations

import pytest
import torch

from syncbn.functions import sync_batch_norm
from syncbn.functions.operators import backend
from syncbn.functions.operators import reference as ref
from testkit.kernel_cases import DEVICES, OPS, make_input, needs_compiled, tolerance


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
