"""functions.devices on the CPU (its pinned copy to a GPU is tested in tests/test_cuda_layers.py)."""
from __future__ import annotations

import torch

from syncbn.functions import devices


def test_counts_stay_exact_beyond_float32() -> None:
    # a channel of a (4096, C, 224, 224) batch holds 205_520_896 values, past float32's 2**24:
    # the counts that weight Chan's merge must be exact
    counts = [205_520_897, 2**24 + 1, 0]
    on_cpu = devices.host_values_on(counts, "cpu")
    assert on_cpu.dtype == torch.float64 and [int(c) for c in on_cpu.tolist()] == counts
    assert devices.host_values_on(counts, "cpu", torch.float32).tolist() != counts  # why float64 is the default


def test_a_tensor_already_on_the_device_is_not_copied() -> None:
    x = torch.randn(4, dtype=torch.float64)
    assert devices.fetch(x, "cpu") is x and devices.fetch(x, torch.device("cpu")) is x
