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

The replicas and ranks meet through the :class:`~functions.synchronization.synchronizer.Synchronizer` as the
autograd Function of :mod:`functions.sync_batchnorm` does (at the native round, one replica
doing every replica's work: :meth:`~functions.synchronization.synchronizer.Synchronizer.on_master`), with the same statistics
(:func:`~functions.sync_batchnorm.normalization_every_replica`) and sums
(:func:`~functions.sync_batchnorm.global_sums`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import Function

from .synchronization import checks
from . import devices, torch_internals
from .operators import reference
from .operators.ops import OVERLOADS
from .operators.reference import accumulation_dtype, in_dtype, memory_format_of, values_per_channel
from .operators.reference_abn import ABN_ACTIVATIONS
from .stats import LocalStats, Running, check_values_per_channel, merge, update_running_stats
from .sync_batchnorm import global_sums, normalization_every_replica
from .synchronization.synchronizer import Synchronizer, check_not_captured


class _ForwardPart(NamedTuple):
    """One replica's share of an in-place forward: the input written over, its (replica's)
    parameters, its stream."""

    x: Tensor
    weight: Tensor | None
    bias: Tensor | None
    stream: "torch.cuda.Stream | None"


class _BackwardPart(NamedTuple):
    """One replica's share of an in-place backward: its output, the output's gradient, its
    invstd and parameters, and which gradients it wants (input, weight, bias)."""

    y: Tensor
    dy: Tensor
    invstd: Tensor
    weight: Tensor | None
    bias: Tensor | None
    wants: tuple[bool, bool, bool]
    stream: "torch.cuda.Stream | None"
    dy_is_ours: bool
    """Whether dy may be written over (the input gradient takes its storage)."""


class InPlaceABNFunction(Function):
    """In-place activated batch norm (see the module docstring).

    ``apply(x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps,
    activation, activation_param, batch_stats, sync, layer)`` writes the result over ``x``
    (``(N, C, *)``, laid out contiguous or channels_last) and returns it. With ``batch_stats``
    the statistics are the batch's (over every replica and rank with a ``sync``), and the running
    statistics (when given) are updated once; without, they are ``running_mean`` and
    ``running_var``, fixed. ``layer`` names the layer in errors."""

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
        sync: Synchronizer | None,
        layer: str,
    ) -> Tensor:
        act = (eps, activation, activation_param)
        running = (running_mean, running_var, num_batches_tracked, momentum)
        if not batch_stats:
            mean, invstd = _fixed_normalization(running_mean, running_var, eps, x.dtype)  # type: ignore[arg-type]
            OVERLOADS.abn_forward_(x, mean, invstd, weight, bias, *act)
        elif sync is None:
            mean, invstd = _lone_normalization(x, running, eps, layer)
            OVERLOADS.abn_forward_(x, mean, invstd, weight, bias, *act)
        elif sync.given is not None:  # a checkpoint's recomputation: the statistics met already
            mean, invstd, sync.count = sync.given
            OVERLOADS.abn_forward_(x, mean, invstd, weight, bias, *act)
            sync.normalization = mean, invstd
        else:
            part = _ForwardPart(x, weight, bias, sync.stream_for(x.device))
            sync.normalization = sync.on_master("forward", part, lambda parts: _forward_every_replica(parts, sync, running, act))
            invstd = sync.normalization[1]
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, invstd, weight, bias)
        ctx.act, ctx.batch_stats, ctx.sync, ctx.layer = act, batch_stats, sync, layer
        return x

    @staticmethod
    def backward(ctx, grad_output: Tensor):  # type: ignore[override]
        ctx.grad_is_ours = torch_internals.held_by_this_backward_alone(grad_output)  # first: it counts references
        try:
            if torch.is_grad_enabled():
                raise RuntimeError(
                    f"{ctx.layer}: double backward (create_graph=True) through an in-place activated batch norm "
                    "is not supported (its backward recovers the input from the output); use ABN"
                )
            grads = InPlaceABNFunction._backward(ctx, grad_output)
        except BaseException as error:
            if ctx.sync is not None:
                ctx.sync.fail(error)
            raise
        return (*grads, *([None] * 10))

    @staticmethod
    def _backward(ctx, grad_output: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        sync = ctx.sync
        if sync is not None:
            checks.read_when_backward_ends()  # the forward's deferred verdicts, if any
        y, invstd, weight, bias = ctx.saved_tensors
        if sync is not None:
            check_not_captured(y, ctx.layer, "backward")
        dy = grad_output.contiguous(memory_format=memory_format_of(y))
        needs = ctx.needs_input_grad
        wants = (needs[0], weight is not None and needs[1], bias is not None and needs[2])
        stream = None if sync is None else sync.stream_for(y.device)
        dy_is_ours = dy is not grad_output or (ctx.grad_is_ours and dy.dtype == y.dtype)
        part = _BackwardPart(y, dy, invstd, weight, bias, wants, stream, dy_is_ours)
        work = lambda parts: _backward_every_replica(parts, ctx.act, ctx.batch_stats, sync)  # noqa: E731
        return work([part])[0] if sync is None else sync.on_master("backward", part, work)


def _fixed_normalization(running_mean: Tensor, running_var: Tensor, eps: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """mean and invstd from the running statistics, in the accumulation dtype of ``dtype``."""
    acc = accumulation_dtype(dtype)
    return in_dtype(running_mean, acc), torch.rsqrt(running_var.to(acc) + eps)


def _lone_normalization(x: Tensor, running: Running, eps: float, layer: str) -> tuple[Tensor, Tensor]:
    """A lone replica's batch statistics, the running statistics updated: (mean, invstd)."""
    count = values_per_channel(x)
    check_values_per_channel(count, layer, [x.shape])
    mean, m2 = OVERLOADS.local_stats(x)
    count, mean, var = merge([LocalStats(count, mean, m2, x.dtype, x.shape)])
    update_running_stats(running, mean, var, count)
    return reference.normalization(mean, var, eps, accumulation_dtype(x.dtype))


def _forward_every_replica(
    parts: list[_ForwardPart],
    sync: Synchronizer,
    running: Running,
    act: tuple[float, str, float],
) -> list[tuple[Tensor, Tensor]]:
    """On the master: the statistics over every replica and rank, then every part's input
    written over on its stream. Returns each part's (mean, invstd)."""
    normalizations = normalization_every_replica(parts, sync, act[0], running)
    for part, (mean, invstd) in zip(parts, normalizations):
        with devices.on_stream(part.stream):
            OVERLOADS.abn_forward_(part.x, mean, invstd, part.weight, part.bias, *act)
    return normalizations


def _backward_every_replica(
    parts: list[_BackwardPart], act: tuple[float, str, float], batch_stats: bool, sync: Synchronizer | None
) -> list[tuple[Tensor | None, Tensor | None, Tensor | None]]:
    """On the master, for every replica's part: its local (sum_dz, sum_xhat_dz) from y and dy;
    with batch statistics those summed over the replicas and ranks; each part's input gradient,
    and its weight and bias gradients from its own sums. Returns the three gradients per part
    (None where not wanted)."""
    needs_sums = any(any(part.wants) for part in parts) and (batch_stats or any(any(part.wants[1:]) for part in parts))
    local = []
    for part in parts:
        with devices.on_stream(part.stream):
            if needs_sums:
                sum_dz, sum_xhat_dz = OVERLOADS.abn_backward_reduce(part.y, part.dy, part.weight, part.bias, *act)
                ready = None if part.stream is None else devices.mark_ready(sum_xhat_dz)
            else:
                sum_dz = sum_xhat_dz = ready = None
        local.append((None, sum_dz, sum_xhat_dz, ready))
    totals = None
    if batch_stats and any(part.wants[0] for part in parts):
        totals = global_sums(local, values_per_channel(parts[0].y) if sync is None else None, sync, parts[0].stream)
    return [_part_grads(part, sums, totals, act) for part, sums in zip(parts, local)]


def _part_grads(part: _BackwardPart, sums: tuple, totals: tuple | None, act: tuple[float, str, float]):
    """One part's (grad_input, grad_weight, grad_bias) from its own sums and the totals."""
    _, sum_dz, sum_xhat_dz, _ = sums
    wants_input, wants_weight, wants_bias = part.wants
    with devices.on_stream(part.stream):
        grad_input = None
        if wants_input:
            total_dz = total_xhat_dz = None
            count = 0
            if totals is not None:
                total_dz, total_xhat_dz, count, ready = totals
                total_dz = devices.fetch(total_dz, part.y.device, ready)
                total_xhat_dz = devices.fetch(total_xhat_dz, part.y.device, ready)
            operands = (part.invstd, part.weight, part.bias, *act, total_dz, total_xhat_dz, count)
            if part.dy_is_ours:  # one full-size tensor less at the backward's peak
                OVERLOADS.abn_backward_elemt_(part.dy, part.y, *operands)
                grad_input = part.dy
            else:
                grad_input = OVERLOADS.abn_backward_elemt(part.y, part.dy, *operands)
        grad_weight = grad_bias = None
        if wants_weight:
            assert part.weight is not None and sum_xhat_dz is not None
            signed = torch.where(part.weight < 0, -sum_xhat_dz, sum_xhat_dz)
            grad_weight = in_dtype(signed, part.weight.dtype)
        if wants_bias:
            assert part.bias is not None and sum_dz is not None
            grad_bias = in_dtype(sum_dz, part.bias.dtype)
    return grad_input, grad_weight, grad_bias


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
    running statistics. ``activation``: ``"leaky_relu"`` (slope ``activation_param`` > 0),
    ``"elu"`` (alpha ``activation_param`` > 0) or ``"identity"``.
    """
    if activation not in ABN_ACTIVATIONS:
        raise ValueError(f"{layer}: activation must be one of {ABN_ACTIVATIONS}, got {activation!r}")
    if not training and (running_mean is None or running_var is None):
        raise ValueError(f"{layer}: fixed statistics (training=False) need running_mean and running_var")
    if not (torch.compiler.is_compiling() or torch_internals.functorch_transforms_active() or torch.is_inference_mode_enabled()):
        torch_internals.sole_references()  # measured once, here rather than inside a backward
    return InPlaceABNFunction.apply(
        x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, activation,
        float(activation_param), training, sync, layer,
    )
