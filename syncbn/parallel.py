"""``ThreadedDataParallel``: ``nn.DataParallel`` on any list of devices, CPU included, with a
backward thread per replica. Defined in :mod:`syncbn.modules.parallel`."""
from .modules.parallel import ThreadedDataParallel

__all__ = ["ThreadedDataParallel"]
