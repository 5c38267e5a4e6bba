"""syncbn: synchronized batch normalization for PyTorch.

``from syncbn import nn as NN`` gives the layers (``NN.BatchNorm2d``, ``NN.SyncBatchNorm2d``, the
activated ``NN.ABN``/``NN.InPlaceABN``/``NN.InPlaceABNSync``), the converters
(``NN.convert_sync_batchnorm``, ``NN.convert_inplace_abn``, ``NN.revert_sync_batchnorm``),
``NN.freeze_batchnorm`` and ``NN.fuse_bn_act``; ``syncbn.parallel.ThreadedDataParallel`` runs
replicas in threads (CPU replicas, or GPUs without ``nn.DataParallel``); ``syncbn.parallel.join``
trains DDP on ranks with uneven numbers of batches; ``syncbn.functional``
holds the functional forms and autograd Functions; ``syncbn.backend_info()`` says which kernels
serve each device.

The library's code lives in two subpackages, ``syncbn.modules`` (the user API) and
``syncbn.functions`` (the math, the synchronization, the kernels' operators): in the repository
they are its ``modules/`` and ``functions/`` directories (pyproject.toml maps them; run from the
repository's root without an install, this package's path reaches them). Importing ``syncbn``
changes how no other name imports.
"""
from __future__ import annotations

import os

_HERE = os.path.dirname(os.path.abspath(__file__))
if not os.path.isdir(os.path.join(_HERE, "modules")):
    # the repository (or an editable install of it): the two subpackages are its directories
    __path__.append(os.path.dirname(_HERE))  # type: ignore[name-defined]  # noqa: F821

from importlib import metadata as _metadata  # noqa: E402

from . import functional, nn, parallel  # noqa: E402
from .functions import backend_info  # noqa: E402

try:
    __version__ = _metadata.version("syncbn")
except _metadata.PackageNotFoundError:  # the repository on the path, not installed
    __version__ = "0+unknown"

__all__ = ["__version__", "backend_info", "functional", "nn", "parallel"]
