"""The layers in torch's tool chain: ``torch.compiler.disable`` for their eager-only paths, without
importing the compiler, and their node under torch.fx tracing.

Some paths must run eagerly under torch.compile (Dynamo cannot trace the replicas' threads and
rounds). ``@torch.compiler.disable`` on them would import ``torch._dynamo`` (and much of the
compiler stack) when the library is imported: slow, and where that import comes after
``dist.init_process_group``, torch keeps the default group alive past ``destroy_process_group``,
which can abort the process at exit under Gloo. :func:`disable_when_compiling` asks
``torch.compiler.is_compiling()`` at each call instead: an eager call runs the function itself, a
compiling one runs it as ``torch.compiler.disable`` would (a graph break, the function eager), and
only that imports ``torch._dynamo``.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..functions import torch_internals

_F = TypeVar("_F", bound=Callable[..., Any])


def disable_when_compiling(fn: _F) -> _F:
    """``fn`` in eager calls; ``torch.compiler.disable(fn)`` while compiling (torch.compile,
    torch.export), with ``torch._dynamo`` imported at the first such call."""
    disabled = torch_internals.lazy_dynamo_disable(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # Dynamo folds it to True while it traces
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


def record_fx_call(module: torch.nn.Module, input: torch.fx.Proxy, z: Any, mask: Any = None) -> torch.fx.Proxy:
    """A layer's call under torch.fx symbolic tracing: one ``call_module`` node, as for torch's
    batch norm (a leaf: rank checks and routing read values that a Proxy does not have)."""
    tracer = input.tracer
    args = (input,) if z is None else (input, z)
    return tracer.create_proxy("call_module", tracer.path_of_module(module), args, {} if mask is None else {"mask": mask})
