"""User API: synchronized batch norm layers, drop-in for ``nn.BatchNorm1d/2d/3d``, and the
functions that convert, freeze and fuse a model's batch norms and recompute their statistics.

``from syncbn import nn as NN``; ``NN.BatchNorm2d(64)`` is ``NN.SyncBatchNorm2d(64)``.

A facade: the layers are in :mod:`syncbn.modules.batchnorm`, the activated ones (``inplace_abn``'s) in :mod:`syncbn.modules.inplace_abn`, the converters in
:mod:`syncbn.modules.conversion`, the fusion pass in :mod:`syncbn.modules.fusion`, the statistics' recomputation
in :mod:`syncbn.modules.population`, timm's batch norm + activation layers in :mod:`syncbn.modules.timm_layers`; none of them imports this
module.
"""
from . import batchnorm
from .batchnorm import (
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    SyncBatchNorm,
    SyncBatchNorm1d,
    SyncBatchNorm2d,
    SyncBatchNorm3d,
    consecutive_rank_groups,
)
from . import inplace_abn
from .inplace_abn import ABN, InPlaceABN, InPlaceABNSync
from .conversion import convert_sync_batchnorm, freeze_batchnorm, revert_sync_batchnorm
from .fusion import InPlaceConversion, convert_inplace_abn, fuse_bn_act
from .population import update_bn
from .timm_layers import SyncBatchNormAct2d

__all__ = [*batchnorm.__all__, *inplace_abn.__all__, "InPlaceConversion", "SyncBatchNormAct2d", "convert_inplace_abn", "convert_sync_batchnorm", "freeze_batchnorm", "fuse_bn_act", "revert_sync_batchnorm", "update_bn"]
