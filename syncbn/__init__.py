"""syncbn: synchronized batch normalization for PyTorch.

``from syncbn import nn as NN`` gives the layers (``NN.BatchNorm2d``, ``NN.SyncBatchNorm2d``, the
activated ``NN.ABN``/``NN.InPlaceABN``/``NN.InPlaceABNSync``), the converters
(``NN.convert_sync_batchnorm``, ``NN.convert_inplace_abn``, ``NN.revert_sync_batchnorm``),
``NN.freeze_batchnorm`` and ``NN.fuse_bn_act``; ``syncbn.parallel.ThreadedDataParallel`` runs
replicas in threads (CPU replicas, or GPUs without ``nn.DataParallel``); ``syncbn.functional``
holds the functional forms and autograd Functions; ``syncbn.backend_info()`` says which kernels
serve each device.

The library's code lives in two packages, ``syncbn.modules`` (the user API) and
``syncbn.functions`` (the math, the synchronization, the kernels' operators): in the repository
they are its ``modules/`` and ``functions/`` directories, which the repository's own scripts also
import by those names (``from modules import nn``, as ``test.py`` does): the same module objects
either way (:mod:`syncbn._legacy_names`).
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if not os.path.isdir(os.path.join(_HERE, "modules")):
    # the repository (or an editable install of it): the two packages are its directories
    __path__.append(os.path.dirname(_HERE))  # type: ignore[name-defined]  # noqa: F821

from . import _legacy_names  # noqa: E402
from .functions import backend_info  # noqa: E402
from .modules import nn, parallel  # noqa: E402
from . import functional  # noqa: E402

sys.modules[__name__ + ".nn"] = nn  # ``import syncbn.nn`` and ``syncbn.nn`` are the one module
sys.modules[__name__ + ".parallel"] = parallel
_legacy_names.install()

__all__ = ["backend_info", "functional", "nn", "parallel"]
