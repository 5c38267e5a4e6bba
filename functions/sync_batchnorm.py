"""Synchronized batch norm: the autograd Function, its functional entry point, and the math
that joins the replicas' statistics.

Forward, per channel c, over the N values of every replica:
    each replica computes (n_i, mean_i, M2_i); the master merges them with Chan's formula into
    the global mean and biased variance var; y = (x - mean) * invstd * weight + bias with
    invstd = 1 / sqrt(var + eps). The master alone updates running_mean / running_var (with
    the unbiased var * N / (N - 1)) and num_batches_tracked, once per call.
With a fused residual z and activation act (ReLU, LeakyReLU), the output is act(y + z), one
elementwise pass; the backward recomputes act's input from x, z and the statistics and takes
g = dy * act'(.) in place of dy below (g is also z's gradient).
Backward: each replica computes sum_dy and sum_dy_xmu = sum(dy * (x - mean)); both are summed
over the replicas in one exchange; then
    dx = (dy - sum_dy / N - (x - mean) * invstd^2 * sum_dy_xmu / N) * invstd * weight,
    grad_weight = local sum_dy_xmu * invstd, grad_bias = local sum_dy
(DataParallel sums parameter gradients over replicas itself).

Across processes (``process_call`` given, see :mod:`functions.distributed`), the master of each
process (or the lone layer under DDP) merges its replicas' parts into the process's
(count, mean, M2), all_gathers those of every rank and merges them in rank order; in backward it
all_reduces the replicas' summed (sum_dy, sum_dy_xmu). One collective per call and direction.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor
from torch.autograd.function import Function, once_differentiable

from . import devices
from .backend import Kernels, kernels_for
from .distributed import ProcessGroupCall, all_gather_stats, all_reduce_sums
from .reference import accumulation_dtype
from .replicas import ReplicaCall
from .stats import LocalStats


def memory_format_of(x: Tensor) -> torch.memory_format:
    """channels_last (2d or 3d) when ``x`` is laid out so and not also NCHW-contiguous."""
    if x.is_contiguous():
        return torch.contiguous_format
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def check_values_per_channel(total: int, layer: str, shapes: list[torch.Size], parts: str = "replicas") -> None:
    """Batch statistics need more than one value per channel (torch raises ValueError too)."""
    if total == 1:
        sizes = ", ".join(str(tuple(s)) for s in shapes)
        raise ValueError(
            f"{layer}: Expected more than 1 value per channel when training, got input size "
            f"{sizes}" + (f" over {len(shapes)} {parts}" if len(shapes) > 1 else "")
        )


def _check_replicas_agree(parts: list[LocalStats], layer: str) -> None:
    first = parts[0]
    for index, part in enumerate(parts):
        if part.mean.numel() != first.mean.numel() or part.input_dtype != first.input_dtype:
            raise RuntimeError(
                f"{layer}: replicas disagree on their input: replica 0 has "
                f"{first.mean.numel()} channels of {first.input_dtype}, replica {index} has "
                f"{part.mean.numel()} channels of {part.input_dtype}"
            )


def _merge(parts: list[LocalStats], kernels: Kernels) -> tuple[int, Tensor, Tensor]:
    """Count, mean and biased variance of the parts' union (count 0: mean 0, variance 1)."""
    first = parts[0]
    total = sum(part.count for part in parts)
    if total == 0:
        return 0, torch.zeros_like(first.mean), torch.ones_like(first.mean)
    if len(parts) == 1:
        return total, first.mean, first.m2 / total
    device = first.mean.device
    # no host synchronization: counts from pinned memory, peer copies after each replica's stream
    counts = devices.counts_on([part.count for part in parts], device, first.mean.dtype)
    means = torch.stack([devices.fetch(part.mean, device, part.ready) for part in parts])
    m2s = torch.stack([devices.fetch(part.m2, device, part.ready) for part in parts])
    mean, var = kernels.merge_stats(counts, means, m2s)
    return total, mean, var


def _merge_into_one(parts: list[LocalStats], kernels: Kernels) -> LocalStats:
    """The parts as one contribution (what a process sends to the other ranks)."""
    count, mean, var = _merge(parts, kernels)
    first = parts[0]
    shape = torch.Size([sum(part.input_shape[0] for part in parts), *first.input_shape[1:]])
    return LocalStats(count, mean, var * count, first.input_dtype, shape)


