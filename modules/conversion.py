"""Between torch's batch norm layers and ours: convert a model's layers to ours, revert them, freeze
them, and name them after their paths for error messages."""
from __future__ import annotations

import warnings
from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from ..functions.synchronization.distributed import checked_process_group
from .batchnorm import SyncBatchNorm, SyncBatchNorm1d, SyncBatchNorm2d, SyncBatchNorm3d, _bias_kwarg
from .timm_layers import FROZEN_BATCH_NORM_ACT, SyncBatchNormAct2d, is_timm_layer, qualified_name

_TO_SYNC: dict[type, type[SyncBatchNorm]] = {
    nn.BatchNorm1d: SyncBatchNorm1d,
    nn.BatchNorm2d: SyncBatchNorm2d,
    nn.BatchNorm3d: SyncBatchNorm3d,
    nn.SyncBatchNorm: SyncBatchNorm,
}
_TO_TORCH: dict[type, type[_BatchNorm]] = {sync: plain for plain, sync in _TO_SYNC.items()}


def _move_state(source: nn.Module, target: nn.Module) -> nn.Module:
    """Give ``target`` the very parameters, buffers and training flag of ``source`` (batch norms)."""
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


def _timm_layer_args(layer: nn.Module, frozen: bool) -> dict[str, Any]:
    if frozen:  # timm's frozen layer: affine, with running statistics, eps only
        return dict(num_features=layer.weight.numel(), eps=layer.eps, apply_act=False, device="meta")
    return dict(num_features=layer.num_features, eps=layer.eps, momentum=layer.momentum, affine=layer.affine,
                track_running_stats=layer.track_running_stats, apply_act=False, device="meta")


def _from_timm(layer: nn.Module) -> SyncBatchNormAct2d:
    """Ours for one of timm's layers, holding its very tensors, ``drop`` and ``act``."""
    frozen = qualified_name(type(layer)) == FROZEN_BATCH_NORM_ACT
    ours = SyncBatchNormAct2d(**_timm_layer_args(layer, frozen))
    ours.timm_class = type(layer)
    if frozen:  # timm's frozen layer: four buffers in this order (weight and bias too), no step count
        for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            delattr(ours, name)
        for name in ("weight", "bias", "running_mean", "running_var"):
            ours.register_buffer(name, getattr(layer, name))
        ours.register_buffer("num_batches_tracked", None)
        ours.freeze().train(layer.training)
    else:
        _move_state(layer, ours)
    ours.set_drop_act(layer.drop, layer.act)
    return ours


def _to_timm(layer: SyncBatchNormAct2d) -> nn.Module:
    """timm's layer back from ours (its ``timm_class``), holding our tensors, ``drop`` and ``act``."""
    import timm.layers.norm_act as norm_act

    cls = layer.timm_class or norm_act.BatchNormAct2d
    frozen_class = qualified_name(cls) == FROZEN_BATCH_NORM_ACT
    if layer.frozen != frozen_class:
        what = "is frozen" if layer.frozen else "is not frozen"
        raise ValueError(f"{layer._label()} {what}, which timm's {cls.__name__} cannot express; "
                         f"{'unfreeze' if layer.frozen else 'freeze'} it first")
    if frozen_class:
        timm_layer = cls(layer.num_features, eps=layer.eps, apply_act=False, device="meta")
        for name in ("weight", "bias", "running_mean", "running_var"):
            timm_layer.register_buffer(name, getattr(layer, name))
    else:
        timm_layer = cls(layer.num_features, layer.eps, layer.momentum, layer.affine, layer.track_running_stats,
                         device="meta", **({"apply_act": False} if cls is norm_act.BatchNormAct2d else {}))
        if cls is norm_act.SyncBatchNormAct:
            timm_layer.process_group = layer.process_group
        _move_state(layer, timm_layer)
    timm_layer.drop, timm_layer.act = layer.drop, layer.act
    timm_layer.train(layer.training)
    return timm_layer


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
    elif type(module) in _TO_SYNC or is_timm_layer(module):
        if type(module) in _TO_SYNC:
            result = _move_state(module, _TO_SYNC[type(module)](**_layer_args(module)))  # type: ignore[arg-type]
        else:
            result = _from_timm(module)
        result.process_group = process_group if process_group is not None else getattr(module, "process_group", None)
        result.layer_name = name or None
    memo[id(module)] = result
    return _rebuild_children(
        module, result, lambda child_name, child: _convert(child, f"{name}.{child_name}" if name else child_name, process_group, memo)
    )


def _left_behind(layer: nn.Module) -> bool:
    """A batch norm that conversion cannot make ours exactly: any ``_BatchNorm`` that is neither
    ours nor exactly one of torch's four classes (subclasses, lazy, quantized ones...)."""
    return (isinstance(layer, _BatchNorm) and not isinstance(layer, SyncBatchNorm) and type(layer) not in _TO_SYNC
            and not is_timm_layer(layer))


def _entry(layer: nn.Module, paths: list[str]) -> str:
    """How a layer left behind is listed: every path that holds it, then its qualified class."""
    cls = type(layer)
    entry = f"{', '.join(paths)}: {cls.__module__}.{cls.__qualname__}"
    # A lazy layer becomes its plain class on its first forward, and only then converts.
    return entry + " (uninitialized: run one forward pass first)" if isinstance(layer, LazyModuleMixin) else entry


