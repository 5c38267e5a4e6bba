"""The operators of the synchronized batch norm, ``torch.ops.syncbn.<name>``: their schemas,
declared once here, and what every device gets whatever was built.

- The schemas below are the one declaration of each operation. The compiled extensions register
  their kernels for their dispatch key (``src/operators.h``: CPU from ``functions/_C_<capability>``,
  CUDA from ``functions/_C_cuda``) when :mod:`functions.backend` imports them.
- The pure-PyTorch reference (:mod:`functions.reference`) is registered as the
  ``CompositeExplicitAutograd`` kernel: it serves every device without a compiled kernel of its
  own (and every device under ``SYNCBN_KERNELS=reference``, where no extension is loaded).
- A fake implementation of each (shapes, dtypes and layouts only) lets torch.compile,
  torch.export and FakeTensor trace through them; ``torch.library.opcheck`` checks all of this
  in ``tests/test_ops.py``.
- A vmap rule of each (:func:`register_vmap_rules`) folds the vmapped dimension into the
  channels, as functorch's own batch-norm rule does, so that torch.func.vmap works.

The operators have no autograd formula of their own: :class:`functions.SyncBatchNormFunction`
and :class:`functions.FrozenBatchNormFunction` are their autograd. Called through the
dispatcher, the compiled kernels run without the GIL.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import reference
from .reference import STATS_DTYPE, accumulation_dtype, memory_format_of

NAMESPACE = "syncbn"

SCHEMAS = {
    "local_stats": "(Tensor x) -> (Tensor mean, Tensor m2)",
    "merge_stats": "(Tensor counts, Tensor means, Tensor m2s) -> (Tensor mean, Tensor var)",
    "elemt_forward": (
        "(Tensor x, Tensor mean, Tensor invstd, Tensor? weight, Tensor? bias, Tensor? residual=None, "
        "float? negative_slope=None) -> Tensor"
    ),
    "backward_reduce": "(Tensor dy, Tensor x, Tensor mean) -> (Tensor sum_dy, Tensor sum_dy_xmu)",
    "backward_elemt": (
        "(Tensor dy, Tensor x, Tensor mean, Tensor invstd, Tensor? weight, Tensor sum_dy, Tensor sum_dy_xmu, "
        "SymInt count) -> Tensor"
    ),
    "backward_affine_act": (
        "(Tensor dy, Tensor x, Tensor mean, Tensor invstd, Tensor? weight, Tensor? bias, Tensor? residual, "
        "float? negative_slope, bool input_grad, bool residual_grad, bool sums) "
        "-> (Tensor dx, Tensor g, Tensor sum_g, Tensor sum_g_xmu)"
    ),
    "update_running_stats": (
        "(Tensor(a!)? running_mean, Tensor(b!)? running_var, Tensor(c!)? num_batches_tracked, float? momentum, "
        "Tensor mean, Tensor var, SymInt count) -> ()"
    ),
    "batch_norm_train": (
        "(Tensor x, Tensor? weight, Tensor? bias, Tensor(a!)? running_mean, Tensor(b!)? running_var, "
        "Tensor(c!)? num_batches_tracked, float? momentum, float eps, Tensor? residual=None, "
        "float? negative_slope=None) -> (Tensor y, Tensor mean, Tensor invstd)"
    ),
}
"""Schema of each operator. Per-channel outputs are ``(C,)``; full-size ones are shaped as
``x`` and laid out as :func:`functions.reference.memory_format_of` says."""

LIBRARY = torch.library.Library(NAMESPACE, "DEF")
for _name, _schema in SCHEMAS.items():
    LIBRARY.define(_name + _schema)
    LIBRARY.impl(_name, getattr(reference, _name), "CompositeExplicitAutograd")


def _full_size_like(x: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=memory_format_of(x))


def _per_channel(x: Tensor, dtype: torch.dtype) -> Tensor:
    return x.new_empty(x.size(1), dtype=dtype)


@torch.library.register_fake(f"{NAMESPACE}::local_stats")
def _local_stats_fake(x: Tensor) -> tuple[Tensor, Tensor]:
    return _per_channel(x, STATS_DTYPE), _per_channel(x, STATS_DTYPE)


@torch.library.register_fake(f"{NAMESPACE}::merge_stats")
def _merge_stats_fake(counts: Tensor, means: Tensor, m2s: Tensor) -> tuple[Tensor, Tensor]:
    return means.new_empty(means.size(1)), means.new_empty(means.size(1))


@torch.library.register_fake(f"{NAMESPACE}::elemt_forward")
def _elemt_forward_fake(x, mean, invstd, weight, bias, residual=None, negative_slope=None) -> Tensor:
    return _full_size_like(x)


@torch.library.register_fake(f"{NAMESPACE}::backward_reduce")
def _backward_reduce_fake(dy: Tensor, x: Tensor, mean: Tensor) -> tuple[Tensor, Tensor]:
    return _per_channel(x, mean.dtype), _per_channel(x, mean.dtype)


@torch.library.register_fake(f"{NAMESPACE}::backward_elemt")
def _backward_elemt_fake(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count) -> Tensor:
    return _full_size_like(x)


@torch.library.register_fake(f"{NAMESPACE}::backward_affine_act")
def _backward_affine_act_fake(
    dy, x, mean, invstd, weight, bias, residual, negative_slope, input_grad, residual_grad, sums
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dx = _full_size_like(x) if input_grad else x.new_empty(0)
    g = _full_size_like(x) if residual_grad else x.new_empty(0)
    size = x.size(1) if sums else 0
    return dx, g, mean.new_empty(size), mean.new_empty(size)


@torch.library.register_fake(f"{NAMESPACE}::update_running_stats")
def _update_running_stats_fake(running_mean, running_var, num_batches_tracked, momentum, mean, var, count) -> None:
    return None


@torch.library.register_fake(f"{NAMESPACE}::batch_norm_train")
def _batch_norm_train_fake(
    x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, residual=None, negative_slope=None
) -> tuple[Tensor, Tensor, Tensor]:
    acc = accumulation_dtype(x.dtype)
    return _full_size_like(x), _per_channel(x, acc), _per_channel(x, acc)


def affine_act_grads(outputs: tuple[Tensor, Tensor, Tensor, Tensor], input_grad: bool, residual_grad: bool, sums: bool):
    """``backward_affine_act``'s outputs with what was not asked for as None."""
    dx, g, sum_g, sum_g_xmu = outputs
    return dx if input_grad else None, g if residual_grad else None, *((sum_g, sum_g_xmu) if sums else (None, None))
