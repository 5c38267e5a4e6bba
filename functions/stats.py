"""What one replica (or one process) contributes to a synchronized layer's statistics."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class LocalStats:
    """One replica's contribution: count, mean and M2 per channel, and what it was taken of."""

    count: int
    mean: Tensor
    m2: Tensor
    input_dtype: torch.dtype
    input_shape: torch.Size
