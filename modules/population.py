"""``update_bn``: a model's batch norm running statistics recomputed exactly over a loader's
batches and every rank's, as ``torch.optim.swa_utils.update_bn`` recomputes them (after SWA,
before evaluation or export), but with the population's mean and variance.

The pass, the layers' local state and the hooks live here; the math and the one collective
in :mod:`syncbn.functions.population_stats`.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from ..functions.masking import positions_mask
from ..functions.population_stats import Merged, Population, merge_ranks, share
from ..functions.synchronization.distributed import active_process_group
from .parallel import ThreadedDataParallel

__all__ = ["update_bn"]

_STATS_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


@torch.no_grad()
def update_bn(
    loader: Iterable[Any],
    model: nn.Module,
    device: int | str | torch.device | None = None,
    *,
    process_group: Any | None = None,
    progress: bool = False,
    call: Callable[[nn.Module, Any], Any] | None = None,
) -> None:
    r"""Recompute every batch norm's running statistics as the exact mean and unbiased variance
    of its input over every batch of ``loader`` on every rank.

    ``torch.optim.swa_utils.update_bn``'s signature and use, and its semantics for what each
    layer sees: one pass over the loader, the model in training mode (dropout included), each
    batch norm normalizing with its batch's own statistics, so layer 2's input is what it was in
    the pass where layer 1 used batch statistics (as in training, whose running averages these
    statistics stand for; one pass whatever the depth). Unlike torch's, which averages per-batch
    means and variances (momentum None), the result is the population's, per channel, over the
    :math:`n` values :math:`x_i` the layer saw on every rank:

    .. math::
        \text{running\_mean} = \frac{1}{n}\sum_i x_i, \qquad
        \text{running\_var} = \frac{1}{n - 1}\sum_i (x_i - \text{running\_mean})^2,

    each batch's (count, mean, M2) taken in float64 by a forward pre-hook on the layer and
    merged with Chan's formula, then across ranks: ONE all_gather of every layer's parts, merged
    in rank order, so the statistics are bitwise identical on every rank (torch's, per process,
    differ). Ranks may have different numbers of batches, none included; every rank of the group
    must call ``update_bn``.

    - A layer called with ``mask=`` (statistics over the valid positions of a padded batch)
      counts the valid positions only. Batches reach the model as torch's ``update_bn`` passes
      them, except ``(x, mask)`` (a list or tuple whose second element is a bool tensor), which
      runs ``model(x, mask=mask)``, and a dict with a ``"mask"`` key, which runs
      ``model(**batch)``; ``call(model, batch)`` runs any other signature.
    - During the pass no layer meets other ranks or replicas: each normalizes with its own
      batch's statistics as it does in eval mode without running statistics (ours, torch's
      ``nn.BatchNorm*`` and ``nn.SyncBatchNorm`` alike), its buffers set aside, so the pass
      writes none of them and needs no collective per batch.
    - ``nn.DataParallel``, :class:`~syncbn.modules.parallel.ThreadedDataParallel` and
      ``DistributedDataParallel`` are unwrapped: the bare module runs each whole batch on the
      wrapper's first device (where the wrapper would send inputs), since under a wrapper each
      replica would normalize its slice with the slice's statistics and later layers' inputs
      would depend on the split. A batch too large for one device: make the loader's smaller.
    - Afterwards ``num_batches_tracked`` is the number of inputs the layer saw on every rank
      (torch's ``update_bn`` leaves the count of one process's calls). A layer that saw no
      value on any rank keeps its statistics (torch's resets them to 0 and 1); a frozen layer
      (:meth:`~syncbn.modules.nn.SyncBatchNorm.freeze`) and one without running statistics are left
      as they are. Momentum is not changed. Each module's training flag is restored, and the
      buffers are untouched where the pass raises (where there are other ranks, this rank joins
      the all_gather flagged as failed first, so that they raise too instead of waiting).

    Args:
        loader: batches: a tensor, a list or tuple whose first element is the model's input, or
            anything else (a dict) passed to the model as is.
        model: the model, possibly wrapped as above.
        device: where inputs go (their tensors, in lists, tuples and dicts) before the model.
            Default: None: the wrapper's first device, else where they are.
        process_group: the ranks whose batches count. Default: None: every rank of the default
            group when it is initialized with more than one rank.
        progress: show a ``tqdm`` bar over the loader (where tqdm is installed). Default: False
        call: how a batch runs the model, ``call(model, batch)`` (its tensors moved to
            ``device`` first). Default: None: as described above.
    """
    module, wrapper_device = _unwrap(model)
    device = wrapper_device if device is None else torch.device(device)
    layers = [layer for layer in module.modules() if isinstance(layer, _BatchNorm) and not getattr(layer, "frozen", False)]
    tracked = [layer for layer in layers if _tracks(layer)]
    if not tracked:
        return
    group = active_process_group(process_group, lambda: "update_bn")
    parts = [Population(layer.num_features) for layer in tracked]
    try:
        with ExitStack() as stack:
            stack.enter_context(_training_flags(model))
            stack.enter_context(_local_batch_statistics(layers))
            stack.enter_context(_collecting(tracked, parts))
            _run(loader, module, device, progress, call)
    except Exception:
        if group is not None:
            share(parts, group, failed=True)  # the other ranks raise instead of waiting
        raise
    for layer, merged in zip(tracked, merge_ranks(share(parts, group), parts)):
        _store(layer, merged)


def _unwrap(model: nn.Module) -> tuple[nn.Module, torch.device | None]:
    """The module inside DataParallel, ThreadedDataParallel and DDP wrappers (nested too), and
    the device the outermost wrapper sends inputs to (None: it moves none)."""
    device = None
    while True:
        if isinstance(model, ThreadedDataParallel):
            found = model.devices[0]
        elif isinstance(model, nn.DataParallel):
            found = model.src_device_obj if model.device_ids else None  # no GPU: it runs the module as is
        elif isinstance(model, DistributedDataParallel):
            found = torch.device(model.device_type, model.device_ids[0]) if model.device_ids else None
        else:
            return model, device
        device = found if device is None else device
        model = model.module


def _tracks(layer: _BatchNorm) -> bool:
    """Whether the layer keeps running statistics (that update_bn recomputes)."""
    if layer.running_mean is None or layer.running_var is None:
        return False
    if isinstance(layer.running_mean, nn.parameter.UninitializedBuffer):
        raise ValueError(f"update_bn: {type(layer).__name__} is not initialized yet: run the model once first")
    return True


@contextmanager
def _training_flags(model: nn.Module) -> Iterator[None]:
    """The model in training mode for the block; afterwards each module's own flag again."""
    flags = [(module, module.training) for module in model.modules()]
    try:
        model.train()
        yield
    finally:
        for module, training in flags:
            module.training = training


@contextmanager
def _local_batch_statistics(layers: Sequence[_BatchNorm]) -> Iterator[None]:
    """Each layer in eval mode without running statistics for the block: it normalizes with its
    own batch's statistics and never communicates (as ``nn.SyncBatchNorm`` in eval), and its
    buffers, set aside, are neither read nor written; afterwards the same flags and tensors."""
    saved = [(layer, layer.training, layer.track_running_stats, _stat_buffers(layer)) for layer in layers]
    try:
        for layer, _, _, buffers in saved:
            layer.training = False  # the layer alone: module.eval() would recurse
            layer.track_running_stats = False
            for name in buffers:
                setattr(layer, name, None)
        yield
    finally:
        for layer, training, tracks, buffers in saved:
            layer.training, layer.track_running_stats = training, tracks
            for name, tensor in buffers.items():
                setattr(layer, name, tensor)


def _stat_buffers(layer: _BatchNorm) -> dict[str, Tensor]:
    """The layer's running-statistics buffers that are set (by name)."""
    buffers = {name: getattr(layer, name, None) for name in _STATS_BUFFERS}
    return {name: tensor for name, tensor in buffers.items() if isinstance(tensor, Tensor)}


@contextmanager
def _collecting(layers: Sequence[_BatchNorm], parts: Sequence[Population]) -> Iterator[None]:
    """A forward pre-hook on each layer adds its input to its part for the block."""
    handles = [layer.register_forward_pre_hook(_collector(part), with_kwargs=True) for layer, part in zip(layers, parts)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _collector(part: Population) -> Any:
    """The pre-hook of one layer: ``forward(input, ...)``'s input into ``part``."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs.get("input")
        # input the layer rejects (rank, channels, dtype): left for its own error
        if isinstance(x, Tensor) and x.dim() >= 2 and x.size(1) == part.channels and x.is_floating_point():
            mask = args[2] if len(args) > 2 else kwargs.get("mask")  # forward(input, z=None, mask=None)
            part.add(x, None if mask is None else positions_mask(mask, x, f"update_bn: {type(module).__name__}"))

    return hook


def _run(loader: Iterable[Any], module: nn.Module, device: torch.device | None, progress: bool, call: Any) -> None:
    """One forward per batch, as torch's update_bn calls the model, or with its mask (update_bn)."""
    def on(value: Any) -> Any:  # the model's inputs only go to the device
        return _to(value, device) if device is not None else value

    for batch in _with_bar(loader) if progress else loader:
        if call is not None:
            call(module, on(batch))
        elif isinstance(batch, (list, tuple)) and len(batch) > 1 and _is_mask(batch[1]):
            module(on(batch[0]), mask=on(batch[1]))
        elif isinstance(batch, Mapping) and "mask" in batch:
            module(**on(batch))
        else:
            module(on(batch[0] if isinstance(batch, (list, tuple)) else batch))


def _is_mask(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dtype == torch.bool


def _with_bar(loader: Iterable[Any]) -> Iterable[Any]:
    """``loader`` behind a tqdm progress bar, where tqdm is installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return loader
    return tqdm(loader, desc="update_bn")


def _to(value: Any, device: torch.device) -> Any:
    """``value``'s tensors on ``device``, in (nested) lists, tuples and dicts."""
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, Mapping):
        return type(value)((key, _to(item, device)) for key, item in value.items())  # type: ignore[call-arg]
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple takes its fields one by one
        return type(value)(*(_to(item, device) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to(item, device) for item in value)
    return value


def _store(layer: _BatchNorm, merged: Merged) -> None:
    """The population's statistics into the layer's buffers, in place (in their dtype)."""
    if merged.mean is None or merged.var is None:
        return  # nothing seen anywhere: the statistics stay as they were
    assert layer.running_mean is not None and layer.running_var is not None
    layer.running_mean.copy_(merged.mean)
    layer.running_var.copy_(merged.var)
    if layer.num_batches_tracked is not None:
        layer.num_batches_tracked.fill_(merged.calls)