def merge_replica_stats(
    parts: list[LocalStats], layer: str, kernels: Kernels, process_call: ProcessGroupCall | None = None
) -> tuple[int, Tensor, Tensor]:
    """Global count, mean and biased variance (float64) of the replicas' parts, on parts[0]'s
    device; with ``process_call``, of every rank's replicas (one all_gather).

    Raises when the replicas (or ranks) disagree on channels or dtype, or hold one value per
    channel between them, before anything is updated; the ranks raise alike.
    """
    _check_replicas_agree(parts, layer)
    what = "replicas"
    if process_call is not None:
        parts, what = all_gather_stats(_merge_into_one(parts, kernels), process_call), "ranks"
    total = sum(part.count for part in parts)
    check_values_per_channel(total, layer, [part.input_shape for part in parts], what)
    return _merge(parts, kernels)


def sum_replica_tensors(parts: list[Tensor], process_call: ProcessGroupCall | None = None) -> Tensor:
    """Sum of the replicas' tensors on parts[0]'s device, in replica order; with
    ``process_call``, summed over the ranks too (one all_reduce)."""
    total = parts[0] if len(parts) == 1 else torch.stack([part.to(parts[0].device) for part in parts]).sum(0)
    return total if process_call is None else all_reduce_sums(total, process_call)


def update_running_stats(
    running_mean: Tensor | None,
    running_var: Tensor | None,
    num_batches_tracked: Tensor | None,
    momentum: float | None,
    mean: Tensor,
    var: Tensor,
    count: int,
) -> None:
    """One step of nn.BatchNorm's running statistics, from the batch's mean and biased var.

    running = (1 - factor) * running + factor * batch, with the unbiased var * N / (N - 1);
    factor is ``momentum``, or 1 / num_batches_tracked (the cumulative average) when it is None.
    An empty batch only counts (as in torch).
    """
    if num_batches_tracked is not None:
        num_batches_tracked.add_(1)
    if running_mean is None or running_var is None or count == 0:
        return
    if momentum is not None:
        factor = momentum
    elif num_batches_tracked is not None:
        factor = 1.0 / int(num_batches_tracked)
    else:
        factor = 0.0
    unbiased = var * (count / (count - 1))
    running_mean.copy_(mean * factor + running_mean * (1.0 - factor))
    running_var.copy_(unbiased * factor + running_var * (1.0 - factor))


