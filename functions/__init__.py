"""The math and the synchronization of synchronized batch norm (see ``DESIGN.md``)."""
from .backend import Kernels, backend_info, kernels_for
from .frozen_batchnorm import FrozenBatchNormFunction, frozen_batch_norm
from .replicas import ReplicaSyncError, resolve_timeout
from .sync_batchnorm import SyncBatchNormFunction, sync_batch_norm

__all__ = [
    "FrozenBatchNormFunction",
    "Kernels",
    "ReplicaSyncError",
    "SyncBatchNormFunction",
    "backend_info",
    "frozen_batch_norm",
    "kernels_for",
    "resolve_timeout",
    "sync_batch_norm",
]
