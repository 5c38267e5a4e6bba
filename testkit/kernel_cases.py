"""What the kernel suite shares (``tests/test_kernels_*.py``, and ``tests/test_cuda_kernels.py``): the
devices whose compiled kernels are under test (each marked to skip where they cannot run: the CPU's
under ``pytest --kernels reference``, CUDA's without a GPU and ``pytest --cuda-kernels compiled``),
the inputs and per-channel arguments, and the tolerances against the pure-PyTorch reference
(functions/operators/reference.py)."""
from __future__ import annotations

import pytest
import torch

from syncbn.functions.operators import backend
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
