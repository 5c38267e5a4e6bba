"""The synchronized batch norm layers, drop-in for ``nn.BatchNorm1d/2d/3d``. Users import them
from :mod:`syncbn.modules.nn` (with the converters and the fusion pass); this file imports neither.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..functions import checkpointing, frozen_batch_norm, sync_batch_norm, torch_internals
from ..functions.masking import check_mask, positions_mask
from ..functions.synchronization import traced_ranks
from ..functions.operators.lone_replica import takes_our_kernels
from ..functions.synchronization.distributed import ProcessGroupSync, active_process_group, checked_process_group, consecutive_rank_groups
from ..functions.operators.reference import values_per_channel
from ..functions.stats import check_values_per_channel
from ..functions.operators import backend
from ..functions.synchronization.synchronizer import Synchronizer, check_not_captured, check_not_transformed
from ..functions.synchronization.replicas import (
    REPLICA_ATTR, ReplicaHandle, RoundTracker, in_recomputation, resolve_timeout, warn_if_data_parallel_meets_no_one,
)

from .compiler import disable_when_compiling, record_fx_call
from .drop_in import DropInBatchNorm

__all__ = ["SyncBatchNorm", "SyncBatchNorm1d", "SyncBatchNorm2d", "SyncBatchNorm3d",
           "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "consecutive_rank_groups"]

_HALF_DTYPES = (torch.float16, torch.bfloat16)
ACTIVATIONS = (None, "relu", "leaky_relu")
"""What ``activation=`` takes: none, ReLU, or LeakyReLU with ``negative_slope``."""
_TORCH_BN_TAKES_BIAS = "bias" in inspect.signature(_BatchNorm.__init__).parameters


def _bias_kwarg(bias: bool) -> dict[str, bool]:
    """``bias=`` for torch's batch norm constructors, where the installed torch has it."""
    return {"bias": bias} if _TORCH_BN_TAKES_BIAS else {}


