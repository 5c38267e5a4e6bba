"""Moving per-channel statistics between the devices of one process's replicas (DataParallel
on GPUs) in stream order, without host synchronization.

Two facts of torch's CUDA copies decide how:

- ``Tensor.to(other_cuda_device)`` runs on the *calling thread's* current stream of the source
  device and waits for the destination's current stream; it never blocks the host. Replicas run
  in their own threads, each possibly with its own current streams (``parallel_apply`` enters
  the stream its caller had current; a user may enter others), so a tensor produced on one
  thread's stream and copied by another thread must be fenced: the producer records an event
  (:func:`mark_ready`), the copier makes its stream on the source device wait for it
  (:func:`fetch`). With every thread on the devices' default streams the event is redundant but
  free (no host wait).
- ``torch.tensor(list_of_counts, device="cuda")`` copies from pageable host memory, which waits
  for the device's stream to drain: a host synchronization in the middle of the forward.
  :func:`counts_on` copies from pinned memory with ``non_blocking=True`` instead.

On CPU tensors every function here is a plain ``.to``/``torch.tensor``.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def mark_ready(tensor: Tensor) -> "torch.cuda.Event | None":
    """An event recorded on the current stream of ``tensor``'s device, after the work that
    produced it (None for CPU tensors): pass it to :func:`fetch` on the thread that copies."""
    if tensor.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


def fetch(tensor: Tensor, device: torch.device | str, ready: "torch.cuda.Event | None" = None) -> Tensor:
    """``tensor`` on ``device``: a peer copy (non-blocking for the host) that starts after
    ``ready`` (from :func:`mark_ready` on the producing thread); ``tensor`` itself when it is
    already there."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if tensor.device == device:
        return tensor
    if ready is not None and tensor.device.type == "cuda":
        torch.cuda.current_stream(tensor.device).wait_event(ready)
    return tensor.to(device, non_blocking=True)


def counts_on(counts: Sequence[int], device: torch.device | str, dtype: torch.dtype = torch.float64) -> Tensor:
    """The replicas' counts as a ``(R,)`` tensor on ``device``, copied from pinned host memory
    without waiting for the device (the pinned block is kept until the copy has run by torch's
    caching host allocator)."""
    host = torch.tensor(list(counts), dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
