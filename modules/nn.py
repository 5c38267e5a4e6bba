"""User API: synchronized batch norm layers, drop-in for ``nn.BatchNorm1d/2d/3d``.

``from modules import nn as NN``; ``NN.BatchNorm2d(64)`` is ``NN.SyncBatchNorm2d(64)``.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from functions import kernels_for, sync_batch_norm
from functions.distributed import ProcessGroupSync, active_process_group, consecutive_rank_groups, report_failure
from functions.replicas import REPLICA_ATTR, ReplicaHandle, RoundTracker, resolve_timeout

__all__ = [
    "SyncBatchNorm",
    "SyncBatchNorm1d",
    "SyncBatchNorm2d",
    "SyncBatchNorm3d",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "consecutive_rank_groups",
    "convert_sync_batchnorm",
    "revert_sync_batchnorm",
]

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_TORCH_BN_TAKES_BIAS = "bias" in inspect.signature(_BatchNorm.__init__).parameters


def _bias_kwarg(bias: bool) -> dict[str, bool]:
    """``bias=`` for torch's batch norm constructors, where the installed torch has it."""
    return {"bias": bias} if _TORCH_BN_TAKES_BIAS else {}


class SyncBatchNorm(_BatchNorm):
    r"""Batch norm whose training statistics cover the whole batch, however it is split.

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \cdot \gamma + \beta

    Mean and (biased) variance are taken per channel over the batch and spatial dims of every
    replica's input together when the layer runs as ``nn.DataParallel`` or
    :class:`~modules.parallel.ThreadedDataParallel` replicas, and of every rank's input when
    ``process_group`` is given or the default ``torch.distributed`` group has more than one
    rank (DDP; both levels at once too); on one device in one process it is exactly
    ``nn.BatchNorm*`` (through ``F.batch_norm``). Running statistics are updated once per step
    with the unbiased variance, as ``nn.BatchNorm*`` does on the full batch, identically on
    every rank. Eval with running statistics never communicates.

    Args:
        num_features: C, the size of dim 1 of the input.
        eps: added to the variance for numerical stability; must be positive. Default: 1e-5
        momentum: weight of the batch statistics in the running statistics, or None for the
            cumulative average. Default: 0.1
        affine: learn a per-channel weight (and bias). Default: True
        track_running_stats: keep running statistics; without them batch statistics are
            used (and synchronized) in eval mode too. Default: True
        process_group: the ``torch.distributed`` group to sync over; None: the default group
            when it is initialized with more than one rank. Every rank of the group must call
            the layer the same number of times, in the same order. A rank that never arrives
            is covered by the group's own timeout (``init_process_group(timeout=...)``,
            ``new_group(timeout=...)``). Default: None
        timeout: seconds a replica waits for the other replicas in its process before raising
            :class:`~functions.ReplicaSyncError`. Default: ``$SYNCBN_TIMEOUT``, else 60.
        bias: learn a bias (with ``affine``). Default: True

    Shape: input ``(N, C, *)`` of rank >= 2 (the 1d/2d/3d classes check the rank as
    ``nn.BatchNorm*d`` do); output the same shape, dtype and memory format.
    """

    _expected_ranks: tuple[int, ...] | None = None

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any | None = None,
        timeout: float | None = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
    ) -> None:
        if not (isinstance(num_features, int) and num_features > 0):
            raise ValueError(f"num_features must be a positive int, got {num_features!r}")
        if not eps > 0:
            raise ValueError(f"batch_norm eps must be positive, but got {eps}")
        if timeout is not None:
            resolve_timeout(timeout)
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype, **_bias_kwarg(bias)
        )
        if not bias and not _TORCH_BN_TAKES_BIAS:
            self.register_parameter("bias", None)  # torch < 2.13 has no bias argument
        self.process_group = process_group
        self.timeout = timeout
        self.layer_name: str | None = None
        self._round_tracker = RoundTracker()
        self._process_sync = ProcessGroupSync()
        setattr(self, REPLICA_ATTR, None)

    def _label(self) -> str:
        name = f" '{self.layer_name}'" if self.layer_name else ""
        return f"{type(self).__name__}({self.num_features}){name}"

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", timeout={self.timeout}" if self.timeout is not None else "")

    def _check_input_dim(self, input: Tensor) -> None:
        ranks = self._expected_ranks
        if ranks is None and input.dim() < 2:
            raise ValueError(f"{self._label()}: expected at least 2D input (got {input.dim()}D input)")
        if ranks is not None and input.dim() not in ranks:
            expected = " or ".join(f"{r}D" for r in ranks)
            raise ValueError(f"{self._label()}: expected {expected} input (got {input.dim()}D input)")

    def _check_input(self, input: Tensor) -> None:
        """Everything that can be wrong with the input, checked before any state changes."""
        self._check_input_dim(input)
        if input.size(1) != self.num_features:
            raise RuntimeError(
                f"{self._label()}: expected {self.num_features} channels in dim 1, "
                f"got input of size {tuple(input.shape)}"
            )
        if not input.is_floating_point():
            raise RuntimeError(f"{self._label()}: expected a floating point input, got {input.dtype}")
        # one parameter or buffer stands for all of them: this runs on every call
        name, tensor = ("weight", self.weight) if self.affine else ("running_mean", self.running_mean)
        if tensor is None:
            return
        if tensor.device != input.device:
            raise RuntimeError(f"{self._label()}: input is on {input.device} but {name} is on {tensor.device}")
        if tensor.dtype != input.dtype and not (input.dtype in _HALF_DTYPES and tensor.dtype == torch.float32):
            raise RuntimeError(
                f"{self._label()}: input of {input.dtype} needs {name} of the same dtype "
                f"(or float32 for half inputs), got {tensor.dtype}"
            )

    def _replicate_for_data_parallel(self):
        replica = super()._replicate_for_data_parallel()
        handle = self._round_tracker.join(replica, self._label(), resolve_timeout(self.timeout))
        setattr(replica, REPLICA_ATTR, handle)
        return replica

    def forward(self, input: Tensor) -> Tensor:
        handle: ReplicaHandle | None = getattr(self, REPLICA_ATTR)
        try:
            return self._forward(input, handle)
        except BaseException as error:
            if handle is not None:
                handle.round.abort(error, handle.index)
            raise

    def _forward(self, input: Tensor, handle: ReplicaHandle | None) -> Tensor:
        uses_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        group = active_process_group(self.process_group, self._label()) if uses_batch_stats else None
        # the master replica of each process (or the lone layer) takes part in the collectives
        process_call = None
        if group is not None and (handle is None or handle.index == 0):
            process_call = self._process_sync.next_call(group, self._label())
        self._check_input_before(process_call, input)
        replicated = handle is not None and handle.round.size > 1
        # a lone replica of a lone process takes our kernels only where they beat torch's own
        ours = uses_batch_stats and (replicated or group is not None or kernels_for(input.device).serves_single_device)
        if not ours:
            if uses_batch_stats and input.numel() == input.size(1):
                raise ValueError(
                    f"{self._label()}: Expected more than 1 value per channel when training, "
                    f"got input size {input.size()}"
                )
            return super().forward(input)
        updates = self.training and self.track_running_stats
        return sync_batch_norm(
            input,
            self.running_mean if updates else None,
            self.running_var if updates else None,
            self.weight,
            self.bias,
            self.momentum,
            self.eps,
            num_batches_tracked=self.num_batches_tracked if updates else None,
            replica_call=handle.next_call() if replicated else None,
            process_call=process_call,
            layer=self._label(),
        )

    def _check_input_before(self, process_call: Any | None, input: Tensor) -> None:
        """:meth:`_check_input`; on bad input, first tell the other ranks (they raise too,
        rather than wait in the collective until its timeout)."""
        try:
            self._check_input(input)
        except (ValueError, RuntimeError):
            if process_call is not None:
                device = self.weight.device if self.weight is not None else input.device
                report_failure(process_call, self.num_features, device)
            raise


