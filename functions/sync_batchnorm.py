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

How the replicas and ranks exchange (rounds, fences, collectives, failures) is the business of
the :class:`~functions.synchronization.Synchronizer` that the layer hands in: this module is the
math over the ``torch.ops.syncbn`` operators.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import Function
from torch.nn import functional as F

from . import backend, checks, reference  # noqa: F401  (backend: registers the kernels)
from .reference import in_dtype, memory_format_of, values_per_channel
from .stats import check_values_per_channel
from .synchronization import Synchronizer


class SyncBatchNormFunction(Function):
    generate_vmap_rule = True  # the operators have vmap rules (functions/ops.py)
    """Batch norm with statistics over every replica's batch (see the module docstring).

    ``apply(input, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps,
    sync, layer, residual, negative_slope)`` returns ``(y, mean, invstd)`` (the last two, in the
    accumulation dtype, are not differentiable). ``sync`` is a :class:`Synchronizer`, or None for a
    lone replica of a lone process (then one ``batch_norm_train`` operator does the whole
    forward); ``layer`` names the layer in errors. ``input`` is ``(N, C, *)``; weight, bias and
    running stats are ``(C,)`` or None; ``residual`` is None or shaped as ``input``;
    ``negative_slope`` is None (no activation) or the activation's slope below 0 (ReLU: 0).

    Backward with ``create_graph=True`` (double backward, gradient penalties) recomputes the
    forward with torch's differentiable ops and differentiates that, for a lone replica; a
    synchronized call raises instead.
    """

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
        sync: Synchronizer | None,
        layer: str,
        residual: Tensor | None = None,
        negative_slope: float | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        x = input.contiguous(memory_format=memory_format_of(input))
        if sync is None:
            check_values_per_channel(values_per_channel(x), layer, [x.shape])
            return torch.ops.syncbn.batch_norm_train(
                x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, residual, negative_slope
            )
        count, mean, var, mean_acc, invstd = sync.global_stats(x, *torch.ops.syncbn.local_stats(x), eps)
        if sync.is_master:
            # a count still on the device (deferred checks): the update in device ops, no host read
            update = reference.update_running_stats if isinstance(count, Tensor) else torch.ops.syncbn.update_running_stats
            update(running_mean, running_var, num_batches_tracked, momentum, mean, var, count)
        y = torch.ops.syncbn.elemt_forward(x, mean_acc, invstd, weight, bias, residual, negative_slope)
        return y, mean_acc, invstd

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple[Tensor, Tensor, Tensor]) -> None:
        input, weight, bias, _, _, _, _, eps, sync, layer, residual, negative_slope = inputs
        _, mean, invstd = output
        ctx.mark_non_differentiable(mean, invstd)
        ctx.save_for_backward(input, weight, bias, residual, mean, invstd)
        ctx.sync, ctx.layer, ctx.eps, ctx.negative_slope = sync, layer, eps, negative_slope
        ctx.count = values_per_channel(input) if sync is None else sync.count

    @staticmethod
    def backward(ctx, grad_output: Tensor, _grad_mean: Tensor | None, _grad_invstd: Tensor | None):  # type: ignore[override]
        if torch.is_grad_enabled():  # create_graph=True
            if ctx.sync is not None:
                error = RuntimeError(
                    f"{ctx.layer}: double backward (create_graph=True) through a layer synchronized across "
                    "replicas or processes is not supported; it is on one device in one process"
                )
                ctx.sync.fail(error)
                raise error
            return differentiable_backward(ctx, grad_output, batch_norm_with_batch_stats, (0, 1, 2, 10))
        try:
            return SyncBatchNormFunction._backward(ctx, grad_output)
        except BaseException as error:
            if ctx.sync is not None:
                ctx.sync.fail(error)
            raise

    @staticmethod
    def _backward(ctx, grad_output: Tensor) -> tuple:
        if ctx.sync is not None:
            checks.read_when_backward_ends()  # the forward's deferred verdicts, if any
        input, weight, bias, residual, mean, invstd = ctx.saved_tensors
        x = input.contiguous(memory_format=memory_format_of(input))
        dy = grad_output.contiguous(memory_format=memory_format_of(x))
        if ctx.negative_slope is None:
            sum_dy, sum_dy_xmu = torch.ops.syncbn.backward_reduce(dy, x, mean)
        else:  # dy through the activation, and its sums, in one pass
            _, dy, sum_dy, sum_dy_xmu = torch.ops.syncbn.backward_affine_act(
                dy, x, mean, invstd, weight, bias, residual, ctx.negative_slope,
                input_grad=False, residual_grad=True, sums=True,
            )
        wants_input, wants_weight, wants_bias = ctx.needs_input_grad[:3]
        grad_input = grad_weight = grad_bias = grad_residual = None
        if wants_input:
            total_dy, total_dy_xmu = (sum_dy, sum_dy_xmu) if ctx.sync is None else ctx.sync.global_grad_sums(sum_dy, sum_dy_xmu)
            count = ctx.count
            if isinstance(count, Tensor):  # on the device: no host read of it
                total_dy, total_dy_xmu, count = reference.sums_per_value(total_dy, total_dy_xmu, count)
            grad_input = torch.ops.syncbn.backward_elemt(dy, x, mean, invstd, weight, total_dy, total_dy_xmu, count)
        if weight is not None and wants_weight:
            grad_weight = in_dtype(sum_dy_xmu * invstd, weight.dtype)
        if bias is not None and wants_bias:
            grad_bias = in_dtype(sum_dy, bias.dtype)
        if residual is not None and ctx.needs_input_grad[10]:
            grad_residual = dy
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None, grad_residual, None


_BASE_APPLY = vars(torch._C._FunctionBase)["apply"]


def apply_function(function: type[Function], *args):
    """``function.apply(*args)`` with every argument given. In eager mode outside torch.func
    transforms this skips what ``Function.apply`` does for Functions with ``setup_context`` on
    every call (an ``inspect.signature`` binding of default arguments: about 100 us, more than a
    small layer's kernels); torch.compile and torch.func get ``apply`` itself."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    unwrap = torch._C._functorch.unwrap_if_dead
    return _BASE_APPLY.__get__(None, function)(*(unwrap(a) if isinstance(a, Tensor) else a for a in args))


def batch_norm_with_batch_stats(ctx, input: Tensor, weight: Tensor | None, bias: Tensor | None, residual: Tensor | None) -> Tensor:
    """The training forward in torch's differentiable ops (what double backward differentiates)."""
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
    :class:`~functions.synchronization.Synchronizer`, which a layer builds for each call) takes
    the statistics over every replica of the process and every rank of its group; without it
    this is an ordinary training-mode batch norm through the same kernels. ``residual`` (z, None: 0) is shaped and
    typed as ``input``; ``act`` is the identity when ``negative_slope`` is None, else
    ``p if p > 0 else p * negative_slope`` (ReLU: 0.0). Returns ``y``, shaped and laid out as
    ``input``.
    """
    y, _, _ = apply_function(
        SyncBatchNormFunction,
        input, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, sync, layer, residual,
        negative_slope,
    )
    return y