class SyncBatchNormFunction(Function):
    """Batch norm with statistics over every replica's batch (see the module docstring).

    ``apply(input, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps,
    replica_call, layer[, process_call, residual, negative_slope])``; ``replica_call`` is None
    for a lone replica, ``process_call`` is None within one process (and on replicas other than
    the master), ``layer`` names the layer in errors. ``input`` is ``(N, C, *)``; weight, bias
    and running stats are ``(C,)`` or None; ``residual`` is None or shaped as ``input``;
    ``negative_slope`` is None (no activation) or the activation's slope below 0 (ReLU: 0).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        input: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        num_batches_tracked: Tensor | None,
        momentum: float | None,
        eps: float,
        replica_call: ReplicaCall | None,
        layer: str,
        process_call: ProcessGroupCall | None = None,
        residual: Tensor | None = None,
        negative_slope: float | None = None,
    ) -> Tensor:
        x = input.contiguous(memory_format=memory_format_of(input))
        kernels = kernels_for(x.device)
        local = LocalStats(*kernels.local_stats(x), x.dtype, x.shape)
        if replica_call is None:
            count, mean, var = merge_replica_stats([local], layer, kernels, process_call)
        else:
            local = dataclasses.replace(local, ready=devices.mark_ready(local.mean))

            def merge(parts: list[LocalStats]) -> tuple:
                count, mean, var = merge_replica_stats(parts, layer, kernels, process_call)
                return count, mean, var, devices.mark_ready(var)

            count, mean, var, ready = replica_call.exchange("forward", local, merge)
            mean, var = devices.fetch(mean, x.device, ready), devices.fetch(var, x.device, ready)
        if replica_call is None or replica_call.is_master:
            update_running_stats(running_mean, running_var, num_batches_tracked, momentum, mean, var, count)
        acc = accumulation_dtype(x.dtype)
        mean, invstd = mean.to(acc), torch.rsqrt(var + eps).to(acc)
        ctx.save_for_backward(x, weight, bias, residual, mean, invstd)
        ctx.count, ctx.replica_call, ctx.process_call = count, replica_call, process_call
        ctx.negative_slope = negative_slope
        return kernels.elemt_forward(x, mean, invstd, weight, bias, residual, negative_slope)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: Tensor):  # type: ignore[override]
        try:
            return SyncBatchNormFunction._backward(ctx, grad_output)
        except BaseException as error:
            if ctx.replica_call is not None:  # release the other replicas at once
                ctx.replica_call.round.abort(error, ctx.replica_call.index)
            raise

    @staticmethod
    def _sum_over_replicas(ctx, both: Tensor) -> tuple[Tensor, Tensor]:
        """(sum_dy, sum_dy_xmu) of every replica, and of every rank with a process_call, on
        ``both``'s device."""

        def sum_parts(parts: list[tuple[Tensor, object]]) -> tuple[Tensor, object]:
            device = parts[0][0].device
            total = sum_replica_tensors([devices.fetch(t, device, ready) for t, ready in parts], ctx.process_call)
            return total, devices.mark_ready(total)

        if ctx.replica_call is not None:
            total, ready = ctx.replica_call.exchange("backward", (both, devices.mark_ready(both)), sum_parts)
        else:
            total, ready = sum_parts([(both, None)])
        return devices.fetch(total, both.device, ready).chunk(2)

    @staticmethod
    def _backward(ctx, grad_output: Tensor) -> tuple:
        x, weight, bias, residual, mean, invstd = ctx.saved_tensors
        dy = grad_output.contiguous(memory_format=memory_format_of(x))
        kernels = kernels_for(x.device)
        if ctx.negative_slope is None:
            sum_dy, sum_dy_xmu = kernels.backward_reduce(dy, x, mean)
        else:  # dy through the activation, and its sums, in one pass
            _, dy, sum_dy, sum_dy_xmu = kernels.backward_affine_act(
                dy, x, mean, invstd, weight, bias, residual, ctx.negative_slope, False, True, True
            )
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            total_dy, total_dy_xmu = sum_dy, sum_dy_xmu
            if ctx.replica_call is not None or ctx.process_call is not None:
                total_dy, total_dy_xmu = SyncBatchNormFunction._sum_over_replicas(ctx, torch.cat([sum_dy, sum_dy_xmu]))
            grad_input = kernels.backward_elemt(dy, x, mean, invstd, weight, total_dy, total_dy_xmu, ctx.count)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(bias.dtype)
        grads = [grad_input, grad_weight, grad_bias, *([None] * (len(ctx.needs_input_grad) - 3))]
        if len(grads) > RESIDUAL_ARG and ctx.needs_input_grad[RESIDUAL_ARG]:
            grads[RESIDUAL_ARG] = dy
        return tuple(grads)


RESIDUAL_ARG = 11
"""Where ``residual`` is among :meth:`SyncBatchNormFunction.forward`'s arguments (after ctx)."""


def sync_batch_norm(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    momentum: float | None = 0.1,
    eps: float = 1e-5,
    *,
    num_batches_tracked: Tensor | None = None,
    replica_call: ReplicaCall | None = None,
    process_call: ProcessGroupCall | None = None,
    layer: str = "sync_batch_norm",
    residual: Tensor | None = None,
    negative_slope: float | None = None,
) -> Tensor:
    r"""Batch norm over the batch statistics of every replica, as in training mode, with an
    optional fused residual and activation.

    .. math::
        y = \mathrm{act}\left(\frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \cdot \gamma + \beta + z\right)

    with E and Var (biased) taken per channel over dim 0 and every dim after 1 of all the
    replicas' inputs together. ``input`` is ``(N, C, *)`` of a floating dtype (float16 and
    bfloat16 accumulate in float32); ``weight``, ``bias``, ``running_mean`` and
    ``running_var`` are ``(C,)`` or None. The running statistics (when given) and
    ``num_batches_tracked`` are updated in place, once, by the master replica (index 0):
    ``running = (1 - momentum) * running + momentum * batch`` with the unbiased variance, or
    the cumulative average when ``momentum`` is None. Without ``replica_call`` this is an
    ordinary training-mode batch norm through the same kernels. ``process_call`` (from a
    :class:`~functions.distributed.ProcessGroupSync`) syncs across the ranks of its group too,
    on the master replica (index 0) of each process. ``residual`` (z, None: 0) is shaped and
    typed as ``input``; ``act`` is the identity when ``negative_slope`` is None, else
    ``p if p > 0 else p * negative_slope`` (ReLU: 0.0). Returns ``y``, shaped and laid out as
    ``input``.
    """
    return SyncBatchNormFunction.apply(
        input,
        weight,
        bias,
        running_mean,
        running_var,
        num_batches_tracked,
        momentum,
        eps,
        replica_call,
        layer,
        process_call,
        residual,
        negative_slope,
    )
