"""The CUDA toolkit that setup.py builds the CUDA kernels with, and the checks that skip a CUDA
build that cannot succeed before anything is compiled.

The toolkit is ``CUDA_HOME`` or ``CUDA_PATH``, else the real location of ``nvcc`` on the PATH
(through symbolic links and ``exec`` wrapper scripts such as ``/usr/local/bin/nvcc``). The
architectures are ``TORCH_CUDA_ARCH_LIST``, else the visible GPUs', else ``DEFAULT_CUDA_ARCHS``.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

import torch

DEFAULT_CUDA_ARCHS = "7.5;8.0;8.7;9.0+PTX"
"""Turing to Hopper and Jetson Orin (8.7); CUDA 13 has no sm_70."""


@dataclass(frozen=True)
class Toolkit:
    """A CUDA toolkit: its root, and how it was found (said in the build log)."""

    home: str
    found_by: str

    @property
    def nvcc(self) -> str:
        """The toolkit's own nvcc."""
        return os.path.join(self.home, "bin", "nvcc")

    def runtime_library_dir(self) -> str | None:
        """Where torch's build will look for libcudart (lib64, else lib), if it is there."""
        for name in ("lib64", "lib"):
            directory = os.path.join(self.home, name)
            if glob.glob(os.path.join(directory, "libcudart.so*")) or glob.glob(os.path.join(directory, "cudart.lib")):
                return directory
        return None


def wrapped_nvcc(script: str) -> str | None:
    """The other nvcc that the wrapper script at ``script`` names, or None (a binary, or none named)."""
    try:
        with open(script, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    named = [p.decode() for p in re.findall(rb"(/[^\s'\";]*/nvcc)(?![\w.-])", head)]
    targets = [os.path.realpath(p) for p in named if os.path.exists(p)]
    return next((t for t in targets if t != script), None)


def real_nvcc(path: str) -> str:
    """The nvcc binary behind ``path``: symbolic links followed, and a shell wrapper script that
    ``exec``s (or names) another nvcc followed to it."""
    seen = set()
    path = os.path.realpath(path)
    while path not in seen:
        seen.add(path)
        target = wrapped_nvcc(path)
        if target is None:
            return path
        path = target
    return path


def find_toolkit() -> Toolkit | None:
    """CUDA_HOME or CUDA_PATH, else the toolkit of the real nvcc on the PATH, else None."""
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(variable)
        if home:
            return Toolkit(os.path.realpath(home), f"${variable}")
    on_path = shutil.which("nvcc")
    if on_path is None:
        return None
    nvcc = real_nvcc(on_path)
    found_by = f"nvcc on the PATH: {on_path}" + (f" -> {nvcc}" if nvcc != on_path else "")
    return Toolkit(os.path.dirname(os.path.dirname(nvcc)), found_by)


def cuda_arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST, else the visible GPUs' architectures, else DEFAULT_CUDA_ARCHS."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    if torch.cuda.is_available():
        capabilities = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        return ";".join(f"{major}.{minor}" for major, minor in capabilities)
    return DEFAULT_CUDA_ARCHS


def nvcc_output(toolkit: Toolkit, flag: str) -> str | None:
    """What the toolkit's nvcc prints for ``flag``, or None where it cannot run."""
    try:
        return subprocess.run([toolkit.nvcc, flag], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def unsupported_archs(toolkit: Toolkit, archs: str) -> list[str]:
    """Entries of ``archs`` (``7.5;8.0;8.7;9.0+PTX``) that this toolkit's nvcc cannot build for."""
    listed = nvcc_output(toolkit, "--list-gpu-arch")
    # an old nvcc without the flag lists nothing: the compiler then says what it lacks
    supported = set(re.findall(r"compute_(\d+)", listed or ""))
    wanted = [a for a in re.split(r"[;\s,]+", archs) if a]
    return [a for a in wanted if supported and a.split("+")[0].replace(".", "") not in supported]


def nvcc_release(toolkit: Toolkit) -> tuple[int, int] | None:
    """(major, minor) of the toolkit's nvcc, or None where it does not say."""
    found = re.search(r"release (\d+)\.(\d+)", nvcc_output(toolkit, "--version") or "")
    return (int(found.group(1)), int(found.group(2))) if found else None


def toolkit_blocker(toolkit: Toolkit) -> str | None:
    """Why this toolkit cannot build for torch's CUDA (no nvcc, no libcudart, another major
    version), or None."""
    where = f"{toolkit.home} ({toolkit.found_by})"
    if not os.path.exists(toolkit.nvcc):
        return f"no nvcc in the CUDA toolkit {where}"
    if toolkit.runtime_library_dir() is None:
        return f"the CUDA toolkit {where} has no runtime library (libcudart) in lib64 or lib"
    release = nvcc_release(toolkit)
    if release is not None and str(release[0]) != torch.version.cuda.split(".")[0]:
        return (
            f"nvcc {release[0]}.{release[1]} of {where} does not match the CUDA {torch.version.cuda} "
            f"of torch {torch.__version__} (their major versions must agree)"
        )
    return None


def cuda_blocker(toolkit: Toolkit | None) -> str | None:
    """Why the CUDA kernels cannot be built here (checked before compiling), or None."""
    if not torch.version.cuda:
        return f"torch {torch.__version__} is not a CUDA build"
    if toolkit is None:
        return "no CUDA toolkit found (set CUDA_HOME, or put nvcc on the PATH)"
    blocker = toolkit_blocker(toolkit)
    if blocker is not None:
        return blocker
    archs = cuda_arch_list()
    unsupported = unsupported_archs(toolkit, archs)
    if unsupported:
        return f"nvcc of {toolkit.home} cannot build for {', '.join(unsupported)} (TORCH_CUDA_ARCH_LIST={archs})"
    return None
