"""The backend seam: which kernels serve the five batch-norm operations on a device.

A backend is a :class:`Kernels` record of five callables with the signatures of
:mod:`functions.reference`. The pure-PyTorch reference serves every device; on CUDA tensors the
elementwise and backward operations go to PyTorch's own SyncBN CUDA ops (which have no CPU
kernels). Compiled kernels (``src/``) plug in here as further records.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from . import reference


@dataclass(frozen=True)
class Kernels:
    """The five operations of a synchronized batch norm, as served by one backend."""

    name: str
    local_stats: Callable[[Tensor], tuple[int, Tensor, Tensor]]
    merge_stats: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    elemt_forward: Callable[..., Tensor]
    backward_reduce: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    backward_elemt: Callable[..., Tensor]


REFERENCE = Kernels(
    name="reference",
    local_stats=reference.local_stats,
    merge_stats=reference.merge_stats,
    elemt_forward=reference.elemt_forward,
    backward_reduce=reference.backward_reduce,
    backward_elemt=reference.backward_elemt,
)


# torch's CUDA ops reshape to (N, C, -1), which fails on an empty batch (torch's own SyncBN
# guards them the same way).


def _torch_cuda_elemt_forward(x, mean, invstd, weight, bias):
    if x.numel() == 0:
        return torch.empty_like(x)
    return torch.batch_norm_elemt(x, weight, bias, mean, invstd, 0.0)


def _torch_cuda_backward_reduce(dy, x, mean):
    if x.numel() == 0:
        return torch.zeros_like(mean), torch.zeros_like(mean)
    # invstd only scales grad_weight, which is not asked for here.
    ones = torch.ones_like(mean)
    sum_dy, sum_dy_xmu, _, _ = torch.batch_norm_backward_reduce(
        dy, x, mean, ones, None, True, False, False
    )
    return sum_dy, sum_dy_xmu


def _torch_cuda_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    if x.numel() == 0:
        return torch.empty_like(x)
    if weight is not None and weight.dtype != mean.dtype:
        weight = weight.to(mean.dtype)
    counts = torch.tensor([count], dtype=torch.int32, device=x.device)
    return torch.batch_norm_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, counts)


TORCH_CUDA = Kernels(
    name="torch-cuda-ops",
    local_stats=reference.local_stats,
    merge_stats=reference.merge_stats,
    elemt_forward=_torch_cuda_elemt_forward,
    backward_reduce=_torch_cuda_backward_reduce,
    backward_elemt=_torch_cuda_backward_elemt,
)

_BY_DEVICE_TYPE: dict[str, Kernels] = {"cuda": TORCH_CUDA}


def kernels_for(device: torch.device) -> Kernels:
    """The kernels that serve tensors on ``device``."""
    return _BY_DEVICE_TYPE.get(device.type, REFERENCE)


def backend_info() -> dict[str, str]:
    """Which backend serves which device type, e.g. ``{'cpu': 'reference', 'cuda': ...}``."""
    types = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
    return {t: kernels_for(torch.device(t)).name for t in types}
