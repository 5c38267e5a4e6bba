"""Activated batch norm layers, drop-in for the ``inplace_abn`` package (1.1): :class:`ABN`
(batch norm then activation), :class:`InPlaceABN` (the same, written over its input, half the
activation memory) and :class:`InPlaceABNSync` (its name for the synchronized one). All three
are synchronized wherever our layers are (replicas of ``nn.DataParallel`` and
:class:`~syncbn.modules.parallel.ThreadedDataParallel`, the ranks of a process group, both), whatever
their class name says. Users import them from :mod:`syncbn.modules.nn`.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from ..functions import torch_internals
from ..functions.inplace_abn import inplace_abn
from ..functions.operators.reference import memory_format_of
from ..functions.operators.reference_abn import ABN_ACTIVATIONS
from ..functions.synchronization.traced_ranks import traced_inplace_abn
from ..functions.synchronization.synchronizer import Synchronizer

from .batchnorm import SyncBatchNorm

__all__ = ["ABN", "InPlaceABN", "InPlaceABNSync"]

_FUSED_SLOPE = {"relu": lambda param: 0.0, "leaky_relu": lambda param: param}
"""The activations that our batch norm kernels fuse, as the slope below 0 they take."""


class ABN(SyncBatchNorm):
    r"""Activated batch norm: batch norm, then an activation, as ``inplace_abn.ABN``.

    .. math::
        y = \mathrm{act}\left(\frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \cdot \gamma + \beta\right)

    Statistics, running statistics, eval, frozen mode and synchronization are those of
    :class:`~syncbn.modules.nn.SyncBatchNorm` (``relu`` and ``leaky_relu`` fused into its elementwise
    passes; ``elu`` applied after). Not in place: autograd keeps the input as torch's layers do.

    Args (``inplace_abn``'s, in its order, then ours by keyword):
        num_features, eps, momentum, affine, track_running_stats: as ``nn.BatchNorm2d``.
        activation: ``"relu"``, ``"leaky_relu"``, ``"elu"`` or ``"identity"``. Default: ``"leaky_relu"``
        activation_param: leaky_relu's slope below 0, or elu's alpha. Default: 0.01
        process_group, timeout, device, dtype, frozen: as :class:`~syncbn.modules.nn.SyncBatchNorm`.

    Shape: ``(N, C, *)``; output the same.
    """

    _activations: tuple[str, ...] = ("relu", *ABN_ACTIVATIONS)

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        activation: str = "leaky_relu",
        activation_param: float = 0.01,
        *,
        process_group: Any | None = None,
        timeout: float | None = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
        frozen: bool = False,
    ) -> None:
        label = f"{type(self).__name__}({num_features})"
        self._check_activation(label, activation, activation_param)
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, process_group, timeout, device, dtype, frozen=frozen
        )
        self.activation: str = activation  # type: ignore[assignment]
        self.activation_param = float(activation_param)

    @classmethod
    def _check_activation(cls, label: str, activation: str, activation_param: float) -> None:
        if activation not in cls._activations:
            raise ValueError(f"{label}: activation must be one of {cls._activations}, got {activation!r}")
        if activation in ("leaky_relu", "elu") and not float(activation_param) > 0:
            what = "slope" if activation == "leaky_relu" else "alpha"
            raise ValueError(f"{label}: {activation}'s {what} (activation_param) must be positive, got {activation_param!r}")

    def extra_repr(self) -> str:
        param = f"[{self.activation_param}]" if self.activation in ("leaky_relu", "elu") else ""
        extra = [f"timeout={self.timeout}"] if self.timeout is not None else []
        extra += ["frozen=True"] if self.frozen else []
        return ", ".join(
            [f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
             f"activation={self.activation}{param}", *extra]
        )

    def _negative_slope(self) -> float | None:
        fused = _FUSED_SLOPE.get(self.activation)
        return None if fused is None else fused(self.activation_param)

    def _fuses(self, z: Tensor | None) -> bool:
        return z is not None or self.activation in _FUSED_SLOPE

    @torch.jit.unused
    def _eager(self, input: Tensor, z: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
        y = super()._eager(input, z, mask)
        return F.elu(y, self.activation_param, inplace=True) if self.activation == "elu" else y

    def _scripted_activation(self, y: Tensor, z: Tensor | None) -> Tensor:
        if self.activation == "relu":
            return F.relu(y)
        if self.activation == "leaky_relu":
            return F.leaky_relu(y, self.activation_param)
        return F.elu(y, self.activation_param) if self.activation == "elu" else y


class InPlaceABN(ABN):
    r"""In-place activated batch norm, as ``inplace_abn.InPlaceABN``: the output is written over
    the input, and autograd keeps only it (and per-channel vectors), not the input as well.

    .. math::
        x \leftarrow \mathrm{act}\left(\frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}}
        \cdot (|\gamma| + \epsilon) + \beta\right)

    The scale is ``|weight| + eps`` (the weight's gradient carries its sign), as in the paper, so
    that the backward can invert the affine step and the activation (``leaky_relu`` with a
    positive slope, ``elu`` with a positive alpha, or ``identity``; ``relu`` is not invertible)
    and recover the normalized input from the output. Statistics, running statistics, eval,
    frozen mode and synchronization are those of :class:`~syncbn.modules.nn.SyncBatchNorm`; the math is
    in :mod:`syncbn.functions.inplace_abn`.

    The input must be writable: not a leaf that requires grad (torch refuses in-place ops on
    those), not an expanded tensor; a later use of the input's old values is caught by autograd
    (its version counter moves). Double backward is not supported (use :class:`ABN`).

    Args: as :class:`ABN`, ``activation`` one of ``"leaky_relu"``, ``"elu"``, ``"identity"``.

    Shape: ``(N, C, *)``; the output is the input tensor itself.
    """

    _activations = ABN_ACTIVATIONS

    @classmethod
    def _check_activation(cls, label: str, activation: str, activation_param: float) -> None:
        if activation == "relu":
            raise ValueError(
                f"{label}: activation 'relu' cannot run in place (it is not invertible: the backward could not "
                "recover its input); use activation='leaky_relu' with a small activation_param (e.g. 0.01), or ABN"
            )
        super()._check_activation(label, activation, activation_param)

    @torch.jit.unused
    def _eager(self, input: Tensor, z: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
        return SyncBatchNorm._eager(self, input, z, mask)  # its activation runs in place, not after as ABN's

    def _scripted(self, input: Tensor, z: Tensor | None, mask: Tensor | None) -> Tensor:
        if z is not None or mask is not None:
            raise TypeError("an in-place activated batch norm takes no residual z and no mask")
        return input.copy_(self._scripted_activation(self._scripted_normalized(input, None, None), None))  # as eager

    def _scripted_scale(self) -> Tensor | None:
        weight = self.weight
        return None if weight is None else weight.abs() + self.eps

    # the checks run where SyncBatchNorm's do, inside a synchronized call: a rank that fails them tells the others
    def _check_input(self, input: Tensor, z: Tensor | None = None) -> None:
        if z is not None:
            raise TypeError(f"{self._label()}: an in-place activated batch norm takes no residual z")
        super()._check_input(input)
        self._check_writable(input)

    def _checked_mask(self, mask: Tensor | None, input: Tensor, label: str) -> None:
        if mask is not None:
            raise NotImplementedError(
                f"{label}: mask= (statistics over a padded batch's valid positions) is not supported in place; "
                "use ABN, which takes it with the same activation (and fuses leaky_relu)"
            )

    def _forward_fixed_stats(self, input: Tensor, z: Tensor | None, mask: Tensor | None = None) -> Tensor:
        return self._inplace(input, z, mask, batch_stats=False)

    def _forward_lone(self, input: Tensor, z: Tensor | None, mask: Tensor | None = None) -> Tensor:
        return self._inplace(input, z, mask, batch_stats=True)

    def _traces(self, input: Tensor) -> bool:
        # the traced in-place kernels take the two layouts only; other inputs meet eagerly
        return super()._traces(input) and input.is_contiguous(memory_format=memory_format_of(input))

    def _traced(self, input: Tensor, z: Tensor | None, mask: Tensor | None, group: Any) -> Tensor:
        """Ranks alone in traced code: the exchange as functional collectives (:mod:`syncbn.functions.synchronization.traced_ranks`)."""
        running_mean, running_var, num_batches_tracked = self._running_state()
        return traced_inplace_abn(
            input, self.weight, self.bias, running_mean, running_var, self.momentum, self.eps, self.activation,
            self.activation_param, num_batches_tracked=num_batches_tracked, group=group, layer=self._label(),
        )

    def _check_writable(self, input: Tensor) -> None:
        if input.is_leaf and input.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(
                f"{self._label()}: the input is a leaf tensor that requires grad, which cannot be written in place "
                "(torch refuses in-place ops on such leaves); feed it a computed tensor, or use ABN"
            )
        if not torch.compiler.is_compiling() and torch_internals.has_internal_overlap(input):
            raise RuntimeError(
                f"{self._label()}: the input cannot be written in place: its elements overlap in memory "
                f"(size {tuple(input.shape)}, stride {input.stride()}, an expanded tensor?); pass input.contiguous()"
            )

    def _synced(self, input: Tensor, z: Tensor | None, sync: Synchronizer, mask: Tensor | None = None) -> Tensor:
        running = (*self._running_state(), self.momentum)
        return sync.inplace_abn(input, self.weight, self.bias, running, self.eps, self.activation, self.activation_param)

    def _inplace(self, input: Tensor, z: Tensor | None, mask: Tensor | None, batch_stats: bool) -> Tensor:
        """On this input alone, checked: batch statistics update the running ones (_running_state); fixed ones are read."""
        self._check_input(input, z)
        self._checked_mask(mask, input, self._label())
        running_mean, running_var, num_batches_tracked = (
            self._running_state() if batch_stats else (self.running_mean, self.running_var, None))
        return inplace_abn(
            input,
            self.weight,
            self.bias,
            running_mean,
            running_var,
            batch_stats,
            self.momentum,
            self.eps,
            self.activation,
            self.activation_param,
            num_batches_tracked=num_batches_tracked,
            layer=self._label(),
        )


class InPlaceABNSync(InPlaceABN):
    """:class:`InPlaceABN` under the name ``inplace_abn`` gives its synchronized layer, with its
    ``group`` argument (the process group; None: the default group when it has more than one
    rank). Every layer of ours synchronizes, this one as :class:`InPlaceABN` does."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        activation: str = "leaky_relu",
        activation_param: float = 0.01,
        group: Any | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, activation, activation_param,
            process_group=kwargs.pop("process_group", group), **kwargs,
        )
