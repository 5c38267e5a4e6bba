"""The backend seam: which kernels serve the batch-norm operations on a device.

A backend is a :class:`Kernels` record of callables with the signatures of
:mod:`functions.reference`. CPU tensors go to the compiled kernels (``src/cpu``, built into
``functions/_C_<capability>`` by ``setup.py``) where they are built for an instruction set that
this CPU has, else to the pure-PyTorch reference (with one warning). On CUDA tensors the
elementwise and backward operations go to PyTorch's own SyncBN CUDA ops by default; our CUDA kernels
(``src/cuda``, built into ``functions/_C_cuda`` where torch is a CUDA build and a toolkit is found)
serve them only with ``SYNCBN_CUDA_KERNELS=compiled`` in the environment (opt-in until they have
passed the suite on a GPU). ``SYNCBN_KERNELS=reference`` in the environment forces the reference
everywhere (to debug, or to test it).
"""
from __future__ import annotations

import importlib
import os
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch
from torch import Tensor

from . import reference

# Instruction sets the CPU kernels may be built for, weakest first (see setup.py).
CPU_CAPABILITIES = ("DEFAULT", "AVX2", "AVX512")
FORCE_REFERENCE = os.environ.get("SYNCBN_KERNELS", "").lower() == "reference"
BUILD_HINT = "build them with `./make_ext.sh` or `pip install --no-build-isolation -e .`"
CUDA_OPT_IN = os.environ.get("SYNCBN_CUDA_KERNELS", "").lower() == "compiled"
CUDA_BUILD_HINT = (
    "build them where torch is a CUDA build and the CUDA toolkit (nvcc, CUDA_HOME) is installed, "
    "with `./make_ext.sh` or `pip install --no-build-isolation -e .`"
)


@dataclass(frozen=True)
class Kernels:
    """The operations of a synchronized batch norm, as served by one backend."""

    name: str
    local_stats: Callable[[Tensor], tuple[int, Tensor, Tensor]]
    merge_stats: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    elemt_forward: Callable[..., Tensor]
    backward_reduce: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    backward_elemt: Callable[..., Tensor]
    backward_affine_act: Callable[..., tuple]
    serves_single_device: bool = False
    """Faster than torch's own batch norm, so it also serves a lone replica in training."""


REFERENCE = Kernels(
    name="reference",
    local_stats=reference.local_stats,
    merge_stats=reference.merge_stats,
    elemt_forward=reference.elemt_forward,
    backward_reduce=reference.backward_reduce,
    backward_elemt=reference.backward_elemt,
    backward_affine_act=reference.backward_affine_act,
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


TORCH_CUDA = Kernels(
    name="torch-cuda-ops",
    local_stats=reference.local_stats,
    merge_stats=reference.merge_stats,
    elemt_forward=_torch_cuda_elemt_forward,
    backward_reduce=_torch_cuda_backward_reduce,
    backward_elemt=_torch_cuda_backward_elemt,
    backward_affine_act=reference.backward_affine_act,
)



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


def compiled_kernels(ops: ModuleType, name: str, serves_single_device: bool = True) -> Kernels:
    """A :class:`Kernels` record of one device's (sub)module of a compiled extension."""
    return Kernels(
        name=name,
        serves_single_device=serves_single_device,
        local_stats=ops.local_stats,
        merge_stats=ops.merge_stats,
        elemt_forward=ops.elemt_forward,
        backward_reduce=ops.backward_reduce,
        backward_elemt=ops.backward_elemt,
        backward_affine_act=ops.backward_affine_act,
    )


COMPILED = load_compiled()
COMPILED_CUDA = load_compiled_cuda()
# Not yet verified on a GPU: opt-in, and not for a lone replica (cuDNN serves it).
COMPILED_CUDA_KERNELS = None if COMPILED_CUDA is None else compiled_kernels(COMPILED_CUDA, "compiled-cuda", False)

_BY_DEVICE_TYPE: dict[str, Kernels] = {} if FORCE_REFERENCE else {"cuda": TORCH_CUDA}
if CUDA_OPT_IN and COMPILED_CUDA_KERNELS is not None:
    _BY_DEVICE_TYPE["cuda"] = COMPILED_CUDA_KERNELS
if COMPILED is not None:
    _BY_DEVICE_TYPE["cpu"] = compiled_kernels(COMPILED.cpu, f"compiled-cpu-{COMPILED.cpu.capability.lower()}")


def kernels_for(device: torch.device) -> Kernels:
    """The kernels that serve tensors on ``device``."""
    return _BY_DEVICE_TYPE.get(device.type, REFERENCE)


def backend_info() -> dict[str, str]:
    """Which backend serves which device type, e.g. ``{'cpu': 'compiled-cpu-avx2', 'cuda':
    'torch-cuda-ops'}`` (CUDA is listed whether or not a GPU is visible)."""
    return {t: kernels_for(torch.device(t)).name for t in ("cpu", "cuda")}