class SyncBatchNorm(DropInBatchNorm, _BatchNorm):
    r"""Batch norm whose training statistics cover the whole batch, however it is split, with
    an optional fused residual and activation, and an optional frozen mode.

    .. math::
        y = \mathrm{act}\left(\frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \cdot \gamma + \beta + z\right)

    Mean and (biased) variance are taken per channel over the batch and spatial dims of every replica's
    input together when the layer runs as ``nn.DataParallel`` or :class:`~syncbn.modules.parallel.ThreadedDataParallel`
    replicas, and of every rank's input when ``process_group`` is given or the default ``torch.distributed``
    group has more than one rank (DDP; both levels at once too); on one device in one process it is exactly
    ``nn.BatchNorm*`` (through ``F.batch_norm``). Running statistics are updated once per step with the
    unbiased variance, as ``nn.BatchNorm*`` does on the full batch, identically on every rank. Eval never
    communicates (as ``nn.SyncBatchNorm``): each replica and rank uses its running statistics, or its own batch's.

    ``forward(x, z=None, mask=None)``: ``mask`` (bool, True where valid) takes the batch statistics over
    the valid positions of a padded batch only (:mod:`syncbn.functions.masking`; fixed statistics check it,
    then ignore it); ``z`` (shaped and typed as ``x``) is added before ``act`` (``activation``, identity
    when None), both fused into one elementwise pass each way. A frozen layer (``frozen=True`` or :meth:`freeze`) normalizes with its running
    statistics in training too, never updates them and never communicates, while weight and
    bias still train: ``nn.BatchNorm*`` in eval mode, whatever the layer's training flag.

    Args:
        num_features: C, the size of dim 1 of the input.
        eps: added to the variance for numerical stability; must be positive. Default: 1e-5
        momentum: weight of the batch statistics in the running statistics, or None for the
            cumulative average. Default: 0.1
        affine: learn a per-channel weight (and bias). Default: True
        track_running_stats: keep running statistics; without them batch statistics are
            used in eval mode too (each replica's and rank's own, never synchronized). Default: True
        process_group: the ``torch.distributed`` group to sync over; None: the default group when it
            has more than one rank. Every rank calls the layer as often, in the same order; one that
            never arrives is covered by the group's timeout (``init_process_group(timeout=...)``). Default: None
        timeout: seconds a replica waits for the other replicas in its process before raising
            :class:`~syncbn.functions.ReplicaSyncError`. Default: ``$SYNCBN_TIMEOUT``, else 60.
        bias: learn a bias (with ``affine``). Default: True
        frozen: normalize with the running statistics, never update or sync them (needs ``track_running_stats``).
            Not part of the state_dict. Default: False
        activation: ``None``, ``'relu'`` or ``'leaky_relu'``, applied after the residual. Default: None
        negative_slope: the slope below 0 of ``'leaky_relu'``. Default: 0.01

    Shape: input ``(N, C, *)`` of rank >= 2 (the 1d/2d/3d classes, subclasses of ``nn.BatchNorm*d``,
    check it as those); ``z`` the same; output the same shape, dtype and memory format.
    """

    _expected_ranks: tuple[int, ...] | None = None
    _lone_call_checked = False  # whether a lone call looked for a stock DataParallel without devices

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
        frozen: bool = False,
        activation: str | None = None,
        negative_slope: float = 0.01,
    ) -> None:
        if not (isinstance(num_features, int) and num_features > 0):
            raise ValueError(f"num_features must be a positive int, got {num_features!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if timeout is not None:
            resolve_timeout(timeout)
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype, **_bias_kwarg(bias)
        )
        if not bias and not _TORCH_BN_TAKES_BIAS:
            self.register_parameter("bias", None)  # torch < 2.13 has no bias argument
        self.process_group = checked_process_group(process_group, f"{type(self).__name__}({num_features})")
        self.timeout = timeout
        self.activation = activation
        self.negative_slope = float(negative_slope)
        self.layer_name: str | None = None
        self.frozen = False
        if frozen:
            self.freeze()
        self._round_tracker = RoundTracker()
        self._process_sync = ProcessGroupSync()
        setattr(self, REPLICA_ATTR, None)

    def _label(self) -> str:
        name = f" '{self.layer_name}'" if self.layer_name else ""
        return f"{type(self).__name__}({self.num_features}){name}"

    def extra_repr(self) -> str:
        extra = [f"timeout={self.timeout}"] if self.timeout is not None else []
        extra += ["frozen=True"] if self.frozen else []
        extra += [f"activation={self.activation!r}"] if self.activation is not None else []
        extra += [f"negative_slope={self.negative_slope}"] if self.activation == "leaky_relu" else []
        return ", ".join([super().extra_repr(), *extra])

    def freeze(self) -> "SyncBatchNorm":
        """Normalize with the running statistics from now on, in training too; never update
        them, never communicate. Weight and bias keep their ``requires_grad``. Returns self."""
        if self.running_mean is None or self.running_var is None:
            raise ValueError(f"{self._label()}: a frozen batch norm needs running statistics (track_running_stats=True)")
        self.frozen = True
        return self

    def unfreeze(self) -> "SyncBatchNorm":
        """Back to batch statistics (and their running updates) in training. Returns self."""
        self.frozen = False
        return self

    def _negative_slope(self) -> float | None:
        """The fused activation as the kernels take it: None (none), 0.0 (ReLU) or the slope."""
        slopes = {None: None, "relu": 0.0, "leaky_relu": self.negative_slope}
        if self.activation not in slopes:
            raise ValueError(f"{self._label()}: activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        return slopes[self.activation]

    def _fuses(self, z: Tensor | None) -> bool:  # a residual or an activation to fuse
        return z is not None or self.activation is not None

    def _activate(self, y: Tensor, z: Tensor | None) -> Tensor:
        """act(y + z) through autograd, unfused: where torch's own batch norm serves."""
        if z is not None:
            y = y + z
        slope = self._negative_slope()  # raises for an activation set to what it does not know
        if slope is None:
            return y
        return F.relu(y) if self.activation == "relu" else F.leaky_relu(y, slope)

    def _check_input_dim(self, input: Tensor) -> None:
        ranks = self._expected_ranks
        if ranks is None and input.dim() < 2:
            raise ValueError(f"{self._label()}: expected at least 2D input (got {input.dim()}D input)")
        if ranks is not None and input.dim() not in ranks:
            expected = " or ".join(f"{r}D" for r in ranks)
            raise ValueError(f"{self._label()}: expected {expected} input (got {input.dim()}D input)")

    def _check_input(self, input: Tensor, z: Tensor | None = None) -> None:
        """Everything that can be wrong with the input, checked before any state changes."""
        self._check_input_dim(input)
        if z is not None:
            self._check_residual(input, z)
        if input.size(1) != self.num_features:
            raise RuntimeError(f"{self._label()}: expected {self.num_features} channels in dim 1, got input of size {tuple(input.shape)}")
        if not input.dtype.is_floating_point:
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

    def _check_residual(self, input: Tensor, z: Tensor) -> None:
        if not isinstance(z, Tensor):
            raise TypeError(f"{self._label()}: the residual z must be a Tensor, got {type(z).__name__}")
        if z.shape != input.shape or z.dtype != input.dtype or z.device != input.device:
            raise RuntimeError(f"{self._label()}: the residual z must match the input, got z of size {tuple(z.shape)}, "
                               f"{z.dtype} on {z.device} for input of size {tuple(input.shape)}, {input.dtype} on {input.device}")

    def _replicate_for_data_parallel(self):
        replica = super()._replicate_for_data_parallel()
        # into __dict__ as Module.__setattr__ would, less its checks: this runs per replica per step
        replica.__dict__[REPLICA_ATTR] = self._round_tracker.join(replica, self._round_settings)
        return replica

    def _round_settings(self) -> tuple[str, float]:  # a new replica round's layer label and timeout
        return self._label(), resolve_timeout(self.timeout)

    @torch.jit.unused  # TorchScript runs DropInBatchNorm._scripted
    def _eager(self, input: Tensor, z: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
        if isinstance(input, torch.fx.Proxy):
            return record_fx_call(self, input, z, mask)
        if not torch.compiler.is_compiling() and torch_internals.in_selective_recomputation():  # its ops differ from the first run's
            with torch_internals.outside_dispatch_modes():
                return self._forward(input, z, mask)
        return self._forward(input, z, mask)

    def _forward(self, input: Tensor, z: Tensor | None, mask: Tensor | None = None) -> Tensor:
        """The one place where a call picks its path, in the words of torch's ``need_sync``: fixed
        statistics (which ignore a ``mask``); batch statistics met with no one (lone), with other
        replicas and/or ranks (synced), or with ranks alone in traced code (traced)."""
        if not self._uses_batch_stats():
            return self._forward_fixed_stats(input, z, mask)
        self._check_batch_eps()
        meeting = self._meeting()
        if meeting is None:
            return self._forward_lone(input, z, mask)
        handle, group = meeting
        if handle is None and self._traces(input):
            return self._forward_traced(input, z, group, mask)
        return self._forward_synced(input, z, handle, group, mask)

    def _traces(self, input: Tensor) -> bool:  # ranks alone meet in traced code (else native)
        return torch.compiler.is_compiling() or backend.NATIVE_ROUNDS is None

    def _forward_lone(self, input: Tensor, z: Tensor | None, mask: Tensor | None = None) -> Tensor:
        """Batch statistics of this input alone: torch's own batch norm where ours is not clearly
        faster (:mod:`syncbn.functions.operators.lone_replica`), else our Function."""
        self._check_input(input, z)
        if not self._lone_call_checked and not torch.compiler.is_compiling():
            self._lone_call_checked = True
            warn_if_data_parallel_meets_no_one()
        # not for momentum=None, whose factor torch reads on the host (a CUDA sync; untraceable)
        takes_torch_kernels = mask is None and self.momentum is not None and not takes_our_kernels(input, fixed_stats=False)
        if takes_torch_kernels:
            if values_per_channel(input) == 1:  # the label is made only then: this is the hot path
                check_values_per_channel(1, self._label(), [input.shape])
            return self._activate(self._torch_batch_norm_train(input), z)
        return self._batch_stats(sync_batch_norm, input, z, mask)

    def _running_state(self) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """(running_mean, running_var, num_batches_tracked) that batch statistics update: none outside
        training; copies where a forward is a checkpoint's recomputation that meets again."""
        if not (self.training and self.track_running_stats):
            return None, None, None
        state = (self.running_mean, self.running_var, self.num_batches_tracked)
        if torch.compiler.is_compiling() or not in_recomputation(getattr(self, REPLICA_ATTR)):
            return state
        return tuple(None if t is None else t.clone() for t in state)  # type: ignore[return-value]

    def _uses_batch_stats(self) -> bool:
        """Batch statistics: in training unless frozen, and in eval without running statistics."""
        return not self.frozen and (self.training or (self.running_mean is None and self.running_var is None))

    def _check_batch_eps(self) -> None:  # as F.batch_norm: batch statistics need it, fixed ones do not
        if not self.eps > 0:
            raise ValueError(f"{self._label()}: batch_norm eps must be positive during training, but got {self.eps}")

    def _meeting(self) -> tuple[ReplicaHandle | None, Any] | None:
        """Whom this call's batch statistics meet: (this replica's handle where the process has
        other replicas, the process group where there are other ranks), or None (no one).
        Batch statistics are global in training only: in eval each replica and each rank uses
        its own batch and never waits for the others (as nn.SyncBatchNorm's need_sync)."""
        handle: ReplicaHandle | None = getattr(self, REPLICA_ATTR)
        group = active_process_group(self.process_group, self._label) if self.training else None
        syncs_replicas = self.training and handle is not None and handle.round.size > 1
        return (handle if syncs_replicas else None, group) if syncs_replicas or group is not None else None

    def _torch_batch_norm_train(self, input: Tensor) -> Tensor:
        """``nn.BatchNorm*.forward`` in training with ``momentum`` set, less the checks that
        :meth:`_check_input` has made: the lone replica's fixed cost is mostly such Python."""
        running_mean, running_var, num_batches_tracked = self._running_state()
        if num_batches_tracked is not None:
            num_batches_tracked.add_(1)
        return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, True, self.momentum, self.eps)

    @disable_when_compiling
    def _forward_synced(self, input: Tensor, z: Tensor | None, handle: ReplicaHandle | None, group: Any,
                        mask: Tensor | None = None) -> Tensor:
        """Replicas (``handle``) and/or ranks (``group``) exchange statistics, eagerly:
        torch.compile breaks the graph here (:func:`~syncbn.modules.compiler.disable_when_compiling`).
        A checkpoint's recomputation takes the first run's statistics instead, where it kept them
        (:mod:`syncbn.functions.checkpointing`)."""
        where = checkpointing.place()
        # the device that a failure report to the ranks is made on (none made without ranks)
        weight = self.weight if group is not None else None
        device = weight.device if weight is not None else input.device
        label = handle.round.layer if handle is not None else self._label()  # the round made it already
        sync = Synchronizer.for_call(handle, group, self._process_sync, label, self.num_features, device)
        call = checkpointing.signature(self, input)
        checkpointing.attach(sync, where, call)
        try:
            self._check_input(input, z)
            check_not_transformed(input, label)
            check_not_captured(input, label)
            y = self._synced(input, z, sync, self._checked_mask(mask, input, label))
        except BaseException as error:
            sync.fail(error)
            raise
        checkpointing.remember(where, call, sync.statistics())
        if y.requires_grad and checkpointing.keeps_nodes(where):
            sync.owe_backward(y)
        return y

    def _forward_traced(self, input: Tensor, z: Tensor | None, group: Any, mask: Tensor | None = None) -> Tensor:
        """Ranks alone in traced code (:mod:`syncbn.functions.synchronization.traced_ranks`), no graph
        break; a rank whose input fails the checks still joins the collective: every rank raises here."""
        try:
            self._check_input(input, z)
            mask = self._checked_mask(mask, input, self._label())
        except Exception as error:
            traced_ranks.report_failure(group, self._label(), self.num_features, error, input.device)
            if not torch.compiler.is_compiling():
                raise
            return input  # never used: the failure's device-side check raises first (a raise here ends the graph)
        return self._traced(input, z, mask, group)

    def _traced(self, input: Tensor, z: Tensor | None, mask: Tensor | None, group: Any) -> Tensor:
        return self._batch_stats(traced_ranks.traced_sync_batch_norm, input, z, mask, group=group)

    def _checked_mask(self, mask: Tensor | None, input: Tensor, label: str) -> Tensor | None:  # as the kernels take it
        return None if mask is None else positions_mask(mask, input, label)

    def _synced(self, input: Tensor, z: Tensor | None, sync: Synchronizer, mask: Tensor | None = None) -> Tensor:
        """The synchronized call itself, its input checked, run natively by ``sync``."""
        running = (*self._running_state(), self.momentum)
        return sync.batch_norm(input, self.weight, self.bias, running, self.eps, z, self._negative_slope(), mask)

    def _batch_stats(self, function: Any, input: Tensor, z: Tensor | None, mask: Tensor | None, **meeting: Any) -> Tensor:
        """``function`` (:func:`~syncbn.functions.sync_batch_norm`, or the traced one with ``meeting``'s
        ``group``) on this layer's state."""
        running_mean, running_var, num_batches_tracked = self._running_state()
        return function(
            input, running_mean, running_var, self.weight, self.bias, self.momentum, self.eps,
            num_batches_tracked=num_batches_tracked, layer=self._label(), residual=z,
            negative_slope=self._negative_slope(), mask=mask, **meeting,
        )

    def _forward_fixed_stats(self, input: Tensor, z: Tensor | None, mask: Tensor | None = None) -> Tensor:
        """Frozen, or eval with running statistics: no update, no communication; a ``mask`` is
        checked as in training, then ignored (the statistics are fixed)."""
        self._check_input(input, z)
        if self.running_mean is None or self.running_var is None:  # frozen, and its statistics taken away
            raise ValueError(f"{self._label()}: frozen without running statistics (set to None, as "
                             "torch.func.replace_all_batch_norm_modules_ does); unfreeze it to use batch statistics")
        if mask is not None:
            check_mask(mask, input, self._label())
        plain_eval = not self.frozen and not self._fuses(z)
        if plain_eval or not takes_our_kernels(input, fixed_stats=True):
            # torch's own eval-mode batch norm (bit-exact, double-differentiable), act unfused
            y = F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
            return self._activate(y, z)
        return frozen_batch_norm(
            input, self.running_mean, self.running_var, self.weight, self.bias, self.eps, z, self._negative_slope()
        )


class SyncBatchNorm1d(SyncBatchNorm, nn.BatchNorm1d):
    """:class:`SyncBatchNorm` for ``(N, C)`` or ``(N, C, L)`` input, as ``nn.BatchNorm1d``."""

    _expected_ranks = (2, 3)


class SyncBatchNorm2d(SyncBatchNorm, nn.BatchNorm2d):
    """:class:`SyncBatchNorm` for ``(N, C, H, W)`` input, as ``nn.BatchNorm2d``."""

    _expected_ranks = (4,)


class SyncBatchNorm3d(SyncBatchNorm, nn.BatchNorm3d):
    """:class:`SyncBatchNorm` for ``(N, C, D, H, W)`` input, as ``nn.BatchNorm3d``."""

    _expected_ranks = (5,)


BatchNorm1d = SyncBatchNorm1d
BatchNorm2d = SyncBatchNorm2d
BatchNorm3d = SyncBatchNorm3d
