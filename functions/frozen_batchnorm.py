"""Frozen batch norm: normalization with fixed (running) statistics, in training too.

Forward, per channel, with scale = invstd * weight and shift = bias - mean * scale computed once
(invstd = 1 / sqrt(running_var + eps)):
    y = act(x * scale + shift + z)
Backward, one pass over (dy, x[, z]), with g = dy * act'(x * scale + shift + z):
    dx = g * scale,   dz = g,   grad_weight = sum(g * (x - mean)) * invstd,   grad_bias = sum(g)
each only when it is needed. The statistics are constants: nothing is updated and nothing is
communicated, so replicas and ranks never wait for each other. This is ``nn.BatchNorm*`` in eval
mode (followed by ``+ z`` and the activation), whose weight and bias may still train.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import Function

from .operators import reference
from .operators.ops import OVERLOADS, affine_act_grads
from .operators.reference import accumulation_dtype, memory_format_of
from .sync_batchnorm import apply_function, differentiable_backward


class FrozenBatchNormFunction(Function):
    """Batch norm with fixed statistics (see the module docstring).

    ``apply(input, weight, bias, residual, running_mean, running_var, eps, negative_slope)``
    returns ``(y, mean, invstd)`` (the last two not differentiable): ``input`` ``(N, C, *)``;
    weight, bias, running_mean and running_var ``(C,)`` (weight and bias may be None);
    ``residual`` None or shaped as ``input``; ``negative_slope`` None (no activation) or the
    activation's slope below 0 (ReLU: 0.0). Backward with ``create_graph=True`` differentiates
    the forward written in torch's differentiable ops.
    """

    generate_vmap_rule = True  # the operators have vmap rules (syncbn.functions.operators.ops)

    @staticmethod
    def forward(  # type: ignore[override]
        input: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        residual: Tensor | None,
        running_mean: Tensor,
        running_var: Tensor,
        eps: float,
        negative_slope: float | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        x = input.contiguous(memory_format=memory_format_of(input))
        acc = accumulation_dtype(x.dtype)
        mean = running_mean.to(acc, copy=True)
        invstd = torch.rsqrt(running_var.to(acc) + eps)
        return OVERLOADS.elemt_forward(x, mean, invstd, weight, bias, residual, negative_slope), mean, invstd

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple[Tensor, Tensor, Tensor]) -> None:
        input, weight, bias, residual, _, _, _, negative_slope = inputs
        _, mean, invstd = output
        ctx.mark_non_differentiable(mean, invstd)
        ctx.save_for_backward(input, weight, bias, residual, mean, invstd)
        ctx.negative_slope = negative_slope

    @staticmethod
    def backward(ctx, grad_output: Tensor, _grad_mean: Tensor | None, _grad_invstd: Tensor | None):  # type: ignore[override]
        if torch.is_grad_enabled():  # create_graph=True
            return differentiable_backward(ctx, grad_output, _with_fixed_stats, (0, 1, 2, 3))
        input, weight, bias, residual, mean, invstd = ctx.saved_tensors
        x = input.contiguous(memory_format=memory_format_of(input))
        dy = grad_output.contiguous(memory_format=memory_format_of(x))
        wants_input, wants_weight, wants_bias, wants_residual = ctx.needs_input_grad[:4]
        wants_weight = wants_weight and weight is not None
        wants_bias = wants_bias and bias is not None
        wants_residual = wants_residual and residual is not None
        flags = (wants_input, wants_residual and ctx.negative_slope is not None, wants_weight or wants_bias)
        dx, dz, sum_g, sum_g_xmu = affine_act_grads(
            OVERLOADS.backward_affine_act(
                dy, x, mean, invstd, weight, bias, residual, ctx.negative_slope, *flags
            ),
            *flags,
        )
        if wants_residual and ctx.negative_slope is None:
            dz = dy  # no activation: z's gradient is dy itself
        grad_weight = (sum_g_xmu * invstd).to(weight.dtype) if wants_weight else None
        grad_bias = sum_g.to(bias.dtype) if wants_bias else None
        return dx, grad_weight, grad_bias, dz, None, None, None, None


def _with_fixed_stats(ctx, input: Tensor, weight: Tensor | None, bias: Tensor | None, residual: Tensor | None) -> Tensor:
    """The frozen forward in torch's differentiable ops (what double backward differentiates)."""
    mean, invstd = ctx.saved_tensors[4:]
    return reference.elemt_forward(input, mean, invstd, weight, bias, residual, ctx.negative_slope)


def frozen_batch_norm(
    input: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    residual: Tensor | None = None,
    negative_slope: float | None = None,
) -> Tensor:
    r"""Batch norm with fixed statistics, with an optional fused residual and activation.

    .. math::
        y = \mathrm{act}\left(\frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}} \cdot \gamma + \beta + z\right)

    with :math:`\mu`, :math:`\sigma^2` = ``running_mean``, ``running_var`` (``(C,)``, never
    updated). ``input`` is ``(N, C, *)`` of a floating dtype; ``weight`` and ``bias`` ``(C,)``
    or None; ``residual`` (z, None: 0) shaped and typed as ``input``; ``act`` the identity when
    ``negative_slope`` is None, else ``p if p > 0 else p * negative_slope`` (ReLU: 0.0).
    Gradients flow to input, weight, bias and residual (one pass in backward). Returns ``y``,
    shaped and laid out as ``input``.
    """
    y, _, _ = apply_function(FrozenBatchNormFunction, input, weight, bias, residual, running_mean, running_var, eps, negative_slope)
    return y
