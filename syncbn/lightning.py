"""``SyncBatchNormPlugin``: a Lightning ``LayerSync`` plug-in that makes a model's batch norms ours
for a fit (needs Lightning). Defined in :mod:`syncbn.modules.lightning`."""
from .modules.lightning import SyncBatchNormPlugin

__all__ = ["SyncBatchNormPlugin"]
