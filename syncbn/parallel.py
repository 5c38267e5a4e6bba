"""``ThreadedDataParallel``: ``nn.DataParallel`` on any list of devices, CPU included, with a
backward thread per replica (defined in :mod:`syncbn.modules.parallel`); ``join``: DDP training on
uneven inputs, a rank out of batches shadowing the others' steps (:mod:`syncbn.modules.join`)."""
from .modules.join import join
from .modules.parallel import ThreadedDataParallel

__all__ = ["ThreadedDataParallel", "join"]
