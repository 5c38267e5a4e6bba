"""Which kernels serve the ``torch.ops.syncbn`` operators (:mod:`functions.ops`) on each device.

The dispatcher picks the kernel by the tensors' device; this module decides what is registered:

- CPU: the compiled kernels (``src/cpu``, built into ``functions/_C_<capability>`` by
  ``setup.py``), the best build for an instruction set that this CPU has; importing it registers
  them. Where none is built, the pure-PyTorch reference serves (with one warning).
- CUDA: by default torch's own SyncBN CUDA ops serve the elementwise and backward operators
  (registered here for the CUDA key), the reference the rest; our CUDA kernels (``src/cuda``,
  built into ``functions/_C_cuda`` where torch is a CUDA build and a toolkit is found) are loaded
  and registered only with ``SYNCBN_CUDA_KERNELS=compiled`` (opt-in until they have passed the
  suite on a GPU).
- ``SYNCBN_KERNELS=reference`` loads nothing and registers nothing: the reference serves every
  device (to debug, or to test it).
"""
from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

import torch

from . import ops, reference

# Instruction sets the CPU kernels may be built for, weakest first (see setup.py).
CPU_CAPABILITIES = ("DEFAULT", "AVX2", "AVX512")
FORCE_REFERENCE = os.environ.get("SYNCBN_KERNELS", "").lower() == "reference"
BUILD_HINT = "build them with `./make_ext.sh` or `pip install --no-build-isolation -e .`"
CUDA_OPT_IN = os.environ.get("SYNCBN_CUDA_KERNELS", "").lower() == "compiled"
CUDA_BUILD_HINT = (
    "build them where torch is a CUDA build and the CUDA toolkit (nvcc, CUDA_HOME) is installed, "
    "with `./make_ext.sh` or `pip install --no-build-isolation -e .`"
)


# torch's CUDA ops reshape to (N, C, -1), which fails on an empty batch (torch's own SyncBN
# guards them the same way).


def _torch_cuda_elemt_forward(x, mean, invstd, weight, bias, residual=None, negative_slope=None):
    if residual is not None or negative_slope is not None:  # torch has no fused op for these
        return reference.elemt_forward(x, mean, invstd, weight, bias, residual, negative_slope)
    if x.numel() == 0:
        return torch.empty_like(x)
    return torch.batch_norm_elemt(x, weight, bias, mean, invstd, 0.0)


def _torch_cuda_backward_reduce(dy, x, mean):
    if x.numel() == 0:
        return torch.zeros_like(mean), torch.zeros_like(mean)
    # invstd only scales grad_weight, which is not asked for here.
    ones = torch.ones_like(mean)
    sum_dy, sum_dy_xmu, _, _ = torch.batch_norm_backward_reduce(
        dy, x, mean, ones, None, True, False, False
    )
    return sum_dy, sum_dy_xmu


def _torch_cuda_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    if x.numel() == 0:
        return torch.empty_like(x)
    if weight is not None and weight.dtype != mean.dtype:
        weight = weight.to(mean.dtype)
    counts = torch.tensor([count], dtype=torch.int32, device=x.device)
    return torch.batch_norm_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, counts)


TORCH_CUDA_OPS = {
    "elemt_forward": _torch_cuda_elemt_forward,
    "backward_reduce": _torch_cuda_backward_reduce,
    "backward_elemt": _torch_cuda_backward_elemt,
}
"""torch's SyncBN CUDA ops, as kernels of our operators (the reference serves the others)."""


def usable_cpu_capabilities() -> list[str]:
    """The instruction sets this CPU runs (as torch sees it), best first."""
    runtime = torch.backends.cpu.get_cpu_capability().upper()
    known = CPU_CAPABILITIES.index(runtime) if runtime in CPU_CAPABILITIES else 0
    return list(reversed(CPU_CAPABILITIES[: known + 1]))


def load_compiled() -> ModuleType | None:
    """The compiled extension built for the best instruction set this CPU has, or None with one
    warning that says why and how to build it."""
    if FORCE_REFERENCE:
        return None
    tried = []
    for capability in usable_cpu_capabilities():
        name = f"_C_{capability.lower()}"
        try:
            return importlib.import_module(f".{name}", __package__)
        except ImportError as error:
            tried.append(f"{name}: {error}")
    warnings.warn(
        "syncbn: no compiled kernels for this CPU (" + "; ".join(tried) + "); the pure-PyTorch "
        f"reference kernels serve every device, which is slower: {BUILD_HINT}",
        RuntimeWarning,
        stacklevel=2,
    )
    return None


def load_compiled_cuda() -> ModuleType | None:
    """The compiled CUDA extension ``functions._C_cuda``, or None where it was not built (or
    ``SYNCBN_KERNELS=reference``). Silent unless ``SYNCBN_CUDA_KERNELS=compiled`` asks for it: then
    one warning says that torch's CUDA ops serve instead, and how to build."""
    if FORCE_REFERENCE:
        return None
    try:
        return importlib.import_module("._C_cuda", __package__)
    except ImportError as error:
        if CUDA_OPT_IN:
            warnings.warn(
                f"syncbn: SYNCBN_CUDA_KERNELS=compiled, but the compiled CUDA kernels are missing "
                f"({error}); torch's CUDA ops serve CUDA tensors: {CUDA_BUILD_HINT}",
                RuntimeWarning,
                stacklevel=2,
            )
        return None


def register_torch_cuda_ops() -> torch.library.Library:
    """Registers :data:`TORCH_CUDA_OPS` for the CUDA key; returns the library that holds them."""
    library = torch.library.Library(ops.NAMESPACE, "IMPL")
    for name, kernel in TORCH_CUDA_OPS.items():
        library.impl(name, kernel, "CUDA")
    return library


COMPILED = load_compiled()
COMPILED_CUDA = load_compiled_cuda() if CUDA_OPT_IN else None
_TORCH_CUDA_LIBRARY = None if FORCE_REFERENCE or COMPILED_CUDA is not None else register_torch_cuda_ops()

_BACKEND_NAMES = {
    "cpu": "reference" if COMPILED is None else f"compiled-cpu-{COMPILED.capability.lower()}",
    "cuda": "reference" if FORCE_REFERENCE else "torch-cuda-ops" if COMPILED_CUDA is None else "compiled-cuda",
}


def backend_name(device: torch.device) -> str:
    """Which kernels serve the operators on ``device``: ``compiled-cpu-<isa>``, ``compiled-cuda``,
    ``torch-cuda-ops`` or ``reference``."""
    return _BACKEND_NAMES.get(device.type, "reference")


def serves_single_device(device: torch.device) -> bool:
    """Whether our kernels beat torch's own batch norm on ``device``, so that they also serve a
    lone replica in training (measured: ``benchmarks/RESULTS.md``). Only the compiled CPU
    kernels do; the CUDA kernels have not run on a GPU yet, so cuDNN serves a lone CUDA replica."""
    return backend_name(device).startswith("compiled-cpu")


def backend_info() -> dict[str, str]:
    """Which backend serves which device type, e.g. ``{'cpu': 'compiled-cpu-avx2', 'cuda':
    'torch-cuda-ops'}`` (CUDA is listed whether or not a GPU is visible)."""
    return {t: backend_name(torch.device(t)) for t in ("cpu", "cuda")}
