"""A Lightning plug-in that makes a model's batch norms ours for a fit:

    from lightning.pytorch import Trainer
    from syncbn.lightning import SyncBatchNormPlugin

    trainer = Trainer(accelerator="gpu", devices=4, strategy="ddp", plugins=[SyncBatchNormPlugin()])

Lightning's DDP and FSDP strategies call the plug-in's :meth:`~SyncBatchNormPlugin.apply` when a
fit sets up (before the model is moved to its device and wrapped) and its
:meth:`~SyncBatchNormPlugin.revert` at the fit's teardown. It takes the place of
``Trainer(sync_batchnorm=True)``, which converts to torch's ``nn.SyncBatchNorm``: Lightning
refuses the two together.

This module needs Lightning (``pip install lightning``; the older ``pytorch_lightning`` package
serves too, and the plug-in is a ``LayerSync`` of each one installed). ``import syncbn`` does not
import it, so the library itself never depends on Lightning.
"""
from __future__ import annotations

import importlib
import weakref
from typing import Any, Callable, Union

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .batchnorm import SyncBatchNorm
from .conversion import convert_sync_batchnorm, revert_sync_batchnorm

__all__ = ["SyncBatchNormPlugin"]

_PLUGIN_MODULES = ("lightning.pytorch.plugins", "pytorch_lightning.plugins")
"""Where each Lightning package defines ``LayerSync``: the unified package first, then the older one."""

GroupOrFactory = Union[Any, Callable[[], Any], None]
"""A ``torch.distributed`` process group, a function of no arguments that returns one, or None."""


def _layer_sync_bases() -> list[type]:
    """``LayerSync`` of every installed Lightning package; ImportError where there is none."""
    bases = []
    for name in _PLUGIN_MODULES:
        try:
            bases.append(importlib.import_module(name).LayerSync)
        except ModuleNotFoundError as error:
            # A package that is there but lacks a dependency must say so, not pass for absent.
            if (error.name or "").split(".")[0] != name.split(".")[0]:
                raise
    if not bases:
        raise ImportError("syncbn.lightning needs PyTorch Lightning, which is not installed: pip install lightning")
    return bases


_BASES = _layer_sync_bases()


class SyncBatchNormPlugin(_BASES[0]):  # type: ignore[misc, valid-type]
    """Lightning's ``LayerSync`` for syncbn: ``Trainer(strategy="ddp", plugins=[SyncBatchNormPlugin()])``.

    For a fit, every ``nn.BatchNorm1d/2d/3d`` and ``nn.SyncBatchNorm`` of the LightningModule
    becomes ours (:func:`syncbn.nn.convert_sync_batchnorm`: the same parameters and buffers, so
    checkpoints and optimizers are unaffected), synchronized over ``process_group``; at the
    fit's teardown the layers it converted become torch's again, and layers that were ours
    before the fit (frozen or fused ones included) stay ours, with the process group they had.

    Args:
        process_group: the group to synchronize over. None: the default group, all ranks. A
            group object only where it exists before the Trainer is built; with Lightning's
            launchers (which initialize ``torch.distributed`` inside ``fit``) give a function of
            no arguments instead, called on every rank when the fit sets up, e.g.
            ``functools.partial(NN.consecutive_rank_groups, 8)`` (picklable, as
            ``strategy="ddp_spawn"`` needs).
    """

    def __init__(self, process_group: GroupOrFactory = None) -> None:
        self.process_group = process_group
        self._applied: weakref.WeakKeyDictionary[SyncBatchNorm, tuple[bool, Any]] = weakref.WeakKeyDictionary()

    def apply(self, model: nn.Module) -> nn.Module:
        """Make ``model``'s batch norms ours, synchronized over the plug-in's process group;
        returns the model (a new object only where ``model`` itself is a batch norm)."""
        group = self.process_group() if callable(self.process_group) else self.process_group
        before = {
            path: (layer, getattr(layer, "process_group", None))
            for path, layer in model.named_modules(remove_duplicate=False)
            if isinstance(layer, _BatchNorm)
        }
        model = convert_sync_batchnorm(model, group)
        for path, layer in model.named_modules(remove_duplicate=False):
            if isinstance(layer, SyncBatchNorm) and layer not in self._applied:
                original, original_group = before[path]
                self._applied[layer] = (original is not layer, original_group)
        return model

    def revert(self, model: nn.Module) -> nn.Module:
        """Undo :meth:`apply`: the layers it converted become torch's again
        (:func:`syncbn.nn.revert_sync_batchnorm`); layers of ours from before get back their
        process group. Returns the model (a new object only where ``model`` is a batch norm)."""
        return _undo(model, self._applied, {})

    def __getstate__(self) -> dict[str, Any]:
        # What apply did lives in one process only; a pickled copy (ddp_spawn) starts afresh.
        return {"process_group": self.process_group}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["process_group"])


for _other_base in _BASES[1:]:
    # Each Lightning package accepts only its own LayerSync: be one of each.
    _other_base.register(SyncBatchNormPlugin)


def _undo(module: nn.Module, applied: weakref.WeakKeyDictionary, memo: dict[int, nn.Module]) -> nn.Module:
    """``module`` with what ``apply`` did undone, in every slot that holds a layer."""
    if id(module) in memo:
        return memo[id(module)]
    result = module
    if module in applied:
        converted, group = applied.pop(module)
        if not converted:
            module.process_group = group
        else:
            result = revert_sync_batchnorm(module)
            if isinstance(result, nn.SyncBatchNorm):  # torch's before the fit: its own group back
                result.process_group = group
    else:
        for name, child in list(module._modules.items()):
            undone = child if child is None else _undo(child, applied, memo)
            if undone is not child:
                module.add_module(name, undone)
    memo[id(module)] = result
    return result
