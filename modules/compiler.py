"""``torch.compiler.disable`` for the layers' eager-only paths, without importing the compiler.

``@torch.compiler.disable`` imports ``torch._dynamo`` (and with it ``torch._inductor``,
``torch.distributed.nn`` and much of ``torch._functorch``) when the class is defined: a second
on every import of the library, and, where that import comes after
``dist.init_process_group``, torch keeps the default group alive past
``destroy_process_group`` (module-level defaults capture ``group.WORLD``), which can abort the
process at exit under Gloo. Dynamo only matters once something compiles, and whatever compiles
imports ``torch._dynamo`` first: :func:`disable_when_compiling` applies the decorator then (at
once where it is already imported), so the eager call costs nothing and the compiler sees
exactly what the decorator gives it.

The hook is a finder first in ``sys.meta_path``, which asks the others for ``torch._dynamo`` and
wraps the loader they give. An import hook put ahead of it later that answers for
``torch._dynamo`` itself would bypass it: there, import ``torch._dynamo`` before this library.
"""
from __future__ import annotations

import importlib.abc
import sys
import threading
import warnings
from types import ModuleType
from typing import Any

_DYNAMO = "torch._dynamo"
_waiting: list[tuple[Any, str]] = []
_lock = threading.Lock()


def disable_when_compiling(owner: Any, name: str) -> None:
    """``owner.name = torch.compiler.disable(owner.name)`` as soon as ``torch._dynamo`` is
    imported (now, if it is). ``owner`` is a class or a module."""
    with _lock:
        _waiting.append((owner, name))
        loaded = _DYNAMO in sys.modules and not _DynamoImport.running
        if not loaded and not any(isinstance(f, _DynamoImport) for f in sys.meta_path):
            sys.meta_path = [_DynamoImport(), *sys.meta_path]  # a new list: importers may be iterating the old
    if loaded:
        _apply()


def _apply() -> None:
    import torch

    with _lock:
        pending = list(_waiting)
        _waiting.clear()
    for owner, name in pending:
        setattr(owner, name, torch.compiler.disable(getattr(owner, name)))


class _DynamoImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asks the finders after it for ``torch._dynamo`` and wraps the
    loader they give, so that once its module has run, the waiting decorations are applied (and
    this finder leaves ``sys.meta_path``)."""

    running = False

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != _DYNAMO:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None:
            spec.loader = _ThenDecorate(spec.loader, self)
        return spec


class _ThenDecorate:
    """A loader that runs ``loader``'s module, then applies the waiting decorations (a wrapper,
    not a patched loader: loaders may be shared between modules)."""

    def __init__(self, loader: Any, finder: _DynamoImport) -> None:
        self._loader, self._finder = loader, finder

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        _DynamoImport.running = True
        try:
            self._loader.exec_module(module)
        finally:
            _DynamoImport.running = False
        sys.meta_path = [f for f in sys.meta_path if f is not self._finder]
        try:
            _apply()
        except Exception as error:  # torch._dynamo itself imported fine: do not fail its import
            warnings.warn(
                f"syncbn: could not mark the eager-only paths for torch.compile ({error!r}); compiling "
                "a synchronized model may fail to trace them",
                RuntimeWarning,
                stacklevel=2,
            )
