"""Pure-PyTorch reference kernels of the masked operators: batch norm whose statistics cover the
valid positions of a padded batch only (``torch.ops.syncbn.masked_*``, schemas in
:mod:`syncbn.functions.operators.ops`).

``mask`` is a bool tensor of ``x``'s shape without the channel dimension, ``(N, *spatial)``, True
where a position is valid. Per channel, over the V valid positions of the whole batch:

    mean = sum_V x / |V|,  var = sum_V (x - mean)^2 / |V|  (biased),

and every position, valid or not, is normalized with them. The outputs depend on the statistics,
so the gradient of a valid position has the batch-norm correction and an invalid one has none:

    dx = (dy - m * (sum(dy) / |V| + (x - mean) * invstd^2 * sum(dy * (x - mean)) / |V|)) * invstd * weight

with m the mask and both sums over every position (they are ``backward_reduce``'s, unchanged).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .reference import STATS_DTYPE, accumulation_dtype, affine_params, memory_format_of, per_channel, reduction_dims


def masked_local_stats(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Mean and M2 of each channel over the valid positions, in float64, and their count (0-dim
    float64). As :func:`syncbn.functions.operators.reference.local_stats`, the second pass adds the
    rounding residue of the mean back in float64; no valid position gives zero mean and M2."""
    valid = mask.unsqueeze(1).expand_as(x)
    count = mask.sum(dtype=STATS_DTYPE)
    dims = reduction_dims(x)
    acc = accumulation_dtype(x.dtype)
    n = count.clamp(min=1)  # no valid position: sums of zeros, divided by 1
    xs = torch.where(valid, x.to(acc), 0)
    mean = xs.sum(dims) / n.to(acc)
    xmu = torch.where(valid, xs - per_channel(mean, x), 0)
    residue = xmu.sum(dims).to(STATS_DTYPE)
    m2 = xmu.square().sum(dims).to(STATS_DTYPE) - residue.square() / n
    mean = mean.to(STATS_DTYPE) + torch.nan_to_num(residue / n, nan=0.0, posinf=0.0, neginf=0.0)
    return mean, m2, count


def masked_backward_elemt(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    mean_dy: Tensor,
    mean_dy_xmu: Tensor,
    mask: Tensor,
) -> Tensor:
    """dx = (dy - m * (mean_dy + (x - mean) * invstd^2 * mean_dy_xmu)) * invstd * weight, where
    ``mean_dy`` and ``mean_dy_xmu`` are the whole batch's sums divided by its valid count."""
    acc = mean.dtype
    scale, _ = affine_params(mean, invstd, weight, None)
    xmu = x.to(acc) - per_channel(mean, x)
    correction = per_channel(mean_dy, x) + xmu * per_channel(invstd.square() * mean_dy_xmu, x)
    dy = dy.to(acc) - torch.where(mask.unsqueeze(1), correction, 0)
    return (dy * per_channel(scale, x)).to(x.dtype).contiguous(memory_format=memory_format_of(x))
