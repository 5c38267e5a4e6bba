"""The math and the synchronization of synchronized batch norm (where each behaviour lives: docs/code-map.md)."""
if __name__ == "functions":  # the repository's directory imported by its own name: a second copy
    raise ImportError("the repository's functions/ is syncbn.functions: import syncbn (from syncbn import nn)")
from .operators import lone_replica, ops
from .operators.backend import backend_info, backend_name, serves_single_device, use_kernels
from .synchronization.checks import check_pending
from .frozen_batchnorm import FrozenBatchNormFunction, frozen_batch_norm
from .inplace_abn import InPlaceABNFunction, inplace_abn
from .synchronization.replicas import ReplicaSyncError, resolve_timeout
from .sync_batchnorm import SyncBatchNormFunction, sync_batch_norm

__all__ = [
    "FrozenBatchNormFunction",
    "InPlaceABNFunction",
    "ReplicaSyncError",
    "SyncBatchNormFunction",
    "backend_info",
    "check_pending",
    "frozen_batch_norm",
    "inplace_abn",
    "backend_name",
    "resolve_timeout",
    "serves_single_device",
    "sync_batch_norm",
    "use_kernels",
]
