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
the :class:`~functions.synchronization.synchronizer.Synchronizer` that the layer hands in: this module is the
math over the ``torch.ops.syncbn`` operators, on the master for every replica
(``_forward_every_replica``, ``_backward_every_replica``). Replicas of one process without a
Where the compiled module is loaded, synchronized calls take the native path instead
(:func:`native_sync_batch_norm`: the same math in ``src/sync_batch_norm.cpp``, each replica's
kernels in its own thread, no Python in the backward but the ranks' collective).
"""
from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence

import torch
from torch import Tensor
from torch.autograd.function import Function
from torch.nn import functional as F

from .operators import backend, reference  # noqa: F401  (backend: registers the kernels)
from .synchronization import checks, distributed
from . import devices, torch_internals
from .operators.ops import OVERLOADS
from .operators.reference import in_dtype, memory_format_of, values_per_channel
from .synchronization.replicas import ReplicaSyncError
from .stats import LocalStats, Running, check_values_per_channel
from .synchronization.synchronizer import Synchronizer, check_not_captured


class SyncBatchNormFunction(Function):
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

    generate_vmap_rule = True  # the operators have vmap rules (functions/operators/ops.py)

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
            return OVERLOADS.batch_norm_train(
                x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, residual, negative_slope
            )
        if sync.given is not None:  # a checkpoint's recomputation: the statistics met already
            mean, invstd, sync.count = sync.given
            y = OVERLOADS.elemt_forward(x, mean, invstd, weight, bias, residual, negative_slope)
        else:
            part = _ForwardPart(x, weight, bias, residual, sync.stream_for(x.device))
            running = (running_mean, running_var, num_batches_tracked, momentum)
            y, mean, invstd = sync.on_master(
                "forward", part, lambda parts: _forward_every_replica(parts, sync, eps, negative_slope, running)
            )
        sync.normalization = mean, invstd
        return y, mean, invstd

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple[Tensor, Tensor, Tensor]) -> None:
        input, weight, bias, _, _, _, _, eps, sync, layer, residual, negative_slope = inputs
        _, mean, invstd = output
        ctx.mark_non_differentiable(mean, invstd)
        ctx.save_for_backward(input, weight, bias, residual, mean, invstd)
        ctx.sync, ctx.layer, ctx.eps, ctx.negative_slope = sync, layer, eps, negative_slope

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
        if ctx.sync is not None:
            check_not_captured(input, ctx.layer, "backward")
        x = input.contiguous(memory_format=memory_format_of(input))
        dy = grad_output.contiguous(memory_format=memory_format_of(x))
        needs = ctx.needs_input_grad
        wants = (needs[0], weight is not None and needs[1], bias is not None and needs[2], residual is not None and needs[10])
        sync, slope = ctx.sync, ctx.negative_slope
        if sync is None:
            part = _BackwardPart(dy, x, mean, invstd, weight, bias, residual, wants, None)
            grads = _backward_every_replica([part], values_per_channel(x), None, slope)[0]
        else:
            part = _BackwardPart(dy, x, mean, invstd, weight, bias, residual, wants, sync.stream_for(x.device))
            # the master's sync holds the global count, and joins the all_reduce
            grads = sync.on_master("backward", part, lambda parts: _backward_every_replica(parts, None, sync, slope))
        grad_input, grad_weight, grad_bias, grad_residual = grads
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None, grad_residual, None


class _StatsPart(Protocol):
    """What :func:`normalization_every_replica` reads of a replica's part."""

    x: Tensor
    stream: "torch.cuda.Stream | None"


class _ForwardPart(NamedTuple):
    """One replica's share of a synchronized forward, and the stream it runs on."""

    x: Tensor
    weight: Tensor | None
    bias: Tensor | None
    residual: Tensor | None
    stream: "torch.cuda.Stream | None"


class _BackwardPart(NamedTuple):
    """One replica's share of a backward: what it saved, its gradient, and which gradients it
    wants (input, weight, bias, residual)."""

    dy: Tensor
    x: Tensor
    mean: Tensor
    invstd: Tensor
    weight: Tensor | None
    bias: Tensor | None
    residual: Tensor | None
    wants: tuple[bool, bool, bool, bool]
    stream: "torch.cuda.Stream | None"


def _forward_every_replica(
    parts: list[_ForwardPart],
    sync: Synchronizer,
    eps: float,
    negative_slope: float | None,
    running: Running,
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """On the master, for every replica's part: the statistics over every replica and rank
    (:func:`normalization_every_replica`), then each part's ``y``. Returns ``(y, mean, invstd)``
    per part."""
    results = []
    for part, (mean, invstd) in zip(parts, normalization_every_replica(parts, sync, eps, running)):
        with devices.on_stream(part.stream):
            y = OVERLOADS.elemt_forward(part.x, mean, invstd, part.weight, part.bias, part.residual, negative_slope)
        results.append((y, mean, invstd))
    return results


def normalization_every_replica(
    parts: Sequence[_StatsPart], sync: Synchronizer, eps: float, running: Running
) -> list[tuple[Tensor, Tensor]]:
    """On the master, for every replica's part (its input ``x``, and its ``stream``): its local
    (count, mean, M2), merged over the replicas and ranks (:meth:`Synchronizer.merge_stats`);
    the running statistics updated once; mean and invstd in the accumulation dtype, computed
    once and fetched to each part's device. Returns ``(mean, invstd)`` per part."""
    local = []
    for part in parts:
        with devices.on_stream(part.stream):
            mean, m2 = OVERLOADS.local_stats(part.x)
            ready = None if part.stream is None else devices.mark_ready(m2)
        local.append(LocalStats(values_per_channel(part.x), mean, m2, part.x.dtype, part.x.shape, ready))
    with devices.on_stream(parts[0].stream):  # the master's, whichever replica's thread runs this
        mean, var = sync.merge_stats(local, running)
        mean_acc, invstd = reference.normalization(mean, var, eps, reference.accumulation_dtype(parts[0].x.dtype))
        # another replica's thread reads them on its stream (none: the only replica, on this thread)
        ready = None if parts[0].stream is None else devices.mark_ready(invstd)
    results = []
    for part in parts:
        with devices.on_stream(part.stream):
            results.append((devices.fetch(mean_acc, part.x.device, ready), devices.fetch(invstd, part.x.device, ready)))
    return results


def _backward_every_replica(
    parts: list[_BackwardPart], count: int | None, sync: Synchronizer | None, negative_slope: float | None
) -> list[tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]]:
    """On the master, for every replica's part: ``dy`` through the activation (if any) and its
    local (sum_dy, sum_dy_xmu); those summed over the replicas and ranks (``count`` values per
    channel without a ``sync``, else the sync's total); each part's input gradient from the totals,
    and its weight, bias and residual gradients from its own sums. Returns the four gradients per
    part (None where not wanted)."""
    local = []
    for part in parts:
        with devices.on_stream(part.stream):
            if negative_slope is None:
                dy = part.dy
                sum_dy, sum_dy_xmu = OVERLOADS.backward_reduce(dy, part.x, part.mean)
            else:  # dy through the activation, and its sums, in one pass
                _, dy, sum_dy, sum_dy_xmu = OVERLOADS.backward_affine_act(
                    part.dy, part.x, part.mean, part.invstd, part.weight, part.bias, part.residual, negative_slope,
                    input_grad=False, residual_grad=True, sums=True,
                )
            ready = None if part.stream is None else devices.mark_ready(sum_dy_xmu)
        local.append((dy, sum_dy, sum_dy_xmu, ready))
    totals = global_sums(local, count, sync, parts[0].stream) if any(part.wants[0] for part in parts) else None
    results = []
    for part, (dy, sum_dy, sum_dy_xmu, _) in zip(parts, local):
        wants_input, wants_weight, wants_bias, wants_residual = part.wants
        with devices.on_stream(part.stream):
            grad_input = None
            if wants_input:
                assert totals is not None
                total_dy, total_dy_xmu, part_count, ready = totals
                total_dy = devices.fetch(total_dy, part.x.device, ready)
                total_dy_xmu = devices.fetch(total_dy_xmu, part.x.device, ready)
                grad_input = OVERLOADS.backward_elemt(
                    dy, part.x, part.mean, part.invstd, part.weight, total_dy, total_dy_xmu, part_count
                )
            grad_weight = in_dtype(sum_dy_xmu * part.invstd, part.weight.dtype) if wants_weight else None  # type: ignore[union-attr]
            grad_bias = in_dtype(sum_dy, part.bias.dtype) if wants_bias else None  # type: ignore[union-attr]
        results.append((grad_input, grad_weight, grad_bias, dy if wants_residual else None))
    return results


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
    :class:`~functions.synchronization.synchronizer.Synchronizer`, which a layer builds for each call) takes
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


