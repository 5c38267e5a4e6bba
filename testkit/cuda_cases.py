"""What the test files that need a GPU share (``tests/test_cuda_kernels.py``, ``test_cuda_layers.py``,
``test_cuda_graphs.py``, ``test_cuda_failures.py``): the skip of a whole file where
``torch.cuda.is_available()`` is false, the device, and the fixture that skips where replicas cannot
meet (the compiled module not loaded)."""
from __future__ import annotations

import pytest
import torch

from syncbn.functions.operators import backend

NEEDS_GPU = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA is not available: these tests need a GPU"
)
"""Every CUDA test file's ``pytestmark``."""


DEVICE = "cuda"


@pytest.fixture
def native_rounds() -> None:
    """The replicas meet natively (src/sync_batch_norm.cpp: device-generic events and
    record_stream), where the compiled module is loaded."""
    if backend.NATIVE_ROUNDS is None:
        pytest.skip("the compiled module is not loaded: replicas cannot meet")
