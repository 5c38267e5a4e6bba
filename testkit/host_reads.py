"""Catching host synchronizations without a GPU: the calls that would make one on CUDA, recorded
while CPU tensors stand in for CUDA ones.

On CUDA, a host read of a device value (``item``, ``tolist``, ``bool(t)``, ``int(t)``, ``numpy``,
``cpu()``, ``torch.equal``, ``nonzero`` and boolean-mask indexing ``t[mask]``, whose output size
the host must learn) waits for the device's stream to drain, and so does ``torch.tensor(data,
device=...)`` (a copy from pageable host memory). The same Python calls made on CPU tensors cost
nothing, but they are the same calls: while :class:`HostReads` is active, each one made from
Python in any thread (replica threads, autograd's backward, the Python kernels that the
dispatcher calls) is recorded with where it came from. The methods are patched on the classes
themselves, not through a torch function mode, which autograd does not carry into a backward.
The library's sanctioned readers of host memory, and its pinned copies, are let through by
:func:`allowed`. Not seen where CPU tensors stand in: ``.to("cpu")`` and ``copy_`` from a device
(a replica's device is the CPU too), mask assignment, ``masked_select`` as a method, the
one-argument ``torch.where``; the library uses none of them.
"""
from __future__ import annotations

import threading
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

_TENSOR_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero", "new_tensor")
_TORCH_READS = ("tensor", "as_tensor", "equal", "allclose", "nonzero", "masked_select", "unique")

_suspended = threading.local()


def _is_suspended() -> bool:
    return getattr(_suspended, "on", False)


def _mask_index(index: Any) -> bool:
    """Whether a ``__getitem__`` index holds a boolean tensor (its size is read on the host)."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, Tensor) and part.dtype == torch.bool for part in parts)


def _to_the_host(tensor: Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether ``tensor.to(*args, **kwargs)`` copies a device tensor to the CPU, blocking (only
    real device tensors tell: where CPU tensors stand in, a replica's device is the CPU too)."""
    device = kwargs.get("device", args[0] if args and isinstance(args[0], (str, torch.device)) else None)
    to_cpu = device is not None and torch.device(device).type == "cpu"
    return to_cpu and tensor.device.type != "cpu" and not kwargs.get("non_blocking", False)


class HostReads:
    """Records ``(what, where)`` for each host read while active (a context manager), in
    :attr:`seen`, from every thread."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._restore: list[tuple[object, str, object]] = []

    def _record(self, what: str) -> None:
        if _is_suspended():
            return
        where = "".join(traceback.format_stack(limit=9)[:-2])
        with self._lock:
            self.seen.append((what, where))

    def _patch(self, owner: object, name: str, when: Callable[..., bool] | None = None) -> None:
        original = getattr(owner, name)
        own = vars(owner).get(name) if isinstance(owner, type) else original

        def recording(*args: Any, **kwargs: Any) -> Any:
            if when is None or when(*args, **kwargs):
                self._record(f"{getattr(owner, '__name__', owner)}.{name}")
            return original(*args, **kwargs)

        self._restore.append((owner, name, own))
        setattr(owner, name, recording)

    def __enter__(self) -> "HostReads":
        for name in _TENSOR_READS:
            self._patch(Tensor, name)
        self._patch(Tensor, "__getitem__", lambda tensor, index: _mask_index(index))
        self._patch(Tensor, "to", lambda tensor, *args, **kwargs: _to_the_host(tensor, args, kwargs))
        for name in _TORCH_READS:
            self._patch(torch, name)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, own in reversed(self._restore):
            if own is None:
                delattr(owner, name)  # it was inherited
            else:
                setattr(owner, name, own)
        self._restore.clear()

    def report(self) -> str:
        return "\n".join(f"--- {what} at:\n{where}" for what, where in self.seen)


@contextmanager
def suspended() -> Iterator[None]:
    """Calls made in this block (this thread) are not recorded."""
    previous = _is_suspended()
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