def global_sums(
    local: list[tuple[Tensor, Tensor, Tensor, object]], count: int | None, sync: Synchronizer | None,
    stream: "torch.cuda.Stream | None" = None,
) -> tuple[Tensor, Tensor, int | None, object]:
    """The parts' (sum_dy, sum_dy_xmu) summed in replica order on the first part's device, then
    over the ranks (:meth:`Synchronizer.sum_with_ranks`), as backward_elemt takes them with the
    count returned (``count`` without a ``sync``), and an event after them for the other
    replicas' streams (None where this is the only replica: its own thread reads them); queued on
    ``stream``, the master's (whichever replica's thread runs this)."""
    with devices.on_stream(stream):
        return _summed(local, count, sync)


def _summed(
    local: list[tuple[Tensor, Tensor, Tensor, object]], count: int | None, sync: Synchronizer | None
) -> tuple[Tensor, Tensor, int | None, object]:
    device = local[0][1].device
    sums_dy = [devices.fetch(sum_dy, device, ready) for _, sum_dy, _, ready in local]
    sums_dy_xmu = [devices.fetch(sum_dy_xmu, device, ready) for _, _, sum_dy_xmu, ready in local]
    total_dy = sums_dy[0] if len(sums_dy) == 1 else torch.stack(sums_dy).sum(0)
    total_dy_xmu = sums_dy_xmu[0] if len(sums_dy_xmu) == 1 else torch.stack(sums_dy_xmu).sum(0)
    if sync is not None:  # the count is the sync's own total
        total_dy, total_dy_xmu, count = sync.sum_with_ranks(total_dy, total_dy_xmu)
    ready = None if local[0][3] is None else devices.mark_ready(total_dy_xmu)
    return total_dy, total_dy_xmu, count, ready


