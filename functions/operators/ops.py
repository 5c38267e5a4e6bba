"""The operators of the synchronized batch norm, ``torch.ops.syncbn.<name>``: their schemas,
declared once here, and what every device gets whatever was built.

- The schemas below are the one declaration of each operation. The compiled extensions register
  their kernels for their dispatch key (``src/operators.h``: CPU from ``functions/_C_<capability>``,
  CUDA from ``functions/_C_cuda``) when :mod:`syncbn.functions.operators.backend` imports them.
- The pure-PyTorch reference (:mod:`syncbn.functions.operators.reference`) is registered as the
  ``CompositeExplicitAutograd`` kernel: it serves every device without a compiled kernel of its
  own (and every device after ``use_kernels(cpu="reference", cuda="reference")``).
- A fake implementation of each (shapes, dtypes and layouts only) lets torch.compile,
  torch.export and FakeTensor trace through them; ``torch.library.opcheck`` checks all of this
  in ``tests/test_ops.py``.
- A vmap rule of each (:func:`register_vmap_rules`) folds the vmapped dimension into the
  channels, as functorch's own batch-norm rule does, so that torch.func.vmap works.

The operators have no autograd formula of their own: :class:`syncbn.functions.SyncBatchNormFunction`,
:class:`syncbn.functions.FrozenBatchNormFunction` and :class:`syncbn.functions.InPlaceABNFunction` are their
autograd. The in-place ones (``abn_*``) and the masked ones (``masked_*``) have no vmap rule:
torch.func.vmap over an in-place layer, or with a mask, is not supported. Called through the
dispatcher, the compiled kernels run without the GIL.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from . import reference, reference_abn, reference_masked
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
    # rows of an all_gather over ranks (syncbn.functions.synchronization.distributed): header (its last value the
    # count), mean (C), M2 (C) per rank; judged, merged in row order, running statistics updated
    "merge_gathered_stats": (
        "(Tensor rows, int header, int agreeing, int? flag, Tensor(a!)? running_mean, Tensor(b!)? running_var, "
        "Tensor(c!)? num_batches_tracked, float? momentum) -> (Tensor total, Tensor mean, Tensor var, Tensor valid)"
    ),
    # the float64 row [head, a, b] that one collective over ranks sends (syncbn.functions.synchronization.distributed)
    "pack_row": "(float[] head, Tensor a, Tensor b) -> Tensor",
    "unpack_row": "(Tensor row, int head, ScalarType dtype) -> (Tensor a, Tensor b)",
    "batch_norm_train": (
        "(Tensor x, Tensor? weight, Tensor? bias, Tensor(a!)? running_mean, Tensor(b!)? running_var, "
        "Tensor(c!)? num_batches_tracked, float? momentum, float eps, Tensor? residual=None, "
        "float? negative_slope=None) -> (Tensor y, Tensor mean, Tensor invstd)"
    ),
    # in-place activated batch norm (syncbn.modules.inplace_abn): x is written over, the backward
    # reads the output y and dy only
    "abn_forward_": (
        "(Tensor(a!) x, Tensor mean, Tensor invstd, Tensor? weight, Tensor? bias, float eps, str activation, "
        "float activation_param) -> ()"
    ),
    "abn_backward_reduce": (
        "(Tensor y, Tensor dy, Tensor? weight, Tensor? bias, float eps, str activation, float activation_param) "
        "-> (Tensor sum_dz, Tensor sum_xhat_dz)"
    ),
    "abn_backward_elemt": (
        "(Tensor y, Tensor dy, Tensor invstd, Tensor? weight, Tensor? bias, float eps, str activation, "
        "float activation_param, Tensor? sum_dz, Tensor? sum_xhat_dz, SymInt count) -> Tensor"
    ),
    # statistics over the valid positions of a padded batch: mask is bool (N, *spatial), True where
    # valid; count (0-dim float64) the number of valid positions; the sums given already per value
    "masked_local_stats": "(Tensor x, Tensor mask) -> (Tensor mean, Tensor m2, Tensor count)",
    "masked_backward_elemt": (
        "(Tensor dy, Tensor x, Tensor mean, Tensor invstd, Tensor? weight, Tensor mean_dy, Tensor mean_dy_xmu, "
        "Tensor mask) -> Tensor"
    ),
    "abn_backward_elemt_": (
        "(Tensor(a!) dy, Tensor y, Tensor invstd, Tensor? weight, Tensor? bias, float eps, str activation, "
        "float activation_param, Tensor? sum_dz, Tensor? sum_xhat_dz, SymInt count) -> ()"
    ),
}
"""Schema of each operator. Per-channel outputs are ``(C,)``; full-size ones are shaped as
``x`` and laid out as :func:`syncbn.functions.operators.reference.memory_format_of` says."""

LIBRARY = torch.library.Library(NAMESPACE, "DEF")
for _name, _schema in SCHEMAS.items():
    LIBRARY.define(_name + _schema)
    _home = reference_abn if _name.startswith("abn_") else reference_masked if _name.startswith("masked_") else reference
    LIBRARY.impl(_name, getattr(_home, _name), "CompositeExplicitAutograd")

OVERLOADS = SimpleNamespace(**{name: getattr(getattr(torch.ops, NAMESPACE), name).default for name in SCHEMAS})
"""``torch.ops.syncbn.<name>.default`` for every operator: what the layers call. The same
dispatch as ``torch.ops.syncbn.<name>`` without the packet's overload resolution (about 3 us a
call, measured: more than a small layer's kernels on the synchronized path)."""


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


