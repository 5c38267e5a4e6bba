"""Synchronized batch norm across ranks as code that torch.compile traces: the statistics travel
through PyTorch's functional collectives (``torch.distributed._functional_collectives``, the
``_c10d_functional`` operators), so that the exchange is part of the compiled graph instead of a
graph break. The math is the eager path's (:mod:`syncbn.functions.sync_batchnorm`):

Forward: each rank's row, the eager path's (:func:`syncbn.functions.synchronization.distributed.stats_header`: layer
key, call number 0, dtype code, failed flag 0, shape, count; then mean (C), M2 (C), float64) goes
through ONE all_gather; every rank judges the headers, merges the rows in rank order with Chan's
formula and updates the running statistics on the device, in one operator
(``merge_gathered_stats``: the total count never leaves the device; rows that fail the checks
update nothing), and normalizes its own input (``elemt_forward``, with the fused residual and
activation). Backward: ``[sum_dy, sum_dy_xmu]`` through ONE all_reduce, divided by the device
count, then ``backward_elemt``; the weight and bias gradients are the rank's own sums (DDP
averages them).

The checks cannot read the device on the host inside a graph. The header of every rank's row is
compared on the device, and ``torch._assert_async`` raises where a rank failed the layer's input
checks (:func:`report_failure`: it still joins the collective, with a failed flag), where the
ranks disagree on the layer, the dtype or ``mask=``, or where the whole batch holds one value per
channel (on the CPU at once; on CUDA as a device-side assert, which ends the process). What the
eager path also checks and this one does not: the layer's call count (a Python counter would
recompile every step).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import Function

from ..operators import reference
from .. import torch_internals
from ..operators.ops import OVERLOADS
from .distributed import DTYPE, FAILED, HEADER_SIZE, failed_row, layer_key, stats_header
from ..operators.reference import STATS_DTYPE, accumulation_dtype, memory_format_of, values_per_channel
from ..stats import Running
from ..inplace_abn import inplace_abn_backward
from ..sync_batchnorm import batch_stats_backward

def _rank_row(x: Tensor, layer: str, mask: Tensor | None = None) -> Tensor:
    """This rank's row, as the eager path's (:func:`syncbn.functions.synchronization.distributed.stats_header`), at call
    number 0 (a Python counter would recompile every step); with a ``mask``, its valid count."""
    if mask is None:
        mean, m2 = OVERLOADS.local_stats(x)
        header = stats_header(layer_key(layer), 0, x.dtype, False, x.shape, values_per_channel(x))
        return torch.cat([torch.tensor(header, dtype=STATS_DTYPE, device=x.device), mean, m2])
    mean, m2, count = OVERLOADS.masked_local_stats(x, mask)
    header = stats_header(layer_key(layer), 0, x.dtype, False, x.shape, 0, masked=True)[:-1]
    return torch.cat([torch.tensor(header, dtype=STATS_DTYPE, device=x.device), count.view(1), mean, m2])


def report_failure(group, layer: str, channels: int, error: Exception, device: torch.device) -> None:
    """Join the forward's all_gather with a failed flag after this rank's input failed the layer's
    checks (``error``), so that every rank raises at this layer (the others through the merge's
    verdict); while compiling, this rank raises by a device-side check after the collective (a
    Python raise would end the graph before it), naming the layer and the error's type: its text
    may hold the call's symbolic shapes, which a graph cannot carry."""
    row = failed_row(layer_key(layer), 0, channels, device)
    rows = torch_internals.functional_collectives().all_gather_tensor(row, 0, group).view(-1, row.numel())
    if torch.compiler.is_compiling():
        message = f"{layer}: this rank's input failed the layer's checks ({type(error).__name__}; the call run eagerly says why)"
        torch_internals.assert_on_device(rows[:, FAILED].sum() == 0, message)


