"""The library's two packages by their repository names, ``modules`` and ``functions``, as aliases
of ``syncbn.modules`` and ``syncbn.functions``: the very same module objects (one class of each
layer, one registry of operators, one round tracker per layer), never a second copy.

- In the repository, ``from modules import nn`` (``test.py``, the tests) finds the directory
  ``modules/``, whose ``__init__`` hands over to ``syncbn.modules`` (:func:`alias_top_level`).
- Installed, nothing named ``modules`` or ``functions`` lands in site-packages: a user's own
  packages of those names are theirs. Pickles and checkpoints made before the library was named
  ``syncbn`` name our classes ``modules.nn.SyncBatchNorm2d`` and so on: once ``syncbn`` is
  imported, such names resolve to ours where nothing else provides a top-level ``modules`` or
  ``functions`` (a finder consulted after every other, :func:`install`).
- Either way, ``modules.<sub>`` and ``functions.<sub>`` are ``syncbn.modules.<sub>`` and
  ``syncbn.functions.<sub>`` once the top-level name is ours (a finder consulted first).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

PACKAGES = {"modules": "syncbn.modules", "functions": "syncbn.functions"}
"""The repository's names and the installed ones."""


def canonical_name(name: str) -> str | None:
    """``syncbn.<name>`` for a name under ``modules`` or ``functions``, else None."""
    top, dot, rest = name.partition(".")
    return PACKAGES[top] + dot + rest if top in PACKAGES else None


def alias_top_level(name: str) -> ModuleType:
    """Make ``name`` (``modules`` or ``functions``) the canonical package in ``sys.modules``, and
    return it: called by the packages' ``__init__`` when imported by the repository's name."""
    module = importlib.import_module(PACKAGES[name])
    sys.modules[name] = module
    return module


class _Alias(importlib.abc.Loader):
    """Loads a name as the module another name already is."""

    def __init__(self, canonical: str) -> None:
        self.canonical = canonical

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.canonical)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the canonical module ran already


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the repository's names as aliases: submodules of an aliased package (first on the
    meta path), or, as the last resort, the top-level packages themselves (for old pickles)."""

    def __init__(self, top_level: bool) -> None:
        self.top_level = top_level

    def find_spec(self, name, path=None, target=None):
        canonical = canonical_name(name)
        if canonical is None or ("." in name) == self.top_level:
            return None
        if not self.top_level and sys.modules.get(name.partition(".")[0]) is not sys.modules.get(PACKAGES[name.partition(".")[0]]):
            return None  # a top-level package of that name that is not ours
        if importlib.util.find_spec(canonical) is None:
            return None
        return importlib.machinery.ModuleSpec(name, _Alias(canonical))


_SUBMODULES, _LAST_RESORT = _Finder(top_level=False), _Finder(top_level=True)


def install() -> None:
    """Put the finders on the meta path (once)."""
    if _SUBMODULES not in sys.meta_path:
        sys.meta_path.insert(0, _SUBMODULES)
    if _LAST_RESORT not in sys.meta_path:
        sys.meta_path.append(_LAST_RESORT)