if backend.NATIVE_ROUNDS is not None:  # the rows' layout, once: the native path builds them too
    backend.NATIVE_ROUNDS.set_row_layout(*distributed.row_layout())


def native_serves() -> bool:
    """Whether :func:`native_sync_batch_norm` serves the synchronized calls: the compiled module is
    loaded (:data:`functions.operators.backend.NATIVE_ROUNDS`) and no torch.func transform is active (they
    need the autograd Function)."""
    return backend.NATIVE_ROUNDS is not None and not torch_internals.functorch_transforms_active()


def native_sync_batch_norm(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    momentum: float | None,
    eps: float,
    *,
    num_batches_tracked: Tensor | None,
    sync: Synchronizer,
    layer: str,
    residual: Tensor | None = None,
    negative_slope: float | None = None,
) -> Tensor:
    """:func:`sync_batch_norm` with ``sync``, in one native call per replica and direction
    (src/sync_batch_norm.cpp): the replica computes its statistics, posts them to its round and
    waits without the GIL; the master merges them (and, with a process group, builds the row,
    calls back :meth:`~functions.synchronization.synchronizer.Synchronizer.gather_rows` for the all_gather
    and merges the ranks' rows with the running statistics' update); each replica normalizes
    its own input. The backward is a C++ autograd node that meets again (the ranks' all_reduce
    through :meth:`~functions.synchronization.synchronizer.Synchronizer.reduce_row`). Same arguments, results,
    errors and timeouts as :func:`sync_batch_norm` (this replica's mean and invstd left in
    ``sync.normalization`` and the count in ``sync.count``, as the Function leaves them; never
    with ``sync.given``); raises :class:`~functions.ReplicaSyncError`
    where the replicas' round broke."""
    call = sync.replica_call
    ranks = None
    if sync.process_call is not None:  # what the native Ranks needs of the call
        sync.native = distributed.native_ranks(sync.process_call, input.dtype, input.device)
        ranks = sync
    try:
        y, mean, invstd, count = backend.NATIVE_ROUNDS.sync_batch_norm(  # type: ignore[union-attr]
            None if call is None else call.round.native(), 0 if call is None else call.index,
            0 if call is None else call.number, input, weight, bias, running_mean, running_var,
            num_batches_tracked, momentum, eps, residual, negative_slope, layer, ranks,
        )
    except ReplicaSyncError as error:
        cause = None if call is None else call.round.failure_cause
        if error.__cause__ is None and cause is not None and not isinstance(cause, ReplicaSyncError):
            error.__cause__ = cause
        raise
    sync.normalization, sync.count = (mean, invstd), count
    return y
