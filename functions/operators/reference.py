"""Pure-PyTorch reference kernels of the batch-norm operations.

Each function here is the reference implementation of the operator of the same name,
``torch.ops.syncbn.<name>`` (schemas in :mod:`syncbn.functions.operators.ops`, which registers these for every
device that has no compiled kernels); every compiled kernel (``src/``) is tested against it.
Shapes: ``x`` and ``dy`` are ``(N, C, *)`` in any layout; per-channel tensors are ``(C,)``:
statistics from ``local_stats`` and ``merge_stats`` in float64 (``STATS_DTYPE``), the ``mean``
and ``invstd`` given to the elementwise kernels in the accumulation dtype (float64 for float64
input, float32 otherwise); ``count`` is the number of values per channel (``N * prod(spatial)``,
:func:`values_per_channel`), a Python int. Full-size outputs are laid out as
:func:`memory_format_of` says.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import devices


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 accumulates in float64; float32, bfloat16 and float16 in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def in_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)`` without the call where ``t`` has it already: on replica threads every call
    into torch hands the GIL to another replica and waits to get it back."""
    return t if t.dtype == dtype else t.to(dtype)


STATS_DTYPE = torch.float64
"""The dtype of per-channel statistics (mean, M2, variance) between local_stats and the merge."""


def memory_format_of(x: Tensor) -> torch.memory_format:
    """The layout the kernels walk ``x`` in, and give their full-size outputs: channels_last (2d
    or 3d) when ``x`` is laid out so and not also NCHW-contiguous, else contiguous (NCHW)."""
    if x.is_contiguous():
        return torch.contiguous_format
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def values_per_channel(x: Tensor) -> int:
    """N * prod(spatial): how many values each channel of ``x`` (N, C, *) has."""
    return x.numel() // x.size(1) if x.size(1) else 0


def reduction_dims(x: Tensor) -> list[int]:
    """Every dimension but the channel dimension 1."""
    return [0, *range(2, x.dim())]


def per_channel(v: Tensor, x: Tensor) -> Tensor:
    """View a ``(C,)`` tensor so that it broadcasts against ``x`` along dim 1."""
    return v.view(1, -1, *([1] * (x.dim() - 2)))


