"""Copies onto a device without a host synchronization.

:func:`fetch` copies between GPUs without blocking the host and keeps the source's memory until
the copying stream has run (``record_stream``: the caching allocator hands a freed block back to
its stream at once). ``torch.tensor(values, device="cuda")`` copies from pageable host memory, which waits for the
device's stream to drain: a host synchronization in the middle of the step.
:func:`host_values_on` copies from pinned memory with ``non_blocking=True`` instead. (Statistics
that cross the devices of one process's replicas are fenced and copied in stream order by the
native call, behind events: ``fetch`` in src/meeting.cpp.)
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def host_values_on(values: Sequence[float], device: torch.device | str, dtype: torch.dtype = torch.float64) -> Tensor:
    """Host numbers (the replicas' counts, a collective's header) as a 1-D tensor on ``device``,
    copied from pinned host memory without waiting for the device (torch's caching host
    allocator keeps the pinned block until the copy has run)."""
    host = torch.tensor(list(values), dtype=dtype)
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def fetch(tensor: Tensor, device: torch.device | str) -> Tensor:
    """``tensor`` on ``device``, copied on this thread's current streams (itself where it is
    there already); non-blocking for the host between GPUs."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if tensor.device == device:
        return tensor
    copy = tensor.to(device, non_blocking=device.type == "cuda")  # to the host: it reads it next
    if tensor.device.type == "cuda":
        tensor.record_stream(torch.cuda.current_stream(tensor.device))
    return copy
