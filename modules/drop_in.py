"""What code written for torch's batch norm asks of ours, beyond being an ``nn.BatchNorm*d``:
TorchScript (``torch.jit.script``) for inference, and a clear refusal where torch's
``nn.SyncBatchNorm.convert_sync_batchnorm`` would rebuild our layer as torch's and drop what ours adds.

:class:`DropInBatchNorm` is a base of :class:`~syncbn.modules.batchnorm.SyncBatchNorm`: its
``forward`` runs :meth:`~DropInBatchNorm._scripted` under TorchScript and ``_eager`` otherwise.
The scripted layer normalizes with fixed statistics (eval mode, or frozen) or, without running
statistics, with its own batch's, as the eager layer does in eval; it never synchronizes, so a
layer that needs batch statistics in training (which synchronize) refuses to be scripted.

.. math::
    y = \\mathrm{act}\\left(\\frac{x - \\mu}{\\sqrt{\\sigma^2 + \\epsilon}} \\cdot \\gamma + \\beta + z\\right)

with :math:`\\mu, \\sigma^2` the running statistics (or the batch's, without them) and
:math:`\\gamma` from :meth:`~DropInBatchNorm._scripted_scale` (the weight, or ``|weight| + eps`` in
place); shapes as ``nn.BatchNorm*d``: ``(N, C, *)`` in and out.
"""
from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _NormBase

__all__ = ["DropInBatchNorm"]


class DropInBatchNorm:
    """TorchScript's forward and torch's functions' refusal for the layers of this library (a mixin
    of :class:`~syncbn.modules.batchnorm.SyncBatchNorm`, which has every attribute read here)."""

    __jit_unused_properties__ = ["qconfig"]  # TorchScript compiles a module's properties, and cannot this one
    __constants__ = [*_NormBase.__constants__, "_expected_ranks"]

    def forward(self, input: Tensor, z: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
        if torch.jit.is_scripting():
            return self._scripted(input, z, mask)
        return self._eager(input, z, mask)

    @torch.jit.unused
    def _eager(self, input: Tensor, z: Tensor | None, mask: Tensor | None) -> Tensor:
        raise NotImplementedError  # the layer classes define it

    def __prepare_scriptable__(self) -> "DropInBatchNorm":
        """torch.jit.script calls this first: a layer that would synchronize batch statistics refuses."""
        if self.training and not self.frozen:  # type: ignore[attr-defined]
            raise RuntimeError(
                f"{self._label()}: torch.jit.script of a batch norm in training mode: its batch statistics "  # type: ignore[attr-defined]
                "synchronize, which TorchScript cannot run. Script the model in eval mode (model.eval()) for "
                "inference, or train with torch.compile (or eagerly); torch.jit.trace also works in eval mode"
            )
        return self

    def _scripted(self, input: Tensor, z: Tensor | None, mask: Tensor | None) -> Tensor:
        """The eval (or frozen) forward in TorchScript."""
        return self._scripted_activation(self._scripted_normalized(input, z, mask), z)

    def _scripted_normalized(self, input: Tensor, z: Tensor | None, mask: Tensor | None) -> Tensor:
        """Normalized with fixed statistics (which ignore a mask), or the batch's without them; plus the residual."""
        if self.training and not self.frozen:
            raise RuntimeError("a scripted syncbn batch norm runs in eval mode (or frozen) only: call .eval()")
        ranks = self._expected_ranks
        if ranks is not None:  # TorchScript compiles this only where the class has them
            if input.dim() not in ranks:
                raise ValueError("expected an input of " + str(ranks) + " dimensions, got " + str(input.dim()))
        elif input.dim() < 2:
            raise ValueError("expected an input of at least 2 dimensions, got " + str(input.dim()))
        running_mean, running_var = self.running_mean, self.running_var
        batch_stats = running_mean is None or running_var is None
        if batch_stats and mask is not None:
            raise RuntimeError("mask= with batch statistics (no running statistics) does not run in TorchScript")
        y = F.batch_norm(input, running_mean, running_var, self._scripted_scale(), self.bias, batch_stats, 0.0, self.eps)
        return y if z is None else y + z

    def _scripted_scale(self) -> Tensor | None:
        return self.weight

    def _scripted_activation(self, y: Tensor, z: Tensor | None) -> Tensor:
        activation = self.activation
        if activation is not None:  # TorchScript compiles this only where the layer has one
            if activation == "relu":
                return F.relu(y)
            if activation == "leaky_relu":
                return F.leaky_relu(y, self.negative_slope)
        return y

    def _adds_to_torch(self) -> str | None:
        """What this layer computes beyond torch's batch norm of its kind (None: nothing)."""
        if self.frozen:  # type: ignore[attr-defined]
            return "is frozen"
        if self.activation is not None:  # type: ignore[attr-defined]
            return f"has the activation {self.activation!r}"  # type: ignore[attr-defined]
        return None

    @property
    def qconfig(self) -> Any:
        """An ordinary attribute, except to torch's ``nn.SyncBatchNorm.convert_sync_batchnorm``: it
        rebuilds every batch norm as its own, with no hook, and reads ``qconfig`` only to copy it, so a
        layer of ours that computes more than torch's batch norm refuses there, naming what would be lost."""
        added = self._adds_to_torch()
        if added is not None and sys._getframe(1).f_code is _TORCH_CONVERT.__code__:
            raise TypeError(
                f"{self._label()} {added}, which torch's nn.SyncBatchNorm.convert_sync_batchnorm would drop: "  # type: ignore[attr-defined]
                "our layers synchronize already (leave them out of it); for torch's layers, build ours without it "
                "and call syncbn.nn.revert_sync_batchnorm"
            )
        try:
            return self.__dict__["qconfig"]
        except KeyError:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute 'qconfig'") from None

    @qconfig.setter
    def qconfig(self, value: Any) -> None:
        self.__dict__["qconfig"] = value

    @qconfig.deleter
    def qconfig(self) -> None:
        del self.__dict__["qconfig"]


_TORCH_CONVERT = torch.nn.SyncBatchNorm.convert_sync_batchnorm.__func__  # type: ignore[attr-defined]
