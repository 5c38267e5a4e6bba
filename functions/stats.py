"""What one replica (or one process) contributes to a synchronized layer's statistics."""
from __future__ import annotations

from dataclasses import dataclass, field

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
    ready: object = field(default=None, compare=False, repr=False)
    """A CUDA event after the work that produced mean and m2 (:func:`functions.devices.mark_ready`), or None."""
