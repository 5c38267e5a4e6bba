"""torch's SyncBN CUDA operators (``torch.batch_norm_stats``, ``batch_norm_elemt``,
``batch_norm_backward_reduce``, ``batch_norm_backward_elemt``) written in plain torch for CPU
tensors, as their CUDA kernels define them (ATen ``native/cuda/Normalization.cuh``): they have no
CPU kernels, so this is how the C++ kernels that make them serve our operators on CUDA
(``src/torch_cuda_ops.cpp``, bound as ``functions.operators.backend.EXTENSION.torch_cuda_ops``) are tested
without a GPU: :func:`emulated` registers these as their CPU kernels, which C++ callers reach
through the dispatcher. Statistics in the accumulation dtype (float32 for half inputs), invstd 0
where var and eps are both 0, as torch's ``InvStd``.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor


def _acc(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _view(v: Tensor, x: Tensor) -> Tensor:
    return v.view(1, -1, *([1] * (x.dim() - 2)))


def _dims(x: Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def batch_norm_stats(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    xa = x.to(_acc(x))
    mean = xa.mean(_dims(x))
    var = (xa - _view(mean, x)).square().mean(_dims(x))
    invstd = torch.where((var != 0) | (eps != 0), (var + eps).rsqrt(), torch.zeros_like(var))
    return mean, invstd


def batch_norm_elemt(x: Tensor, weight, bias, mean: Tensor, invstd: Tensor, eps: float) -> Tensor:
    y = (x.to(mean.dtype) - _view(mean, x)) * _view(invstd, x)
    if weight is not None:
        y = y * _view(weight.to(mean.dtype), x)
    if bias is not None:
        y = y + _view(bias.to(mean.dtype), x)
    return y.to(x.dtype)


def batch_norm_backward_reduce(dy, x, mean, invstd, weight, input_g, weight_g, bias_g):
    acc = mean.dtype
    sum_dy = dy.to(acc).sum(_dims(x))
    sum_dy_xmu = (dy.to(acc) * (x.to(acc) - _view(mean, x))).sum(_dims(x))
    none = mean.new_empty(0)  # what torch leaves undefined (an operator kernel returns tensors)
    grad_weight = sum_dy_xmu * invstd if weight_g else none
    return sum_dy if input_g else none, sum_dy_xmu if input_g else none, grad_weight, sum_dy if bias_g else none


def batch_norm_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count: Tensor) -> Tensor:
    assert count.dtype == torch.int32, "torch's kernel takes int32 counts"
    acc = mean.dtype
    norm = 1.0 / count.sum().to(acc)  # torch sums the ranks' counts on the device
    mean_dy, xmu_coef = sum_dy * norm, sum_dy_xmu * norm * invstd.square()
    scale = invstd if weight is None else invstd * weight.to(acc)
    xmu = x.to(acc) - _view(mean, x)
    return ((dy.to(acc) - _view(mean_dy, x) - xmu * _view(xmu_coef, x)) * _view(scale, x)).to(x.dtype)


@contextmanager
def emulated() -> Iterator[None]:
    """torch's four SyncBN operators answer for CPU tensors in this block, from Python and C++."""
    names = ("batch_norm_stats", "batch_norm_elemt", "batch_norm_backward_reduce", "batch_norm_backward_elemt")
    with torch.library._scoped_library("aten", "IMPL") as library:
        for name in names:
            library.impl(name, globals()[name], "CPU")
        yield