class SyncBatchNorm1d(SyncBatchNorm):
    """:class:`SyncBatchNorm` for ``(N, C)`` or ``(N, C, L)`` input, as ``nn.BatchNorm1d``."""

    _expected_ranks = (2, 3)


class SyncBatchNorm2d(SyncBatchNorm):
    """:class:`SyncBatchNorm` for ``(N, C, H, W)`` input, as ``nn.BatchNorm2d``."""

    _expected_ranks = (4,)


class SyncBatchNorm3d(SyncBatchNorm):
    """:class:`SyncBatchNorm` for ``(N, C, D, H, W)`` input, as ``nn.BatchNorm3d``."""

    _expected_ranks = (5,)


BatchNorm1d = SyncBatchNorm1d
BatchNorm2d = SyncBatchNorm2d
BatchNorm3d = SyncBatchNorm3d

_TO_SYNC: dict[type, type[SyncBatchNorm]] = {
    nn.BatchNorm1d: SyncBatchNorm1d,
    nn.BatchNorm2d: SyncBatchNorm2d,
    nn.BatchNorm3d: SyncBatchNorm3d,
    nn.SyncBatchNorm: SyncBatchNorm,
}
_TO_TORCH: dict[type, type[_BatchNorm]] = {sync: plain for plain, sync in _TO_SYNC.items()}