def _layers_left_behind(module: nn.Module) -> list[str]:
    """One entry per layer left behind, in model order; a layer held twice is one entry."""
    paths: dict[int, list[str]] = {}
    layers: dict[int, nn.Module] = {}
    for path, layer in module.named_modules(remove_duplicate=False):
        if _left_behind(layer):
            paths.setdefault(id(layer), []).append(path or "(the module itself)")
            layers[id(layer)] = layer
    return [_entry(layers[key], where) for key, where in paths.items()]


def _report_left_behind(module: nn.Module, strict: bool, function: str, outcome: str) -> None:
    """Warn about, or with ``strict`` raise TypeError for, the layers ``function`` would leave
    as they are; nothing is changed here, so a raise leaves ``module`` untouched."""
    entries = _layers_left_behind(module)
    if not entries:
        return
    text = (
        f"{function} {'would leave' if strict else 'leaves'} {len(entries)} batch norm layer(s) as they are, "
        f"{outcome} (only nn.BatchNorm1d/2d/3d, nn.SyncBatchNorm and timm's BatchNormAct2d, SyncBatchNormAct and FrozenBatchNormAct2d convert exactly): {'; '.join(entries)}. "
        "Convert or replace them yourself"
    )
    if strict:
        raise TypeError(text + "; nothing was converted")
    # stacklevel 3: the user's call of convert_sync_batchnorm or freeze_batchnorm.
    warnings.warn(text + ", or pass strict=True to make this an error", UserWarning, stacklevel=3)


def convert_sync_batchnorm(module: nn.Module, process_group: Any | None = None, *, strict: bool = False) -> nn.Module:
    """Turn every ``nn.BatchNorm1d/2d/3d`` and ``nn.SyncBatchNorm`` in ``module`` into ours, and
    timm's ``BatchNormAct2d``, ``SyncBatchNormAct`` and ``FrozenBatchNormAct2d`` into
    :class:`syncbn.modules.timm_layers.SyncBatchNormAct2d` (same ``drop``, ``act`` and state_dict keys).

    The new layers hold the very same weight and bias Parameters (so optimizers keep working),
    buffers, requires_grad, training flag, device and dtype (and an ``nn.SyncBatchNorm``'s
    process group, unless ``process_group`` is given); each gets its path in the model as
    ``layer_name`` for error messages. A layer held in two places becomes one layer of ours in
    both. Returns the converted module (a new object when ``module`` itself is a batch norm).

    Any other ``_BatchNorm`` (a subclass of torch's, an uninitialized ``nn.LazyBatchNorm*d``, a
    quantized one) cannot become ours without losing its behaviour, so it is left as it is,
    not synchronized by this library: one ``UserWarning`` per call lists each such layer (every
    path that holds it, and its class); with ``strict=True`` a ``TypeError`` with the same list
    is raised instead, before anything is changed.
    """
    _report_left_behind(module, strict, "convert_sync_batchnorm", "not synchronized by syncbn")
    return _convert(module, "", checked_process_group(process_group, "convert_sync_batchnorm"), {})


def _revert(module: nn.Module, memo: dict[int, nn.Module]) -> nn.Module:
    if id(module) in memo:
        return memo[id(module)]
    result = module
    if isinstance(module, SyncBatchNormAct2d):
        result = _to_timm(module)
    elif isinstance(module, SyncBatchNorm):
        if module.frozen or module.activation is not None:
            what = "is frozen" if module.frozen else f"has the fused activation {module.activation!r}"
            raise ValueError(f"{module._label()} {what}, which nn.BatchNorm cannot express; unfreeze it or build it unfused")
        plain = next(_TO_TORCH[cls] for cls in type(module).__mro__ if cls in _TO_TORCH)
        args = _layer_args(module)
        if plain is nn.SyncBatchNorm:
            args["process_group"] = module.process_group
        result = _move_state(module, plain(**args))
    memo[id(module)] = result
    return _rebuild_children(module, result, lambda _, child: _revert(child, memo))


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """The way back: our layers become ``nn.BatchNorm1d/2d/3d`` (``SyncBatchNorm``, of any
    rank, becomes ``nn.SyncBatchNorm``), keeping parameters, buffers and the training flag; a
    ``SyncBatchNormAct2d`` becomes the timm layer it came from (``timm_class``). Raises
    ValueError for a frozen layer or one with a fused activation (torch's have neither), and
    for a timm layer whose frozen state its timm class cannot express."""
    return _revert(module, {})


def freeze_batchnorm(module: nn.Module, *, strict: bool = False) -> nn.Module:
    """Freeze every batch norm of ``module``: torch's are converted to ours first (as by
    :func:`convert_sync_batchnorm`), then each is :meth:`SyncBatchNorm.freeze`-d: normalized
    with its running statistics in training too, never updated, never synced; weight and bias
    still train where they require grad. Returns the module (a new object when ``module``
    itself is a batch norm); its state_dict is unchanged.

    Batch norms that conversion leaves as they are (see :func:`convert_sync_batchnorm`) stay
    neither frozen nor synchronized: they are listed in a ``UserWarning``, or with
    ``strict=True`` in a ``TypeError`` raised before anything is changed."""
    _report_left_behind(module, strict, "freeze_batchnorm", "neither frozen nor synchronized by syncbn")
    module = _convert(module, "", None, {})
    for layer in module.modules():
        if isinstance(layer, SyncBatchNorm):
            layer.freeze()
    return module


def name_sync_layers(module: nn.Module) -> None:
    """Give every unnamed layer of ours its path in ``module``, for error messages."""
    for name, layer in module.named_modules():
        if isinstance(layer, SyncBatchNorm) and not layer.layer_name:
            layer.layer_name = name or None