@torch.library.register_fake(f"{NAMESPACE}::merge_gathered_stats")
def _merge_gathered_stats_fake(
    rows, header, agreeing, flag, running_mean, running_var, num_batches_tracked, momentum
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    channels = (rows.size(1) - header) // 2
    scalar = rows.new_empty((), dtype=STATS_DTYPE)
    return scalar, rows.new_empty(channels, dtype=STATS_DTYPE), rows.new_empty(channels, dtype=STATS_DTYPE), rows.new_empty((), dtype=torch.bool)


@torch.library.register_fake(f"{NAMESPACE}::pack_row")
def _pack_row_fake(head: list[float], a: Tensor, b: Tensor) -> Tensor:
    return a.new_empty(len(head) + a.numel() + b.numel(), dtype=STATS_DTYPE)


@torch.library.register_fake(f"{NAMESPACE}::unpack_row")
def _unpack_row_fake(row: Tensor, head: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    half = (row.numel() - head) // 2
    return row.new_empty(half, dtype=dtype), row.new_empty(half, dtype=dtype)


@torch.library.register_fake(f"{NAMESPACE}::batch_norm_train")
def _batch_norm_train_fake(
    x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, residual=None, negative_slope=None
) -> tuple[Tensor, Tensor, Tensor]:
    acc = accumulation_dtype(x.dtype)
    return _full_size_like(x), _per_channel(x, acc), _per_channel(x, acc)


@torch.library.register_fake(f"{NAMESPACE}::masked_local_stats")
def _masked_local_stats_fake(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return _per_channel(x, STATS_DTYPE), _per_channel(x, STATS_DTYPE), x.new_empty((), dtype=STATS_DTYPE)


@torch.library.register_fake(f"{NAMESPACE}::masked_backward_elemt")
def _masked_backward_elemt_fake(dy, x, mean, invstd, weight, mean_dy, mean_dy_xmu, mask) -> Tensor:
    return _full_size_like(x)


@torch.library.register_fake(f"{NAMESPACE}::abn_forward_")
def _abn_forward_fake(x, mean, invstd, weight, bias, eps, activation, activation_param) -> None:
    return None


@torch.library.register_fake(f"{NAMESPACE}::abn_backward_reduce")
def _abn_backward_reduce_fake(y, dy, weight, bias, eps, activation, activation_param) -> tuple[Tensor, Tensor]:
    acc = accumulation_dtype(y.dtype)
    return _per_channel(y, acc), _per_channel(y, acc)


@torch.library.register_fake(f"{NAMESPACE}::abn_backward_elemt")
def _abn_backward_elemt_fake(
    y, dy, invstd, weight, bias, eps, activation, activation_param, sum_dz, sum_xhat_dz, count
) -> Tensor:
    return _full_size_like(y)


@torch.library.register_fake(f"{NAMESPACE}::abn_backward_elemt_")
def _abn_backward_elemt__fake(
    dy, y, invstd, weight, bias, eps, activation, activation_param, sum_dz, sum_xhat_dz, count
) -> None:
    return None


def affine_act_grads(outputs: tuple[Tensor, Tensor, Tensor, Tensor], input_grad: bool, residual_grad: bool, sums: bool):
    """``backward_affine_act``'s outputs with what was not asked for as None."""
    dx, g, sum_g, sum_g_xmu = outputs
    return dx if input_grad else None, g if residual_grad else None, *((sum_g, sum_g_xmu) if sums else (None, None))


# vmap: the vmapped dimension B becomes part of the channels. A full-size argument (N, C, *)
# batched as (..B..) is seen as (N, B*C, *), a per-channel one as (B*C,); unbatched arguments are
# expanded; per-channel statistics of each (b, c) are exactly those of channel c of sample b.
FULL, CHANNEL, ROWS, OTHER = "full", "channel", "rows", "other"
"""Kinds of operator arguments and outputs for the vmap rules: (N, C, *), (C,), (R, C), other."""

_VMAP_KINDS = {
    "local_stats": ((FULL,), (CHANNEL, CHANNEL)),
    "merge_stats": ((OTHER, ROWS, ROWS), (CHANNEL, CHANNEL)),
    "elemt_forward": ((FULL, CHANNEL, CHANNEL, CHANNEL, CHANNEL, FULL, OTHER), (FULL,)),
    "backward_reduce": ((FULL, FULL, CHANNEL), (CHANNEL, CHANNEL)),
    "backward_elemt": ((FULL, FULL, CHANNEL, CHANNEL, CHANNEL, CHANNEL, CHANNEL, OTHER), (FULL,)),
    "backward_affine_act": (
        (FULL, FULL, CHANNEL, CHANNEL, CHANNEL, CHANNEL, FULL, OTHER, OTHER, OTHER, OTHER),
        (FULL, FULL, CHANNEL, CHANNEL),
    ),
}


def _fold(t, dim: int | None, kind: str, size: int):
    """``t`` with the vmapped dimension ``dim`` (None: unbatched) folded into its channels."""
    if t is None or kind == OTHER or not isinstance(t, Tensor):
        if kind == OTHER and isinstance(t, Tensor) and dim is not None:
            raise RuntimeError("syncbn: vmap over the counts of merge_stats is not supported")
        return t
    axis = {FULL: 1, CHANNEL: 0, ROWS: 1}[kind]
    t = t.unsqueeze(axis).expand(*t.shape[:axis], size, *t.shape[axis:]) if dim is None else t.movedim(dim, axis)
    return t.reshape(*t.shape[:axis], size * t.size(axis + 1), *t.shape[axis + 2 :])


def _unfold(t: Tensor, kind: str, size: int) -> tuple[Tensor, int | None]:
    """An output in the folded channels, with the vmapped dimension split out again, and where it is."""
    if t.numel() == 0 and t.dim() == 1 and kind != CHANNEL:  # not asked for (backward_affine_act)
        return t, None
    if kind == CHANNEL:
        return (t, None) if t.numel() == 0 else (t.reshape(size, -1), 0)
    return t.reshape(t.size(0), size, -1, *t.shape[2:]), 1


def _all_positional(op, in_dims: tuple, args: tuple, kwargs: dict) -> tuple[tuple, tuple]:
    """Every argument of ``op`` in schema order (torch passes some as keywords) and their dims."""
    names = [a.name for a in op._schema.arguments]
    rest = names[len(args):]
    args = (*args, *(kwargs.get(n) if n in kwargs else op._schema.arguments[names.index(n)].default_value for n in rest))
    return args, (*in_dims, *([None] * len(rest)))


def _folding_rule(name: str):
    arg_kinds, out_kinds = _VMAP_KINDS[name]
    op = getattr(torch.ops.syncbn, name).default

    def rule(info, in_dims, *args, **kwargs):
        args, in_dims = _all_positional(op, in_dims, args, kwargs)
        folded = [_fold(a, d, k, info.batch_size) for a, d, k in zip(args, in_dims, arg_kinds)]
        outputs = op(*folded)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        unfolded = [_unfold(t, k, info.batch_size) for t, k in zip(outputs, out_kinds)]
        values, dims = tuple(t for t, _ in unfolded), tuple(d for _, d in unfolded)
        return (values[0], dims[0]) if len(values) == 1 else (values, dims)

    return rule


def _check_running_stats_under_vmap(in_dims, running_mean, momentum) -> None:
    if running_mean is not None and (in_dims[3] is None or in_dims[4] is None):
        raise RuntimeError(
            "syncbn: vmap over a batch norm in training updates running statistics that are not vmapped; "
            "use torch.func.replace_all_batch_norm_modules_ (no running statistics), or vmap them too"
        )
    if running_mean is not None and momentum is None:
        raise RuntimeError("syncbn: vmap over a batch norm with momentum=None (the cumulative average) is not supported")


def _batch_norm_train_rule(info, in_dims, *args, **kwargs):
    args, in_dims = _all_positional(torch.ops.syncbn.batch_norm_train.default, in_dims, args, kwargs)
    x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, residual, negative_slope = args
    _check_running_stats_under_vmap(in_dims, running_mean, momentum)
    size = info.batch_size
    stats = [None if t is None else _fold(t, d, CHANNEL, size).clone() for t, d in zip((running_mean, running_var), in_dims[3:5])]
    y, mean, invstd = torch.ops.syncbn.batch_norm_train(
        _fold(x, in_dims[0], FULL, size), _fold(weight, in_dims[1], CHANNEL, size), _fold(bias, in_dims[2], CHANNEL, size),
        *stats, None, momentum, eps, _fold(residual, in_dims[8], FULL, size), negative_slope,
    )
    for running, dim, updated in zip((running_mean, running_var), in_dims[3:5], stats):
        if running is not None:
            running.movedim(dim, 0).copy_(updated.view(size, -1))
    if num_batches_tracked is not None:
        num_batches_tracked.add_(1)
    return (_unfold(y, FULL, size)[0], mean.view(size, -1), invstd.view(size, -1)), (1, 0, 0)


def register_vmap_rules() -> None:
    """A vmap rule for every operator (``update_running_stats`` only runs inside the others;
    ``merge_gathered_stats``, ``pack_row`` and ``unpack_row`` only on the rows of a collective, which vmap does
    not cross)."""
    for name in _VMAP_KINDS:
        torch.library.register_vmap(f"{NAMESPACE}::{name}", _folding_rule(name))
    torch.library.register_vmap(f"{NAMESPACE}::batch_norm_train", _batch_norm_train_rule)


register_vmap_rules()
