"""Installs the ``modules`` (user API) and ``functions`` (math and synchronization) packages and
builds the compiled kernels (``src/``) into ``functions/_C_<capability>`` as a torch cpp_extension.

The CPU kernels are always built, vectorized for the instruction set that the installed torch
uses on this machine (``torch.backends.cpu.get_cpu_capability()``: AVX512, AVX2 or the default
one, which is NEON on ARM), as ``functions/_C_<capability>``. Set ``SYNCBN_CPU_CAPABILITY`` to a
comma-separated list (``DEFAULT,AVX2,AVX512``) to build for other machines too: at import the
best one that the running CPU supports is loaded, so no unsupported instruction ever runs.
``CXX`` and ``MAX_JOBS`` are honoured as by every torch extension.

The CUDA kernels (``src/cuda``) are built as ``functions/_C_cuda`` only where torch is a CUDA
build (``torch.version.cuda``) and a CUDA toolkit is found (``CUDA_HOME``); elsewhere they are
skipped with one line on stderr. ``TORCH_CUDA_ARCH_LIST`` is honoured; without it, the visible
GPUs' architectures, else ``7.5;8.0;9.0+PTX`` (CUDA 13 has no sm_70). No ``--use_fast_math``:
the kernels rely on IEEE division, rounding and the sign of their results.

Build in place with ``./make_ext.sh``, or install with ``pip install --no-build-isolation .``
(torch must already be installed: the extension is built against it).
"""
from __future__ import annotations

import os
import sys
from glob import glob

from setuptools import setup

import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))

CPU_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "DEFAULT": [],
}


def cpu_capabilities() -> list[str]:
    """The instruction sets to build the CPU kernels for."""
    wanted = os.environ.get("SYNCBN_CPU_CAPABILITY") or torch.backends.cpu.get_cpu_capability()
    names = {name.strip().upper() for name in wanted.split(",") if name.strip()}
    unknown = names - CPU_CAPABILITY_FLAGS.keys()
    if unknown and os.environ.get("SYNCBN_CPU_CAPABILITY"):
        raise SystemExit(f"SYNCBN_CPU_CAPABILITY: unknown {sorted(unknown)}; use {sorted(CPU_CAPABILITY_FLAGS)}")
    return sorted((names & CPU_CAPABILITY_FLAGS.keys()) or {"DEFAULT"})


def openmp_flags() -> list[str]:
    """-fopenmp where torch runs at::parallel_for on OpenMP (Linux wheels): without it, ATen's
    headers compile at::parallel_for in the extension into a serial loop. The extension then
    uses the libgomp that torch loaded (same soname), so there is one OpenMP thread pool."""
    return ["-fopenmp"] if torch.backends.openmp.is_available() and sys.platform.startswith("linux") else []


def cpu_compile_args(capability: str) -> list[str]:
    macros = [] if capability == "DEFAULT" else [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    return ["-O3", *CPU_CAPABILITY_FLAGS[capability], *macros, *openmp_flags()]


def sources(*patterns: str) -> list[str]:
    """Source files relative to the repo (setuptools wants relative paths)."""
    return sorted(os.path.relpath(p, ROOT) for pattern in patterns for p in glob(os.path.join(ROOT, pattern)))


def extension(capability: str) -> CppExtension:
    return CppExtension(
        name=f"functions._C_{capability.lower()}",
        sources=sources("src/bindings.cpp", "src/train_forward.cpp", "src/cpu/*.cpp"),
        include_dirs=[os.path.join(ROOT, "src")],
        extra_compile_args={"cxx": cpu_compile_args(capability)},
        extra_link_args=openmp_flags(),
    )


DEFAULT_CUDA_ARCHS = "7.5;8.0;9.0+PTX"


def set_cuda_arch_list() -> None:
    """TORCH_CUDA_ARCH_LIST (read by torch's build) when not given: the architectures of the
    visible GPUs, else DEFAULT_CUDA_ARCHS."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return
    if torch.cuda.is_available():
        capabilities = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(f"{major}.{minor}" for major, minor in capabilities)
    else:
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCHS


def cuda_extensions() -> list[CUDAExtension]:
    """functions._C_cuda where torch is a CUDA build and a toolkit is found, else none."""
    if not torch.version.cuda or CUDA_HOME is None:
        why = "torch is not a CUDA build" if not torch.version.cuda else "no CUDA toolkit found (CUDA_HOME)"
        print(f"syncbn: not building the CUDA kernels: {why}", file=sys.stderr)
        return []
    set_cuda_arch_list()
    return [
        CUDAExtension(
            name="functions._C_cuda",
            sources=sources("src/cuda/*.cu", "src/cuda/bindings.cpp", "src/train_forward.cpp"),
            include_dirs=[os.path.join(ROOT, "src")],
            extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},
        )
    ]


setup(
    name="syncbn",
    version="0.1.0",
    description="Synchronized batch normalization for nn.DataParallel, threads, processes and one device",
    packages=["functions", "modules"],
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
    ext_modules=[*(extension(capability) for capability in cpu_capabilities()), *cuda_extensions()],
    cmdclass={"build_ext": BuildExtension},
)
