"""Builds the compiled kernels (``src/``) of ``syncbn.functions`` (the ``functions/`` directory) as
torch cpp_extensions; the project's metadata is in ``pyproject.toml``.

Two kinds of extension, built separately so that the CUDA one never takes the CPU one down:

- CPU kernels, always: ``functions/_C_<capability>``, vectorized for the instruction set that
  the installed torch uses on this machine (``torch.backends.cpu.get_cpu_capability()``: AVX512,
  AVX2 or the default one, which is NEON on ARM). ``SYNCBN_CPU_CAPABILITY`` (a comma-separated
  list, ``DEFAULT,AVX2,AVX512``) builds for other machines too: at import the best one that the
  running CPU supports is loaded, so no unsupported instruction ever runs.
- CUDA kernels, ``functions/_C_cuda``, where they can be built. ``SYNCBN_CUDA`` decides:
  unset (``auto``) builds them where torch is a CUDA build and a CUDA toolkit with its runtime
  library is found, skips them with one line otherwise, and when their build fails anyway (an
  unsupported architecture, a compiler or linker error) keeps the CPU kernels and says what
  failed in one paragraph; ``SYNCBN_CUDA=0`` skips them; ``SYNCBN_CUDA=1`` requires them (every
  failure is an error). ``TORCH_CUDA_ARCH_LIST`` is honoured. No ``--use_fast_math``: the
  kernels rely on IEEE division, rounding and the sign of their results.

Helpers in ``tools/``: ``cuda_toolkit.py``, ``cxx_runtime.py``, ``build_failure.py``. Build with
``./make_ext.sh`` or ``pip install --no-build-isolation -e .``, against the installed torch.
"""
import glob
import os
import sys
import time

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "tools"))  # the build's helpers, found first by their plain names

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # pip's build isolation: a fresh environment without the user's torch
    raise SystemExit(
        "syncbn: building the kernels needs the torch they will run with: install torch first "
        "(`pip install torch==2.13.0` for the CPU build, or your CUDA build), then install this "
        "project with `pip install --no-build-isolation -e .` (or `./make_ext.sh`)"
    ) from None

from build_failure import (captured_output, failure_note_paths, failure_paragraph, forget_failure_notes,
                           write_failure_note)
from cuda_toolkit import cuda_arch_list, cuda_blocker, find_toolkit
from cxx_runtime import cxx_runtime_link_args

CPU_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "DEFAULT": [],
}
CUDA_EXTENSION = "syncbn.functions._C_cuda"
PACKAGE_DIRS = {"syncbn.functions": "functions", "syncbn.modules": "modules"}  # pyproject.toml's package-dir


def say(message: str) -> None:
    print(f"syncbn: {message}", file=sys.stderr, flush=True)


GENERATED = os.path.join(ROOT, "build", "generated")


def write_build_identity() -> str:
    """``build/generated/built_with.h``: the torch the extensions are built against (version, git
    revision, C++ ABI), which the import compares with the torch it runs with; its include dir."""
    identity = f"{torch.__version__} ({torch.version.git_version}, cxx11abi={int(torch._C._GLIBCXX_USE_CXX11_ABI)})"
    os.makedirs(GENERATED, exist_ok=True)
    path = os.path.join(GENERATED, "built_with.h")
    text = f'#pragma once\n// written by setup.py\n#define SYNCBN_BUILT_WITH_TORCH "{identity}"\n'
    if not os.path.exists(path) or open(path).read() != text:  # unchanged: no rebuild
        with open(path, "w") as f:
            f.write(text)
    return GENERATED


def sources(*patterns: str) -> list[str]:
    """Source files relative to the repo (setuptools wants relative paths)."""
    return sorted(os.path.relpath(p, ROOT) for pattern in patterns for p in glob.glob(os.path.join(ROOT, pattern)))


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


def quiet_flags() -> list[str]:
    """Warnings of our code only: torch's headers (pybind11's among them) as system headers, whose
    warnings GCC leaves out; our symbols hidden (pybind11's own are, and a bound class must be
    too); and GCC 12's -Wmaybe-uninitialized, which its own intrinsic headers set off once inlined
    (``__Y = __Y`` in ``_mm512_undefined_*``), off."""
    return [*(f"-isystem{path}" for path in cpp_extension.include_paths()), "-fvisibility=hidden",
            "-Wno-maybe-uninitialized"]