def _gathered_stats(
    x: Tensor, group, layer: str, running: Running, mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Every rank's row through one all_gather, checked on the device and merged, and the
    ``running`` statistics (running_mean, running_var, num_batches_tracked, momentum) updated
    where the checks pass: (total count (0-dim), mean, biased variance), float64."""
    row = _rank_row(x, layer, mask)
    world = dist.get_world_size(group)
    rows = torch_internals.functional_collectives().all_gather_tensor(row, 0, group).view(world, row.numel())
    # masked: the running statistics after the check (a count of 0 is no error for the merge)
    merged = (None, None, None, running[3]) if mask is not None else running
    with torch.no_grad():
        total, mean, var, valid = OVERLOADS.merge_gathered_stats(rows, HEADER_SIZE, DTYPE + 1, FAILED, *merged)
        if mask is not None:
            valid = valid & (total > 0)
    torch_internals.assert_on_device(
        valid,
        f"{layer}: a rank failed at this layer (its own error says why), or the ranks disagree on the layer, its dtype "
        "or mask=, or the whole batch holds one value per channel (or its mask one valid position, or none; checked "
        "on the device under torch.compile)",
    )
    if mask is not None:
        with torch.no_grad():
            reference.update_running_stats(*running, mean, var, torch.where(valid, total, torch.nan))
    return total, mean, var


class TracedSyncFunction(Function):
    """The normalization and its backward with the all_reduce of the sums (see the module
    docstring). ``apply(x, weight, bias, residual, mean, invstd, total, group, negative_slope, mask)``
    returns y; mean and invstd (accumulation dtype) and ``total`` (the device count) are not
    differentiable; ``mask`` (or None) puts the correction at its valid positions only."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, mean, invstd, total, group, negative_slope, mask):  # type: ignore[override]
        ctx.save_for_backward(x, weight, bias, residual, mean, invstd, total, mask)
        ctx.group, ctx.negative_slope = group, negative_slope
        return OVERLOADS.elemt_forward(x, mean, invstd, weight, bias, residual, negative_slope)

    @staticmethod
    def backward(ctx, grad_output: Tensor):  # type: ignore[override]
        x, weight, bias, residual, mean, invstd, total, mask = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grads = batch_stats_backward(grad_output, x, mean, invstd, weight, bias, residual, ctx.negative_slope, mask,
                                     total, (needs[0], needs[1], needs[2], needs[3]), functools.partial(_all_reduce, ctx.group))
        grad_input, grad_weight, grad_bias, grad_residual = grads
        return grad_input, grad_weight, grad_bias, grad_residual, None, None, None, None, None, None


def _all_reduce(group, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Per-channel ``a`` and ``b`` summed over the ranks of ``group`` in one all_reduce."""
    sums = torch_internals.functional_collectives().all_reduce(torch.cat([a, b]), "sum", group)
    return sums.split(a.numel())


def traced_sync_batch_norm(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    momentum: float | None,
    eps: float,
    *,
    num_batches_tracked: Tensor | None,
    group,
    layer: str,
    residual: Tensor | None = None,
    negative_slope: float | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """:func:`syncbn.functions.sync_batch_norm` over the ranks of ``group`` (no replicas in the
    process), in ops that torch.compile traces, collectives included. Same arguments and results
    (``mask``: bool ``(N, *spatial)``, :func:`syncbn.functions.masking.positions_mask`'s)."""
    x = input.contiguous(memory_format=memory_format_of(input))
    running = (running_mean, running_var, num_batches_tracked, momentum)
    total, mean, var = _gathered_stats(x.detach(), group, layer, running, mask)  # the Function's backward covers them
    mean_acc, invstd = reference.normalization(mean, var, eps, accumulation_dtype(x.dtype))
    return TracedSyncFunction.apply(x, weight, bias, residual, mean_acc, invstd, total, group, negative_slope, mask)


class TracedInPlaceABNFunction(Function):
    """In-place activated batch norm (:mod:`syncbn.functions.inplace_abn`) with statistics from
    :func:`_gathered_stats`: ``apply(x, weight, bias, mean, invstd, total, group, act)`` writes
    over ``x`` and returns it; the backward's sums go through one all_reduce."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, total, group, act):  # type: ignore[override]
        OVERLOADS.abn_forward_(x, mean, invstd, weight, bias, *act)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, invstd, weight, bias, total)
        ctx.group, ctx.act = group, act
        return x

    @staticmethod
    def backward(ctx, grad_output: Tensor):  # type: ignore[override]
        y, invstd, weight, bias, total = ctx.saved_tensors
        grads = inplace_abn_backward(grad_output, y, invstd, weight, bias, ctx.act, total, ctx.needs_input_grad[:3],
                                     meet=functools.partial(_all_reduce, ctx.group))
        return *grads, None, None, None, None, None


def traced_inplace_abn(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    momentum: float | None,
    eps: float,
    activation: str,
    activation_param: float,
    *,
    num_batches_tracked: Tensor | None,
    group,
    layer: str,
) -> Tensor:
    """:func:`syncbn.functions.inplace_abn.inplace_abn` with batch statistics over the ranks of
    ``group`` (no replicas in the process), in ops that torch.compile traces. ``x`` (contiguous
    or channels_last) is written over and returned."""
    total, mean, var = _gathered_stats(x.detach(), group, layer, (running_mean, running_var, num_batches_tracked, momentum))
    mean_acc, invstd = reference.normalization(mean, var, eps, accumulation_dtype(x.dtype))
    act = (eps, activation, float(activation_param))
    return TracedInPlaceABNFunction.apply(x, weight, bias, mean_acc, invstd, total, group, act)
