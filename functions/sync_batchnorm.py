"""Synchronized batch norm: the autograd Function and its functional entry point, the math over
the operators. The math, written once for the whole project:

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

This module is the math for one device, over the ``torch.ops.syncbn`` operators (the autograd
Function, as torch's and inplace_abn's are); a synchronized call runs the same math natively
(:meth:`syncbn.functions.synchronization.synchronizer.Synchronizer.batch_norm`, ``src/sync_batch_norm.cpp``).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch.autograd.function import Function
from torch.nn import functional as F

from .operators import backend, reference  # noqa: F401  (backend: registers the kernels)
from . import torch_internals
from .operators.ops import OVERLOADS
from . import masking
from .operators.reference import STATS_DTYPE, in_dtype, memory_format_of, values_per_channel
from .stats import check_values_per_channel
from .synchronization.synchronizer import Synchronizer


class SyncBatchNormFunction(Function):
    """Batch norm with the batch's statistics on one device (see the module docstring).

    ``apply(input, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps,
    layer, residual, negative_slope, mask)`` returns ``(y, mean, invstd)`` (the last two, in the
    accumulation dtype, are not differentiable); one ``batch_norm_train`` operator does the whole
    forward, or with a ``mask`` (bool ``(N, *spatial)``, :func:`syncbn.functions.masking.positions_mask`)
    the masked one over the valid positions (:mod:`syncbn.functions.masking`). ``layer`` names
    the layer in errors. ``input`` is ``(N, C, *)``; weight, bias and
    running stats are ``(C,)`` or None; ``residual`` is None or shaped as ``input``;
    ``negative_slope`` is None (no activation) or the activation's slope below 0 (ReLU: 0).

    Backward with ``create_graph=True`` (double backward, gradient penalties) recomputes the
    forward with torch's differentiable ops and differentiates that.
    """

    generate_vmap_rule = True  # the operators have vmap rules (syncbn.functions.operators.ops)

    @staticmethod
    def forward(  # type: ignore[override]
        input: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        num_batches_tracked: Tensor | None,
        momentum: float | None,
        eps: float,
        layer: str,
        residual: Tensor | None = None,
        negative_slope: float | None = None,
        mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        x = input.contiguous(memory_format=memory_format_of(input))
        if mask is not None:
            running = (running_mean, running_var, num_batches_tracked, momentum)
            return masking.batch_norm_train(x, mask, weight, bias, running, eps, layer, residual, negative_slope)
        check_values_per_channel(values_per_channel(x), layer, [x.shape])
        return OVERLOADS.batch_norm_train(
            x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, residual, negative_slope
        )

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple[Tensor, Tensor, Tensor]) -> None:
        input, weight, bias, _, _, _, _, eps, layer, residual, negative_slope, *mask = inputs
        _, mean, invstd = output
        ctx.mark_non_differentiable(mean, invstd)
        ctx.save_for_backward(input, weight, bias, residual, mean, invstd, *mask)
        ctx.layer, ctx.eps, ctx.negative_slope = layer, eps, negative_slope

    @staticmethod
    def backward(ctx, grad_output: Tensor, _grad_mean: Tensor | None, _grad_invstd: Tensor | None):  # type: ignore[override]
        if torch.is_grad_enabled():  # create_graph=True
            return differentiable_backward(ctx, grad_output, batch_norm_with_batch_stats, (0, 1, 2, 9))
        input, weight, bias, residual, mean, invstd, *mask = ctx.saved_tensors
        mask = mask[0] if mask else None
        x = input.contiguous(memory_format=memory_format_of(input))
        needs = ctx.needs_input_grad
        grads = batch_stats_backward(grad_output, x, mean, invstd, weight, bias, residual, ctx.negative_slope, mask,
                                     None, (needs[0], needs[1], needs[2], needs[9]))
        grad_input, grad_weight, grad_bias, grad_residual = grads
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, grad_residual, None, None


def batch_stats_backward(
    grad_output: Tensor, x: Tensor, mean: Tensor, invstd: Tensor, weight: Tensor | None, bias: Tensor | None,
    residual: Tensor | None, negative_slope: float | None, mask: Tensor | None, count: int | Tensor | None,
    needs: tuple[bool, bool, bool, bool], meet: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """(grad_input, grad_weight, grad_bias, grad_residual) of the module docstring's backward,
    each where ``needs`` says. ``x`` is the input as the forward normalized it; ``count`` the values
    (with a ``mask``, the valid positions) per channel of every part, an int or a 0-dim device
    tensor (None: ``x``'s own, counted only where the input gradient needs it); ``meet`` sums the per-channel (sum_dy, sum_dy_xmu) over the other parts (ranks), and
    is called whatever ``needs`` says, so that every rank joins it; None: this input is the batch."""
    dy = grad_output.contiguous(memory_format=memory_format_of(x))
    if negative_slope is None:
        sum_dy, sum_dy_xmu = OVERLOADS.backward_reduce(dy, x, mean)
    else:  # dy through the activation (z's gradient too), and its sums, in one pass
        _, dy, sum_dy, sum_dy_xmu = OVERLOADS.backward_affine_act(
            dy, x, mean, invstd, weight, bias, residual, negative_slope, input_grad=False, residual_grad=True, sums=True,
        )
    total_dy, total_dy_xmu = (sum_dy, sum_dy_xmu) if meet is None else meet(sum_dy, sum_dy_xmu)
    grad_input = None
    if needs[0]:
        if count is None:
            count = values_per_channel(x) if mask is None else mask.sum(dtype=STATS_DTYPE)
        if mask is not None or isinstance(count, Tensor):  # the kernels take an int count
            total_dy, total_dy_xmu, count = reference.sums_per_value(total_dy, total_dy_xmu, count)
        if mask is None:
            grad_input = OVERLOADS.backward_elemt(dy, x, mean, invstd, weight, total_dy, total_dy_xmu, count)
        else:
            grad_input = OVERLOADS.masked_backward_elemt(dy, x, mean, invstd, weight, total_dy, total_dy_xmu, mask)
    grad_weight = in_dtype(sum_dy_xmu * invstd, weight.dtype) if weight is not None and needs[1] else None
    grad_bias = in_dtype(sum_dy, bias.dtype) if bias is not None and needs[2] else None
    grad_residual = dy if residual is not None and needs[3] else None
    return grad_input, grad_weight, grad_bias, grad_residual


def apply_function(function: type[Function], *args):
    """``function.apply(*args)`` with every argument given. In eager mode outside torch.func
    transforms this skips what ``Function.apply`` does for Functions with ``setup_context`` on
    every call (an ``inspect.signature`` binding of default arguments: about 100 us, more than a
    small layer's kernels); torch.compile and torch.func get ``apply`` itself."""
    if torch.compiler.is_compiling() or torch_internals.functorch_transforms_active():
        return function.apply(*args)
    return torch_internals.apply_without_binding(function, *args)


def batch_norm_with_batch_stats(ctx, input: Tensor, weight: Tensor | None, bias: Tensor | None, residual: Tensor | None) -> Tensor:
    """The training forward in torch's differentiable ops (what double backward differentiates)."""
    mask = ctx.saved_tensors[6] if len(ctx.saved_tensors) > 6 else None
    if mask is not None:
        y = masking.differentiable_forward(input, mask, weight, bias, ctx.eps)
    else:
        y = F.batch_norm(input, None, None, weight, bias, True, 0.0, ctx.eps)
    return reference.activation(y if residual is None else y + residual, ctx.negative_slope)


def differentiable_backward(ctx, grad_output: Tensor, recompute, positions: tuple[int, int, int, int]) -> tuple:
    """Backward for ``create_graph=True``: ``recompute(ctx, input, weight, bias, residual)`` (the
    forward in differentiable ops, on the first four saved tensors) differentiated by autograd,
    so that the gradients are differentiable in turn. ``positions``: where input, weight, bias
    and residual are among the Function's inputs."""
    input, weight, bias, residual = ctx.saved_tensors[:4]
    wanted = [
        (i, t)
        for i, t in zip(positions, (input, weight, bias, residual))
        if t is not None and ctx.needs_input_grad[i]
    ]
    with torch.enable_grad():
        y = recompute(ctx, input, weight, bias, residual)
        grads = torch.autograd.grad(y, [t for _, t in wanted], grad_output, create_graph=True, allow_unused=True)
    result: list[Tensor | None] = [None] * len(ctx.needs_input_grad)
    for (i, _), grad in zip(wanted, grads):
        result[i] = grad
    return tuple(result)


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
    sync: Synchronizer | None = None,
    layer: str = "sync_batch_norm",
    residual: Tensor | None = None,
    negative_slope: float | None = None,
    mask: Tensor | None = None,
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
    the cumulative average when ``momentum`` is None. ``sync`` (a
    :class:`~syncbn.functions.synchronization.synchronizer.Synchronizer`, which a layer builds for each call) takes
    the statistics over every replica of the process and every rank of its group
    (:meth:`~syncbn.functions.synchronization.synchronizer.Synchronizer.batch_norm`); without it this is an
    ordinary training-mode batch norm through the same kernels. ``residual`` (z, None: 0) is shaped and
    typed as ``input``; ``act`` is the identity when ``negative_slope`` is None, else
    ``p if p > 0 else p * negative_slope`` (ReLU: 0.0). ``mask`` (None: every position) takes E
    and Var over the valid positions of a padded batch only, True marking one
    (:func:`syncbn.functions.masking.positions_mask` says which shapes it takes), and normalizes
    every position with them. Returns ``y``, shaped and laid out as ``input``.
    """
    if mask is not None:
        mask = masking.positions_mask(mask, input, layer)
    if sync is not None:
        running = (running_mean, running_var, num_batches_tracked, momentum)
        return sync.batch_norm(input, weight, bias, running, eps, residual, negative_slope, mask)
    y, _, _ = apply_function(
        SyncBatchNormFunction,
        input, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, layer, residual,
        negative_slope, mask,
    )
    return y

