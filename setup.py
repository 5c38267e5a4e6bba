"""Installs the ``modules`` (user API) and ``functions`` (math and synchronization) packages and
builds the compiled kernels (``src/``) into ``functions/_C_<capability>`` as a torch cpp_extension.

The CPU kernels are always built, vectorized for the instruction set that the installed torch
uses on this machine (``torch.backends.cpu.get_cpu_capability()``: AVX512, AVX2 or the default
one, which is NEON on ARM), as ``functions/_C_<capability>``. Set ``SYNCBN_CPU_CAPABILITY`` to a
comma-separated list (``DEFAULT,AVX2,AVX512``) to build for other machines too: at import the
best one that the running CPU supports is loaded, so no unsupported instruction ever runs.
``CXX`` and ``MAX_JOBS`` are honoured as by every torch extension.

Build in place with ``./make_ext.sh``, or install with ``pip install --no-build-isolation .``
(torch must already be installed: the extension is built against it).
"""
from __future__ import annotations

import os
import sys
from glob import glob

from setuptools import setup

import torch
from torch.utils.cpp_extension import BuildExtension, CppExtension

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
        sources=sources("src/bindings.cpp", "src/cpu/*.cpp"),
        include_dirs=[os.path.join(ROOT, "src")],
        extra_compile_args={"cxx": cpu_compile_args(capability)},
        extra_link_args=openmp_flags(),
    )


setup(
    name="syncbn",
    version="0.1.0",
    description="Synchronized batch normalization for nn.DataParallel, threads, processes and one device",
    packages=["functions", "modules"],
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
    ext_modules=[extension(capability) for capability in cpu_capabilities()],
    cmdclass={"build_ext": BuildExtension},
)
