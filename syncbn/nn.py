"""The layers and the functions that convert, freeze and fuse a model's batch norms:
``from syncbn import nn as NN``; ``NN.BatchNorm2d(64)`` is ``NN.SyncBatchNorm2d(64)``. Defined in
:mod:`syncbn.modules.nn` (the repository's ``modules/nn.py``)."""
from .modules.nn import *  # noqa: F401,F403
from .modules.nn import __all__  # noqa: F401
