"""Moving per-channel statistics between the devices of one process's replicas (DataParallel
on GPUs) in stream order, without host synchronization.

Three facts of torch's CUDA copies and allocator decide how:

- ``Tensor.to(other_cuda_device)`` runs on the *calling thread's* current stream of the source
  device and waits for the destination's current stream; it never blocks the host. Replicas run
  in their own threads, each possibly with its own current streams (``parallel_apply`` enters
  the stream its caller had current; a user may enter others), so a tensor produced on one
  thread's stream and copied by another thread must be fenced: the producer records an event
  (:func:`mark_ready`), the copier makes its stream on the source device wait for it
  (:func:`fetch`). With every thread on the devices' default streams the event is redundant but
  free (no host wait).
- The caching allocator hands a freed block back to the stream it was made on, at once: when the
  producer drops a tensor that another stream still copies from, its memory could be reused
  before the copy has run. :func:`fetch` marks the source as used on the copying stream
  (``record_stream``), so the allocator waits for that stream first.
- ``torch.tensor(values, device="cuda")`` copies from pageable host memory, which waits for the
  device's stream to drain: a host synchronization in the middle of the step.
  :func:`host_values_on` copies from pinned memory with ``non_blocking=True`` instead.

On CPU tensors every function here is a plain ``.to``/``torch.tensor``. A copy to the CPU from a
GPU is a host synchronization by nature (the host reads it next): only mixed CPU and GPU
replicas make one.
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Sequence

import torch
from torch import Tensor


_NO_STREAM: ContextManager[None] = contextlib.nullcontext()


def on_stream(stream: "torch.cuda.Stream | None") -> ContextManager[Any]:
    """Work queued on ``stream`` (and its device current), or where it is when None (CPU, or
    the calling thread's own stream): how one thread runs another replica's part in that
    replica's stream order."""
    return _NO_STREAM if stream is None else torch.cuda.stream(stream)


def mark_ready(tensor: Tensor) -> "torch.cuda.Event | None":
    """An event recorded on the current stream of ``tensor``'s device, after the work that
    produced it (None for CPU tensors): pass it to :func:`fetch` on the thread that copies."""
    if tensor.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


def fetch(tensor: Tensor, device: torch.device | str, ready: "torch.cuda.Event | None" = None) -> Tensor:
    """``tensor`` on ``device``: a copy that starts after ``ready`` (from :func:`mark_ready` on
    the producing thread) and keeps the source's memory until it has run; non-blocking for the
    host between GPUs; ``tensor`` itself when it is already there, after ``ready`` on this
    thread's current stream (replicas on one GPU may run on different streams)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if tensor.device == device:
        if ready is not None:  # replicas on one GPU may run on different streams
            reading = torch.cuda.current_stream(device)
            reading.wait_event(ready)
            tensor.record_stream(reading)
        return tensor
    if tensor.device.type != "cuda":
        return tensor.to(device, non_blocking=device.type == "cuda")
    copying_stream = torch.cuda.current_stream(tensor.device)
    if ready is not None:
        copying_stream.wait_event(ready)
    copy = tensor.to(device, non_blocking=device.type == "cuda")  # to the host: it reads it next
    tensor.record_stream(copying_stream)
    return copy


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