def local_stats(x: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and M2 (sum of squared deviations from the mean) of each channel.

    Mean and M2 come back in float64 whatever the input: the data passes accumulate in the
    accumulation dtype, but a float32 mean of values near 1e4 is only good to 1e-3, and merging
    replicas (which squares differences of their means) would turn that into a visible error in
    the variance. So the second pass also sums x - mean (exact, as x is near the mean): the
    rounding residue of the mean, added back in float64. An empty batch gives zero mean and M2,
    so that it drops out of a merge.
    """
    count = values_per_channel(x)
    if count == 0:
        zeros = torch.zeros(x.size(1), dtype=STATS_DTYPE, device=x.device)
        return zeros, zeros.clone()
    dims = reduction_dims(x)
    x = x.to(accumulation_dtype(x.dtype))
    mean = x.mean(dims)
    xmu = x - per_channel(mean, x)
    residue = xmu.sum(dims).to(STATS_DTYPE)
    m2 = xmu.square().sum(dims).to(STATS_DTYPE) - residue.square() / count
    # an inf makes the residue nan; the mean stays inf, as in torch's batch norm
    mean = mean.to(STATS_DTYPE) + torch.nan_to_num(residue / count, nan=0.0, posinf=0.0, neginf=0.0)
    return mean, m2


def merge_stats(counts: Tensor, means: Tensor, m2s: Tensor) -> tuple[Tensor, Tensor]:
    """Merge R partial (count, mean, M2) into the mean and biased variance of the union.

    ``counts`` is ``(R,)``, ``means`` and ``m2s`` are ``(R, C)``. This is Chan et al.'s
    parallel formula in its R-way form, M2 = sum_i M2_i + sum_i n_i (m_i - m)^2, which only
    ever squares deviations from the global mean (never E[x^2] - E[x]^2). Parts with n_i = 0
    must carry mean 0 and M2 0. The total count must be positive.
    """
    counts = counts.to(means.dtype).unsqueeze(1)
    total = counts.sum()
    mean = (counts * means).sum(0) / total
    m2 = m2s.sum(0) + (counts * (means - mean).square()).sum(0)
    return mean, m2 / total


def activation(y: Tensor, negative_slope: float | None) -> Tensor:
    """The fused activation: y where y > 0, else y * negative_slope; None: none (identity).
    ReLU is ``negative_slope=0.0``, LeakyReLU its own slope."""
    if negative_slope is None:
        return y
    return torch.where(y > 0, y, y * negative_slope)


def activation_grad(dy: Tensor, pre: Tensor, negative_slope: float | None) -> Tensor:
    """dy through the activation at its input ``pre``: dy where pre > 0, else dy * slope."""
    if negative_slope is None:
        return dy
    return torch.where(pre > 0, dy, dy * negative_slope)


def affine_params(
    mean: Tensor, invstd: Tensor, weight: Tensor | None, bias: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Per-channel (scale, shift) of y = x * scale + shift: scale = invstd * weight,
    shift = bias - mean * scale, in invstd's dtype."""
    scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
    shift = -mean * scale
    if bias is not None:
        shift = shift + bias.to(invstd.dtype)
    return scale, shift


def pre_activation(
    x: Tensor, scale: Tensor, shift: Tensor, residual: Tensor | None
) -> Tensor:
    """x * scale + shift (+ residual), in scale's dtype: the activation's input."""
    pre = torch.addcmul(per_channel(shift, x), x.to(scale.dtype), per_channel(scale, x))
    return pre if residual is None else pre + residual.to(scale.dtype)


def elemt_forward(
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None = None,
    negative_slope: float | None = None,
) -> Tensor:
    """y = act(x * scale + shift + residual), scale = invstd * weight, shift = bias - mean * scale.

    ``residual`` (None: 0) is shaped and typed as ``x``; ``act`` is :func:`activation` with
    ``negative_slope`` (None: identity). Computed in invstd's dtype, rounded once to x's.
    """
    scale, shift = affine_params(mean, invstd, weight, bias)
    y = activation(pre_activation(x, scale, shift, residual), negative_slope)
    return y.to(x.dtype).contiguous(memory_format=memory_format_of(x))


def backward_affine_act(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None,
    negative_slope: float | None,
    input_grad: bool,
    residual_grad: bool,
    sums: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward of :func:`elemt_forward` with mean and invstd held fixed (frozen statistics).

    g = dy * act'(pre) with pre = x * scale + shift + residual recomputed as in the forward
    (act'(pre) = 1 where pre > 0, else negative_slope; g = dy without an activation). Returns
    ``(dx, g, sum_g, sum_g_xmu)``: dx = g * scale when ``input_grad``; g itself (the residual's
    gradient, shaped and typed as dy) when ``residual_grad``; sum(g) and sum(g * (x - mean))
    per channel, in mean's dtype, when ``sums``. What is not asked for is an empty ``(0,)``
    tensor (x's options for dx and g, mean's for the sums). In frozen
    training grad_weight = sum_g_xmu * invstd and grad_bias = sum_g; with batch statistics,
    (g, sum_g, sum_g_xmu) stand in for (dy, sum_dy, sum_dy_xmu) of :func:`backward_elemt`.
    """
    acc = mean.dtype
    scale, shift = affine_params(mean, invstd, weight, bias)
    g = dy.to(acc)
    if negative_slope is not None:
        g = activation_grad(g, pre_activation(x, scale, shift, residual), negative_slope)
    layout = memory_format_of(x)
    none, no_sums = x.new_empty(0), mean.new_empty(0)
    dx = (g * per_channel(scale, x)).to(x.dtype).contiguous(memory_format=layout) if input_grad else none
    sum_g, sum_g_xmu = no_sums, no_sums.clone()
    if sums:
        dims = reduction_dims(x)
        sum_g = g.sum(dims)
        sum_g_xmu = (g * (x.to(acc) - per_channel(mean, x))).sum(dims)
    # a copy where g is dy itself: an operator's output never aliases its input
    g = g.to(dy.dtype).contiguous(memory_format=layout).clone() if residual_grad else none.clone()
    return dx, g, sum_g, sum_g_xmu


def backward_reduce(dy: Tensor, x: Tensor, mean: Tensor) -> tuple[Tensor, Tensor]:
    """sum_dy = sum(dy) and sum_dy_xmu = sum(dy * (x - mean)) per channel."""
    dims = reduction_dims(x)
    dy = dy.to(mean.dtype)
    sum_dy = dy.sum(dims)
    sum_dy_xmu = (dy * (x.to(mean.dtype) - per_channel(mean, x))).sum(dims)
    return sum_dy, sum_dy_xmu


def backward_elemt(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    sum_dy: Tensor,
    sum_dy_xmu: Tensor,
    count: int,
) -> Tensor:
    """dx = (dy - sum_dy/N - (x - mean) * invstd^2 * sum_dy_xmu/N) * invstd * weight.

    ``sum_dy`` and ``sum_dy_xmu`` are the sums over the whole batch and ``count`` is its N.
    """
    acc = mean.dtype
    scale, _ = affine_params(mean, invstd, weight, None)
    mean_dy = sum_dy / count
    xmu_coef = invstd.square() * sum_dy_xmu / count
    xmu = x.to(acc) - per_channel(mean, x)
    dx = (dy.to(acc) - per_channel(mean_dy, x) - xmu * per_channel(xmu_coef, x)) * per_channel(scale, x)
    return dx.to(x.dtype).contiguous(memory_format=memory_format_of(x))


def sums_per_value(sum_dy: Tensor, sum_dy_xmu: Tensor, count: Tensor | int) -> tuple[Tensor, Tensor, int]:
    """``(sum_dy / count, sum_dy_xmu / count, 1)``: backward_elemt's sums and count where the
    count cannot go to its kernel as it is (a device tensor, or beyond a kernel's int32), so that
    the kernel divides by 1."""
    return sum_dy / count, sum_dy_xmu / count, 1


def update_running_stats(
    running_mean: Tensor | None,
    running_var: Tensor | None,
    num_batches_tracked: Tensor | None,
    momentum: float | None,
    mean: Tensor,
    var: Tensor,
    count: int | Tensor,
) -> None:
    """One step of nn.BatchNorm's running statistics, in place, from the batch's mean and biased var.

    running = (1 - factor) * running + factor * batch, with the unbiased var * N / (N - 1);
    factor is ``momentum``, or 1 / num_batches_tracked (after its increment: the cumulative
    average) when it is None, taken on the device (no host read). An empty batch only counts.
    ``count`` may be a 0-dim tensor on the device (the operator takes an int): then an empty
    or one-value batch is told apart on the device too, and leaves the statistics as they were
    (the one-value error is the checks' business, :mod:`syncbn.functions.synchronization.checks`); a NaN count (a
    failed exchange) leaves ``num_batches_tracked`` too.
    """
    on_device = isinstance(count, Tensor)
    if num_batches_tracked is not None:
        num_batches_tracked.add_(count.isnan().logical_not() if on_device else 1)
    if running_mean is None or running_var is None or (not on_device and count == 0):
        return
    if not on_device and count == 1:
        raise RuntimeError("syncbn.update_running_stats: the unbiased variance needs more than 1 value, got 1")
    if momentum is not None:
        factor: float | Tensor = momentum
    elif num_batches_tracked is not None:
        factor = num_batches_tracked.to(mean.dtype).reciprocal()
    else:
        return
    n = count.to(var.dtype) if on_device else count
    new_mean = mean * factor + running_mean * (1 - factor)
    new_var = var * (n / (n - 1)) * factor + running_var * (1 - factor)
    if on_device:
        counts = n > 1
        new_mean, new_var = torch.where(counts, new_mean, running_mean), torch.where(counts, new_var, running_var)
    running_mean.copy_(new_mean)
    running_var.copy_(new_var)


def merge_gathered_stats(
    rows: Tensor,
    header: int,
    agreeing: int,
    flag: int | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    num_batches_tracked: Tensor | None,
    momentum: float | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The rows of one all_gather judged and merged in row order, and the running statistics
    updated where they pass, with no host read: what every rank computes alike.

    ``rows`` is ``(R, header + 2C)`` float64: per rank, ``header`` values (the last is its
    count), then its mean ``(C,)`` and M2 ``(C,)``. They are *valid* when the first
    ``agreeing`` columns are equal on every row, column ``flag`` (when given) is 0 on every
    row, and the total count is a whole number of values (below 2**63) other than 1. Returns the total count (0-dim float64), the mean and
    biased variance ``(C,)`` (Chan's formula, :func:`merge_stats`; all empty: mean 0 and
    variance 1) and ``valid`` (0-dim bool). Where valid only, the running statistics and
    ``num_batches_tracked`` update as :func:`update_running_stats` with the total as count.
    """
    channels = (rows.size(1) - header) // 2
    heads, means, m2s = rows.split([header, channels, channels], dim=1)
    counts = heads[:, header - 1]
    total = counts.sum()
    empty = total == 0
    # all empty: any positive weights give mean 0 and M2 0 (the parts' are 0), then var := 1
    mean, var = merge_stats(torch.where(empty, 1.0, counts), means, m2s)
    var = torch.where(empty, 1.0, var)
    whole = (total >= 0) & (total < 2.0**63) & (total == total.floor())  # NaN: False
    valid = (heads[:, :agreeing] == heads[:1, :agreeing]).all() & whole & (total != 1)
    if flag is not None:
        valid = valid & (heads[:, flag] == 0).all()
    counted = torch.where(valid, total, torch.nan)  # NaN: update_running_stats leaves everything
    update_running_stats(running_mean, running_var, num_batches_tracked, momentum, mean, var, counted)
    return total, mean, var, valid


def pack_row(head: list[float], a: Tensor, b: Tensor) -> Tensor:
    """The float64 row ``[head, a, b]`` on ``a``'s device, ``a`` and ``b`` 1-D floating tensors
    there: what one collective over ranks sends (:mod:`syncbn.functions.synchronization.distributed`). The head is
    copied from pinned host memory without waiting for a GPU."""
    if a.dim() != 1 or b.dim() != 1:
        raise RuntimeError(f"syncbn.pack_row: expected 1-D a and b, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if not (a.is_floating_point() and b.is_floating_point()):
        raise RuntimeError(f"syncbn.pack_row: expected floating a and b, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise RuntimeError(f"syncbn.pack_row: expected a and b on one device, got {a.device} and {b.device}")
    return torch.cat([devices.host_values_on(head, a.device), a.to(STATS_DTYPE), b.to(STATS_DTYPE)])


def unpack_row(row: Tensor, head: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """:func:`pack_row`'s inverse for two halves: ``row[head:head + C]`` and ``row[head + C:]``
    (``row`` 1-D float64 of ``head + 2C`` values) as new tensors in ``dtype``."""
    if row.dim() != 1 or row.dtype != STATS_DTYPE:
        raise RuntimeError(f"syncbn.unpack_row: expected a 1-D float64 row, got {row.dtype} of shape {tuple(row.shape)}")
    if not (0 <= head <= row.numel() and (row.numel() - head) % 2 == 0):
        raise RuntimeError(f"syncbn.unpack_row: expected head ({head}) plus two halves of equal size in a row of {row.numel()}")
    if not dtype.is_floating_point:
        raise RuntimeError(f"syncbn.unpack_row: expected a floating dtype, got {dtype}")
    a, b = row[head:].chunk(2)
    return a.to(dtype, copy=True), b.to(dtype, copy=True)


def batch_norm_train(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    num_batches_tracked: Tensor | None,
    momentum: float | None,
    eps: float,
    residual: Tensor | None = None,
    negative_slope: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """A lone replica's training forward: ``local_stats``, ``update_running_stats`` (in place)
    and ``elemt_forward``, each through its operator (so a device's own kernels serve them).
    Returns ``(y, mean, invstd)``, mean and invstd in the accumulation dtype; an empty batch
    normalizes with mean 0 and variance 1."""
    ops = torch.ops.syncbn
    count = values_per_channel(x)
    mean, m2 = ops.local_stats(x)
    var = m2 / count if count > 0 else torch.ones_like(m2)
    ops.update_running_stats(running_mean, running_var, num_batches_tracked, momentum, mean, var, count)
    return normalize(x, mean, var, eps, weight, bias, residual, negative_slope)


def normalize(
    x: Tensor,
    mean: Tensor,
    var: Tensor,
    eps: float,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None,
    negative_slope: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``elemt_forward`` (through its operator) with the batch's float64 ``mean`` and biased
    ``var``: returns ``(y, mean, invstd)``, mean and invstd = 1 / sqrt(var + eps) in the
    accumulation dtype, as the backward takes them (:func:`normalization`)."""
    mean, invstd = normalization(mean, var, eps, accumulation_dtype(x.dtype))
    return torch.ops.syncbn.elemt_forward(x, mean, invstd, weight, bias, residual, negative_slope), mean, invstd


def normalization(mean: Tensor, var: Tensor, eps: float, acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """The float64 ``mean`` and biased ``var`` as the elementwise kernels take them: mean and
    invstd = 1 / sqrt(var + eps), in the accumulation dtype ``acc``."""
    return in_dtype(mean, acc), in_dtype(torch.rsqrt(var + eps), acc)
