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
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
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
            sys.meta_path.insert(0, _DynamoImport())
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
    """Finds nothing itself: wraps the loader of ``torch._dynamo`` so that, once its module has
    run, the waiting decorations are applied (and this finder leaves ``sys.meta_path``)."""

    running = False

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != _DYNAMO:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        run_module = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            _DynamoImport.running = True
            try:
                run_module(module)
            finally:
                _DynamoImport.running = False
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _apply()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
