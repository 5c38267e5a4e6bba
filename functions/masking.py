"""Batch statistics over the valid positions of a padded batch (``mask=``): the mask as the
kernels take it, its checks, and the lone forward and input gradient over the masked operators.
The math (:mod:`syncbn.functions.operators.reference_masked`), per channel over the valid
positions V of the whole batch:

    mean = sum_V x / |V|,  var = sum_V (x - mean)^2 / |V|,  y = (x - mean) * invstd * weight + bias

at every position; the running statistics take the unbiased var * |V| / (|V| - 1). The gradient:
``backward_reduce``'s sums over every position, divided by |V|; the batch-norm correction only at
valid positions (``masked_backward_elemt``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import torch_internals
from .operators import reference
from .operators.ops import OVERLOADS
from .operators.reference import accumulation_dtype, per_channel, reduction_dims
from .stats import check_valid_positions


def positions_mask(mask: Tensor, input: Tensor, layer: str) -> Tensor:
    """``mask`` as the masked operators take it: bool ``(N, *spatial)``, contiguous. Taken as
    ``(N, *spatial)``, ``(N, 1, *spatial)`` (the input's shape with one channel), or any leading
    part of ``(N, *spatial)`` whose missing trailing dimensions broadcast (``(N,)``: whole
    samples); dimensions of size 1 broadcast. True marks a valid position."""
    positions = (input.size(0), *input.shape[2:])
    return mask.reshape(check_mask(mask, input, layer)).expand(positions).contiguous()


def check_mask(mask: Tensor, input: Tensor, layer: str) -> tuple[int, ...]:
    """Raise, naming ``layer``, where ``mask`` is not a mask of ``input`` (:func:`positions_mask`'s
    forms); else its shape aligned with the input's positions ``(N, *spatial)``, 1 where it broadcasts."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"{layer}: mask must be a bool Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{layer}: mask must be a bool Tensor (True: a valid position), got {mask.dtype}")
    if mask.device != input.device:
        raise RuntimeError(f"{layer}: mask is on {mask.device} but the input is on {input.device}")
    positions = (input.size(0), *input.shape[2:])
    shape = tuple(mask.shape)
    if mask.dim() == input.dim() and mask.size(1) == 1:
        shape = shape[:1] + shape[2:]
    aligned = shape + (1,) * (len(positions) - len(shape))
    if len(shape) > len(positions) or any(m not in (1, p) for m, p in zip(aligned, positions)):
        raise RuntimeError(
            f"{layer}: mask of size {tuple(mask.shape)} does not match the input's positions {positions} "
            f"(input size {tuple(input.shape)}): expected (N, *spatial), (N, 1, *spatial) or a leading part of "
            "(N, *spatial), with dimensions of size 1 broadcast"
        )
    return aligned


def check_count(count: Tensor, layer: str, shape: torch.Size) -> None:
    """More than one valid position over the whole batch: read on the host in eager code, checked
    on the device (``torch._assert_async``) where a graph is traced."""
    if torch.compiler.is_compiling():
        torch_internals.assert_on_device(
            count > 1, f"{layer}: Expected more than 1 value per channel when training, got at most 1 valid position "
            "of the mask (checked on the device under torch.compile)",
        )
    else:
        check_valid_positions(int(count.item()), layer, [shape])


def masked_stats(x: Tensor, mask: Tensor, layer: str) -> tuple[Tensor, Tensor, Tensor]:
    """(mean, biased var, count) over the valid positions of ``x`` alone, float64, checked."""
    mean, m2, count = OVERLOADS.masked_local_stats(x, mask)
    check_count(count, layer, x.shape)
    return mean, m2 / count.clamp(min=1), count


def batch_norm_train(
    x: Tensor, mask: Tensor, weight: Tensor | None, bias: Tensor | None, running: tuple, eps: float, layer: str,
    residual: Tensor | None, negative_slope: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """A lone replica's masked training forward: ``(y, mean, invstd)`` as ``batch_norm_train``'s,
    the running statistics (running_mean, running_var, num_batches_tracked, momentum) updated on
    the device with the valid count."""
    mean, var, count = masked_stats(x, mask, layer)
    reference.update_running_stats(*running, mean, var, count)
    mean, invstd = reference.normalization(mean, var, eps, accumulation_dtype(x.dtype))
    return OVERLOADS.elemt_forward(x, mean, invstd, weight, bias, residual, negative_slope), mean, invstd


def differentiable_forward(x: Tensor, mask: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """The masked training forward in torch's differentiable ops (what double backward
    differentiates): statistics over the valid positions, every position normalized."""
    valid = mask.unsqueeze(1).expand_as(x)
    dims = reduction_dims(x)
    count = mask.sum().to(x.dtype)
    mean = torch.where(valid, x, 0).sum(dims) / count
    xmu = x - per_channel(mean, x)
    var = torch.where(valid, xmu, 0).square().sum(dims) / count
    y = xmu * per_channel(torch.rsqrt(var + eps), x)
    if weight is not None:
        y = y * per_channel(weight, x)
    return y if bias is None else y + per_channel(bias, x)

