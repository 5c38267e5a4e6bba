"""timm's batch norm + activation layers as ours: ``BatchNormAct2d``, ``SyncBatchNormAct`` and
``FrozenBatchNormAct2d`` (``timm.layers.norm_act``) become :class:`SyncBatchNormAct2d`, with the
same parameters, buffers, ``drop`` and ``act`` modules and ``state_dict`` keys (the conversion
both ways is :mod:`syncbn.modules.conversion`'s).

timm is never imported here unless a layer is built from an activation name: its classes are
recognised by their qualified names, so the library does not depend on timm.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .batchnorm import SyncBatchNorm2d

BATCH_NORM_ACT = "timm.layers.norm_act.BatchNormAct2d"
SYNC_BATCH_NORM_ACT = "timm.layers.norm_act.SyncBatchNormAct"
FROZEN_BATCH_NORM_ACT = "timm.layers.norm_act.FrozenBatchNormAct2d"
TIMM_LAYERS = (BATCH_NORM_ACT, SYNC_BATCH_NORM_ACT, FROZEN_BATCH_NORM_ACT)


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def is_timm_layer(module: nn.Module) -> bool:
    """Whether ``module`` is exactly one of timm's batch norm + activation layers."""
    return qualified_name(type(module)) in TIMM_LAYERS


def make_activation(act_layer: Any, act_kwargs: dict[str, Any] | None, inplace: bool, apply_act: bool) -> nn.Module:
    """The activation module timm's layer builds from the same arguments (a class, a factory or
    a name, which timm's ``create_act_layer`` resolves); ``nn.Identity`` without one."""
    if not apply_act or act_layer is None:
        return nn.Identity()
    kwargs = {"inplace": inplace, **(act_kwargs or {})}
    if isinstance(act_layer, str):
        from timm.layers import create_act_layer  # names are timm's to resolve

        return create_act_layer(act_layer, **kwargs)
    return act_layer(**kwargs)


class SyncBatchNormAct2d(SyncBatchNorm2d):
    """timm's ``BatchNormAct2d`` on our synchronized batch norm: ``act(drop(bn(x)))``.

    Takes timm's constructor arguments (``apply_act``, ``act_layer``, ``act_kwargs``,
    ``inplace``, ``drop_layer``) and holds ``drop`` and ``act`` as timm's layer does, so that its
    ``state_dict`` has the same keys. A ReLU or LeakyReLU ``act`` after an identity ``drop`` is
    fused into our kernels' elementwise pass (``activation``), and not called again; any other
    is applied after the batch norm. ``forward(x, z=None)`` adds ``z`` before a fused
    activation, as :class:`SyncBatchNorm` does; with an unfused one, ``z`` is refused.

    ``timm_class`` is the timm layer that :func:`syncbn.modules.conversion.revert_sync_batchnorm` gives
    back (``BatchNormAct2d`` where the layer was built directly).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        apply_act: bool = True,
        act_layer: Any = nn.ReLU,
        act_kwargs: dict[str, Any] | None = None,
        inplace: bool = True,
        drop_layer: Callable[[], nn.Module] | None = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
        process_group: Any | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, process_group, device=device, dtype=dtype)
        self.timm_class: type | None = None
        self.set_drop_act(drop_layer() if drop_layer is not None else nn.Identity(),
                          make_activation(act_layer, act_kwargs, inplace, apply_act))

    def set_drop_act(self, drop: nn.Module, act: nn.Module) -> None:
        """Hold ``drop`` and ``act``, fusing ``act`` where our kernels can."""
        self.drop, self.act = drop, act
        fusable = type(drop) is nn.Identity
        if fusable and type(act) is nn.ReLU:
            self.activation = "relu"
        elif fusable and type(act) is nn.LeakyReLU:
            self.activation, self.negative_slope = "leaky_relu", float(act.negative_slope)
        else:
            self.activation = None

    @torch.jit.unused
    def _eager(self, input: Tensor, z: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
        if self.activation is not None:  # act is fused (drop is the identity)
            return super()._eager(input, z, mask)
        if z is not None:
            raise ValueError(f"{self._label()}: a residual z needs a fused activation (ReLU or LeakyReLU after no drop)")
        return self.act(self.drop(super()._eager(input, None, mask)))

    def _scripted_activation(self, y: Tensor, z: Tensor | None) -> Tensor:
        activation = self.activation
        if activation is not None:  # act is fused (drop is the identity)
            return F.relu(y) if activation == "relu" else F.leaky_relu(y, self.negative_slope)
        if z is not None:
            raise ValueError("a residual z needs a fused activation (ReLU or LeakyReLU after no drop)")
        return self.act(self.drop(y))

    def _adds_to_torch(self) -> str | None:
        return super()._adds_to_torch() or (None if type(self.act) is type(self.drop) is nn.Identity
                                            else f"applies {type(self.drop).__name__} and {type(self.act).__name__}")

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        if self.num_batches_tracked is None:  # made from timm's frozen layer: no step count, as timm's
            state_dict.pop(prefix + "num_batches_tracked", None)
            # past _BatchNorm's loader, which adds a step count to an older state_dict
            nn.Module._load_from_state_dict(self, state_dict, prefix, *args)
        else:
            super()._load_from_state_dict(state_dict, prefix, *args)
