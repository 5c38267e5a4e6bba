"""functions.devices on CPU tensors (their CUDA behaviour is in tests/test_cuda.py): plain copies."""
from __future__ import annotations

import torch

from functions import devices


def test_cpu_tensors_move_as_plain_copies() -> None:
    x = torch.randn(4, dtype=torch.float64)
    assert devices.mark_ready(x) is None
    assert devices.fetch(x, "cpu") is x
    assert devices.fetch(x, torch.device("cpu"), None) is x
    counts = devices.counts_on([3, 0, 7], "cpu")
    assert counts.dtype == torch.float64 and counts.tolist() == [3.0, 0.0, 7.0]
