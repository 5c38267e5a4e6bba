"""Catching host synchronizations without a GPU: the calls that would make one on CUDA, recorded
while CPU tensors stand in for CUDA ones.

On CUDA, a host read of a device value (``item``, ``tolist``, ``bool(t)``, ``int(t)``, ``numpy``,
a copy to the CPU) waits for the device's stream to drain, and so does ``torch.tensor(data,
device=...)`` (a copy from pageable host memory). The same Python calls made on CPU tensors cost
nothing, but they are the same calls: :class:`HostReads` records each one that Python code makes
while it is active (a ``TorchFunctionMode``, so every torch call from Python passes through it),
with where it came from. The library's one sanctioned reader of host memory, and its pinned
copies, are let through by :func:`allowed`.
"""
from __future__ import annotations

import threading
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

_READS = {
    Tensor.item: "item",
    Tensor.tolist: "tolist",
    Tensor.__bool__: "bool",
    Tensor.__int__: "int",
    Tensor.__float__: "float",
    Tensor.__index__: "index",
    Tensor.numpy: "numpy",
    Tensor.cpu: "cpu",
    torch.tensor: "torch.tensor (a pageable copy on CUDA)",
    torch.as_tensor: "torch.as_tensor (a pageable copy on CUDA)",
}

_suspended = threading.local()


class HostReads(TorchFunctionMode):
    """Records ``(what, where)`` for each host read while active, in :attr:`seen` (shared by
    the threads that enter the same instance: enter it in each, e.g. replica threads)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        what = _READS.get(func)
        if what is not None and not getattr(_suspended, "on", False):
            where = "".join(traceback.format_stack(limit=8)[:-1])
            with self._lock:
                self.seen.append((what, where))
        return func(*args, **(kwargs or {}))

    def report(self) -> str:
        return "\n".join(f"--- {what} at:\n{where}" for what, where in self.seen)


@contextmanager
def suspended() -> Iterator[None]:
    """Calls made in this block (this thread) are not recorded."""
    previous = getattr(_suspended, "on", False)
    _suspended.on = True
    try:
        yield
    finally:
        _suspended.on = previous


def allowed(function: Callable) -> Callable:
    """``function`` with its own calls unrecorded: for a reader that reads host memory only (a
    verdict already copied to pinned memory) or copies through pinned memory."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with suspended():
            return function(*args, **kwargs)

    return wrapper
