"""In-place activated batch norm (In-Place ABN, Rota Bulo, Porzi and Kontschieder, CVPR 2018):
the autograd Function and its functional entry point, synchronized as the other layers are.

Forward, per channel, with the batch's (or the running) mean and invstd = 1 / sqrt(var + eps):
    x <- y = act(x_hat * gamma + beta),   x_hat = (x - mean) * invstd,   gamma = |weight| + eps,
written over the input (``torch.ops.syncbn.abn_forward_``); act is leaky_relu (slope > 0), elu
(alpha > 0) or the identity, all invertible, and gamma > 0 keeps the affine step invertible too.
Autograd saves y (the input's storage) and per-channel vectors only.
Backward, from y and dy alone: z = act^-1(y), dz = dy * act'(z), x_hat = (z - beta) / gamma;
sum_dz and sum_xhat_dz per channel (``abn_backward_reduce``), summed over every replica and rank
in one exchange with batch statistics; then (``abn_backward_elemt``)
    dx = (dz - sum_dz / N - x_hat * sum_xhat_dz / N) * gamma * invstd    (batch statistics),
    dx = dz * gamma * invstd                                              (fixed statistics),
grad_weight = sign(weight) * local sum_xhat_dz (+1 where weight is 0), grad_bias = local sum_dz.

The autograd Function here is the math on one device; a synchronized call runs the same math
natively (:meth:`syncbn.functions.synchronization.synchronizer.Synchronizer.inplace_abn`,
``src/sync_batch_norm.cpp``).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch.autograd.function import Function

from . import torch_internals
from .operators import reference
from .operators.ops import OVERLOADS
from .operators.reference import accumulation_dtype, in_dtype, memory_format_of, values_per_channel
from .operators.reference_abn import ABN_ACTIVATIONS
from .stats import Running, check_values_per_channel, update_running_stats
from .synchronization.synchronizer import Synchronizer


class InPlaceABNFunction(Function):
    """In-place activated batch norm on one device (see the module docstring).

    ``apply(x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps,
    activation, activation_param, batch_stats, layer)`` writes the result over ``x``
    (``(N, C, *)``, laid out contiguous or channels_last) and returns it. With ``batch_stats``
    the statistics are the batch's, and the running statistics (when given) are updated once;
    without, they are ``running_mean`` and ``running_var``, fixed. ``layer`` names the layer in
    errors."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        num_batches_tracked: Tensor | None,
        momentum: float | None,
        eps: float,
        activation: str,
        activation_param: float,
        batch_stats: bool,
        layer: str,
    ) -> Tensor:
        act = (eps, activation, activation_param)
        if batch_stats:
            mean, invstd = _batch_normalization(x, (running_mean, running_var, num_batches_tracked, momentum), eps, layer)
        else:
            mean, invstd = _fixed_normalization(running_mean, running_var, eps, x.dtype)  # type: ignore[arg-type]
        OVERLOADS.abn_forward_(x, mean, invstd, weight, bias, *act)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, invstd, weight, bias)
        ctx.act, ctx.batch_stats, ctx.layer = act, batch_stats, layer
        return x

    @staticmethod
    def backward(ctx, grad_output: Tensor):  # type: ignore[override]
        grad_is_ours = torch_internals.held_by_this_backward_alone(grad_output)  # first: it counts references
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"{ctx.layer}: double backward (create_graph=True) through an in-place activated batch norm "
                "is not supported (its backward recovers the input from the output); use ABN"
            )
        y, invstd, weight, bias = ctx.saved_tensors
        count = values_per_channel(y) if ctx.batch_stats else None
        grads = inplace_abn_backward(grad_output, y, invstd, weight, bias, ctx.act, count, ctx.needs_input_grad[:3],
                                     grad_is_ours)
        return *grads, *([None] * 9)