def _move_state(source: _BatchNorm, target: _BatchNorm) -> _BatchNorm:
    """Give ``target`` the very parameters, buffers and training flag of ``source``."""
    target.weight, target.bias = source.weight, source.bias
    target.running_mean, target.running_var = source.running_mean, source.running_var
    target.num_batches_tracked = source.num_batches_tracked
    target.train(source.training)
    if hasattr(source, "qconfig"):
        target.qconfig = source.qconfig
    return target


def _layer_args(layer: _BatchNorm) -> dict[str, Any]:
    return dict(
        num_features=layer.num_features,
        eps=layer.eps,
        momentum=layer.momentum,
        affine=layer.affine,
        track_running_stats=layer.track_running_stats,
        device="meta",
        **_bias_kwarg(layer.bias is not None or not layer.affine),
    )


def _rebuild_children(module: nn.Module, result: nn.Module, convert_child) -> nn.Module:
    """Put ``convert_child(name, child)`` in each child slot of ``result``; every slot, so that
    a layer held twice is replaced in both places."""
    for child_name, child in list(module._modules.items()):
        if child is not None:
            result.add_module(child_name, convert_child(child_name, child))
    return result


def _convert(module: nn.Module, name: str, process_group: Any | None, memo: dict[int, nn.Module]) -> nn.Module:
    if id(module) in memo:
        return memo[id(module)]
    result = module
    if isinstance(module, SyncBatchNorm):
        if process_group is not None:
            module.process_group = process_group
        module.layer_name = module.layer_name or name or None
    elif type(module) in _TO_SYNC:
        result = _move_state(module, _TO_SYNC[type(module)](**_layer_args(module)))  # type: ignore[arg-type]
        result.process_group = process_group if process_group is not None else getattr(module, "process_group", None)
        result.layer_name = name or None
    memo[id(module)] = result
    return _rebuild_children(
        module, result, lambda child_name, child: _convert(child, f"{name}.{child_name}" if name else child_name, process_group, memo)
    )


def convert_sync_batchnorm(module: nn.Module, process_group: Any | None = None) -> nn.Module:
    """Turn every ``nn.BatchNorm1d/2d/3d`` and ``nn.SyncBatchNorm`` in ``module`` into ours.

    The new layers hold the very same weight and bias Parameters (so optimizers keep working),
    buffers, requires_grad, training flag, device and dtype (and an ``nn.SyncBatchNorm``'s
    process group, unless ``process_group`` is given); each gets its path in the model as
    ``layer_name`` for error messages. A layer held in two places becomes one layer of ours in
    both. Returns the converted module (a new object when ``module`` itself is a batch norm).
    """
    return _convert(module, "", process_group, {})


def _revert(module: nn.Module, memo: dict[int, nn.Module]) -> nn.Module:
    if id(module) in memo:
        return memo[id(module)]
    result = module
    if isinstance(module, SyncBatchNorm):
        plain = next(_TO_TORCH[cls] for cls in type(module).__mro__ if cls in _TO_TORCH)
        args = _layer_args(module)
        if plain is nn.SyncBatchNorm:
            args["process_group"] = module.process_group
        result = _move_state(module, plain(**args))
    memo[id(module)] = result
    return _rebuild_children(module, result, lambda _, child: _revert(child, memo))


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """The way back: our layers become ``nn.BatchNorm1d/2d/3d`` (``SyncBatchNorm``, of any
    rank, becomes ``nn.SyncBatchNorm``), keeping parameters, buffers and the training flag."""
    return _revert(module, {})


def name_sync_layers(module: nn.Module) -> None:
    """Give every unnamed layer of ours its path in ``module``, for error messages."""
    for name, layer in module.named_modules():
        if isinstance(layer, SyncBatchNorm) and not layer.layer_name:
            layer.layer_name = name or None
