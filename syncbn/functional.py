"""The functional forms and autograd Functions of the layers (their math: :mod:`syncbn.functions`).

- :func:`sync_batch_norm` (:class:`SyncBatchNormFunction`): training-mode batch norm, over every
  replica and rank with a ``sync``, with an optional fused residual and activation;
- :func:`frozen_batch_norm` (:class:`FrozenBatchNormFunction`): normalization with fixed
  statistics, trainable weight and bias;
- :func:`inplace_abn` (:class:`InPlaceABNFunction`): in-place activated batch norm.
"""
from .functions import (
    FrozenBatchNormFunction,
    InPlaceABNFunction,
    ReplicaSyncError,
    SyncBatchNormFunction,
    frozen_batch_norm,
    inplace_abn,
    sync_batch_norm,
)

__all__ = [
    "FrozenBatchNormFunction",
    "InPlaceABNFunction",
    "ReplicaSyncError",
    "SyncBatchNormFunction",
    "frozen_batch_norm",
    "inplace_abn",
    "sync_batch_norm",
]