def inplace_abn_backward(
    grad_output: Tensor, y: Tensor, invstd: Tensor, weight: Tensor | None, bias: Tensor | None,
    act: tuple[float, str, float], count: int | Tensor | None, needs: tuple[bool, bool, bool],
    may_overwrite: bool = False, meet: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(grad_input, grad_weight, grad_bias) of the module docstring's backward from the output
    ``y``, each where ``needs`` says. ``count``: the values per channel of every part (an int or a
    0-dim device tensor), None for fixed statistics; ``meet`` sums the per-channel (sum_dz,
    sum_xhat_dz) over the other parts (ranks), called whatever ``needs`` says, so that every rank
    joins it; ``may_overwrite``: ``grad_output`` is this backward's alone, dx may go into it."""
    dy = grad_output.contiguous(memory_format=memory_format_of(y))
    batch_stats = count is not None
    sum_dz = sum_xhat_dz = None
    if (needs[0] and batch_stats) or needs[1] or needs[2] or meet is not None:
        sum_dz, sum_xhat_dz = OVERLOADS.abn_backward_reduce(y, dy, weight, bias, *act)
    totals: tuple = (None, None, 0)
    if batch_stats:
        total_dz, total_xhat_dz = (sum_dz, sum_xhat_dz) if meet is None else meet(sum_dz, sum_xhat_dz)
        if isinstance(count, Tensor):  # the kernels take an int count
            total_dz, total_xhat_dz, count = reference.sums_per_value(total_dz, total_xhat_dz, count)
        totals = (total_dz, total_xhat_dz, count)
    grad_input = grad_weight = grad_bias = None
    if needs[0]:
        operands = (invstd, weight, bias, *act, *totals)
        if dy is not grad_output or (may_overwrite and dy.dtype == y.dtype):  # one full-size tensor less at the peak
            OVERLOADS.abn_backward_elemt_(dy, y, *operands)
            grad_input = dy
        else:
            grad_input = OVERLOADS.abn_backward_elemt(y, dy, *operands)
    if weight is not None and needs[1]:
        grad_weight = in_dtype(torch.where(weight < 0, -sum_xhat_dz, sum_xhat_dz), weight.dtype)
    if bias is not None and needs[2]:
        grad_bias = in_dtype(sum_dz, bias.dtype)  # type: ignore[arg-type]
    return grad_input, grad_weight, grad_bias


def _fixed_normalization(running_mean: Tensor, running_var: Tensor, eps: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """mean and invstd from the running statistics, in the accumulation dtype of ``dtype``."""
    acc = accumulation_dtype(dtype)
    return in_dtype(running_mean, acc), torch.rsqrt(running_var.to(acc) + eps)


def _batch_normalization(x: Tensor, running: Running, eps: float, layer: str) -> tuple[Tensor, Tensor]:
    """The batch's statistics, the running statistics updated: (mean, invstd)."""
    count = values_per_channel(x)
    check_values_per_channel(count, layer, [x.shape])
    mean, m2 = OVERLOADS.local_stats(x)
    var = m2 / count
    update_running_stats(running, mean, var, count)
    return reference.normalization(mean, var, eps, accumulation_dtype(x.dtype))


def inplace_abn(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    training: bool = True,
    momentum: float | None = 0.1,
    eps: float = 1e-5,
    activation: str = "leaky_relu",
    activation_param: float = 0.01,
    *,
    num_batches_tracked: Tensor | None = None,
    sync: Synchronizer | None = None,
    layer: str = "inplace_abn",
) -> Tensor:
    r"""In-place activated batch norm, as ``inplace_abn.inplace_abn`` (its arguments in its order):

    .. math::
        x \leftarrow \mathrm{act}\left(\frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}}
        \cdot (|\gamma| + \epsilon) + \beta\right)

    ``x`` is ``(N, C, *)`` of a floating dtype, written over and returned (autograd saves it,
    the output, and per-channel vectors only); ``weight``, ``bias``, ``running_mean`` and
    ``running_var`` are ``(C,)`` or None. With ``training``, E and Var (biased) are the batch's
    per channel (over every replica and rank with a ``sync``), and the running statistics, when
    given, are updated once with the unbiased variance (``momentum`` None: the cumulative
    average over ``num_batches_tracked``, which counts the calls); without, they are the
    running statistics. ``sync`` (a :class:`~syncbn.functions.synchronization.synchronizer.Synchronizer`,
    which a layer builds for each call) takes the batch statistics over every replica and rank
    (:meth:`~syncbn.functions.synchronization.synchronizer.Synchronizer.inplace_abn`). ``activation``: ``"leaky_relu"`` (slope ``activation_param`` > 0),
    ``"elu"`` (alpha ``activation_param`` > 0) or ``"identity"``.
    """
    if activation not in ABN_ACTIVATIONS:
        raise ValueError(f"{layer}: activation must be one of {ABN_ACTIVATIONS}, got {activation!r}")
    if not training and (running_mean is None or running_var is None):
        raise ValueError(f"{layer}: fixed statistics (training=False) need running_mean and running_var")
    if not (torch.compiler.is_compiling() or torch_internals.functorch_transforms_active() or torch.is_inference_mode_enabled()):
        torch_internals.sole_references()  # measured once, here rather than inside a backward
    if sync is not None:
        if not training:
            raise ValueError(f"{layer}: a synchronized call takes batch statistics (training=True)")
        running = (running_mean, running_var, num_batches_tracked, momentum)
        return sync.inplace_abn(x, weight, bias, running, eps, activation, float(activation_param))
    return InPlaceABNFunction.apply(
        x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, activation,
        float(activation_param), training, layer,
    )
