"""Counting what the layers send through ``torch.distributed``."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch.distributed as dist
from torch import Tensor

_COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "all_gather", "all_reduce", "broadcast", "all_gather_object")


@contextmanager
def count_collectives() -> Iterator[dict[str, list[int]]]:
    """Count the collectives that Python code runs through ``torch.distributed`` while the
    block runs: ``{name: [elements sent by this rank, per call]}``. Diagnostics for tests and
    benchmarks (DDP's gradient buckets run in C++ and are not seen)."""
    counts: dict[str, list[int]] = {}
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def counting(name: str, original: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            sent = args[1] if name.startswith("all_gather") and name != "all_gather_object" else args[0]
            counts.setdefault(name, []).append(sent.numel() if isinstance(sent, Tensor) else -1)
            return original(*args, **kwargs)

        return wrapper

    for name, original in originals.items():
        setattr(dist, name, counting(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