def cpu_extension(capability: str) -> cpp_extension.CppExtension:
    macros = [] if capability == "DEFAULT" else [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    # -g0: Python's CFLAGS ask for -g, whose debug info would triple the objects and the link
    flags = ["-O3", "-g0", *CPU_CAPABILITY_FLAGS[capability], *macros, *openmp_flags(), *quiet_flags()]
    return cpp_extension.CppExtension(
        name=f"syncbn.functions._C_{capability.lower()}",
        sources=sources("src/bindings.cpp", "src/train_forward.cpp", "src/meeting.cpp", "src/sync_batch_norm.cpp",
                        "src/sync_batch_norm_python.cpp", "src/torch_cuda_ops.cpp", "src/cpu/*.cpp"),
        include_dirs=[os.path.join(ROOT, "src"), write_build_identity()],
        extra_compile_args={"cxx": flags},
        extra_link_args=[*openmp_flags(), *cxx_runtime_link_args()],
    )


def cuda_mode() -> str:
    """SYNCBN_CUDA: '0' (skip), '1' (require) or 'auto' (unset)."""
    mode = os.environ.get("SYNCBN_CUDA", "auto").strip().lower() or "auto"
    if mode not in ("0", "1", "auto"):
        raise SystemExit(f"SYNCBN_CUDA must be 0, 1 or unset, got {mode!r}")
    return mode


def cuda_extensions() -> list[cpp_extension.CUDAExtension]:
    """functions._C_cuda where SYNCBN_CUDA and the checks before compiling allow it."""
    mode = cuda_mode()
    if mode != "1":  # no note of an earlier failed CUDA build where this build does not try it
        forget_failure_notes(failure_note_paths(CUDA_EXTENSION, ROOT, PACKAGE_DIRS))
    if mode == "0":
        say("not building the CUDA kernels: SYNCBN_CUDA=0")
        return []
    toolkit = find_toolkit()
    blocker = cuda_blocker(toolkit)
    if blocker is not None:
        if mode == "1":
            raise SystemExit(f"syncbn: SYNCBN_CUDA=1, but the CUDA kernels cannot be built: {blocker}")
        say(f"not building the CUDA kernels: {blocker}")
        return []
    say(f"building the CUDA kernels with the CUDA toolkit {toolkit.home} ({toolkit.found_by})")
    cpp_extension.CUDA_HOME = toolkit.home  # torch guessed its own at import; use the one found
    os.environ["CUDA_HOME"] = toolkit.home
    os.environ["TORCH_CUDA_ARCH_LIST"] = cuda_arch_list()
    ext = cpp_extension.CUDAExtension(
        name=CUDA_EXTENSION,
        sources=sources("src/cuda/*.cu", "src/cuda/bindings.cpp", "src/train_forward.cpp"),
        include_dirs=[os.path.join(ROOT, "src"), write_build_identity()],
        extra_compile_args={"cxx": ["-O3", "-g0", *quiet_flags()], "nvcc": ["-O3"]},
        extra_link_args=cxx_runtime_link_args(),
    )
    ext.optional = mode == "auto"
    return [ext]


class BuildExtension(cpp_extension.BuildExtension):
    """torch's BuildExtension, where an optional extension (``optional=True``: the CUDA kernels
    under ``SYNCBN_CUDA=auto``) that fails to build is left out with one paragraph on stderr (and
    in a note beside the package that the import repeats), and the others are still built,
    copied in place and installed."""

    def build_extensions(self) -> None:
        # torch checks the CUDA toolkit before it builds anything: where that fails, the
        # optional extensions go and the rest is built
        self.started = False
        try:
            super().build_extensions()
        except Exception as error:
            optional = [ext for ext in self._built() if getattr(ext, "optional", False)]
            if self.started or not optional:
                raise
            for ext in optional:
                self.record_failure(ext, str(error), error)
            self._with_built(super().build_extensions)

    def build_extension(self, ext) -> None:
        # a build sits silent for minutes otherwise: say what it compiles, and when it is done
        self.started, start = True, time.monotonic()
        say(f"compiling {ext.name} ({len(ext.sources)} source files: {', '.join(os.path.basename(s) for s in ext.sources)})")
        try:
            self._build_one(ext)
        finally:
            say(f"{ext.name}: {time.monotonic() - start:.0f} s")

    def _build_one(self, ext) -> None:
        if not getattr(ext, "optional", False):
            return super().build_extension(ext)
        error = None
        with captured_output() as output:
            try:
                super().build_extension(ext)
            except Exception as caught:  # compiler, linker or setuptools errors alike
                error = caught
        sys.stdout.write(output.text)
        forget_failure_notes(self._note_paths(ext))
        if error is not None:
            self.record_failure(ext, output.text, error)

    def record_failure(self, ext, output: str, error: BaseException) -> None:
        """Leave ``ext`` out of what is copied and installed; say why, here and in a note."""
        self.failed_optional = [*getattr(self, "failed_optional", []), ext.name]
        paragraph = failure_paragraph(ext.name, output + "\n" + str(error), error)
        print(paragraph, file=sys.stderr, flush=True)
        write_failure_note(self._note_paths(ext), paragraph)

    def _note_paths(self, ext) -> list[str]:
        return failure_note_paths(ext.name, ROOT, PACKAGE_DIRS, self.build_lib)

    def _built(self) -> list:
        failed = set(getattr(self, "failed_optional", []))
        return [ext for ext in self.extensions if ext.name not in failed]

    def _with_built(self, step):
        """``step()`` with only the extensions that built (the failed optional ones left out)."""
        kept, self.extensions = self.extensions, self._built()
        try:
            return step()
        finally:
            self.extensions = kept

    def copy_extensions_to_source(self) -> None:
        self._with_built(super().copy_extensions_to_source)

    def get_outputs(self) -> list[str]:
        return self._with_built(super().get_outputs)


if __name__ == "__main__":
    from setuptools import setup

    extensions = [cpu_extension(capability) for capability in cpu_capabilities()] + cuda_extensions()
    setup(ext_modules=extensions, cmdclass={"build_ext": BuildExtension})
