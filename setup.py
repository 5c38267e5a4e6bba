"""Builds the compiled kernels (``src/``) of the ``syncbn.functions`` package (the ``functions/`` directory) as torch cpp_extensions;
the project's metadata (name, version, dependencies, the ``functions`` and ``modules``
packages) is in ``pyproject.toml``.

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
  failure is an error). The toolkit is ``CUDA_HOME`` or ``CUDA_PATH``, else the real location of
  ``nvcc`` on the PATH (through symbolic links and ``exec`` wrapper scripts); the build says
  which. ``TORCH_CUDA_ARCH_LIST`` is honoured; without it, the visible GPUs' architectures, else
  ``7.5;8.0;8.7;9.0+PTX`` (CUDA 13 has no sm_70; 8.7 is Jetson Orin). No ``--use_fast_math``:
  the kernels rely on IEEE division, rounding and the sign of their results.

``CXX`` and ``MAX_JOBS`` are honoured as by every torch extension. Build in place with
``./make_ext.sh``, or install with ``pip install --no-build-isolation -e .`` (or without ``-e``):
torch must already be installed, as the extensions are built against it.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.abspath(__file__))

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # pip's build isolation: a fresh environment without the user's torch
    raise SystemExit(
        "syncbn: building the kernels needs the torch they will run with: install torch first "
        "(`pip install torch==2.13.0` for the CPU build, or your CUDA build), then install this "
        "project with `pip install --no-build-isolation -e .` (or `./make_ext.sh`)"
    ) from None

CPU_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "DEFAULT": [],
}
DEFAULT_CUDA_ARCHS = "7.5;8.0;8.7;9.0+PTX"
CUDA_EXTENSION = "syncbn.functions._C_cuda"
PACKAGE_DIRS = {"syncbn.functions": "functions", "syncbn.modules": "modules"}
"""Where the packages live in the repository (pyproject.toml's package-dir)."""
SKIP_HINT = "SYNCBN_CUDA=0 skips the CUDA kernels; SYNCBN_CUDA=1 makes any CUDA failure an error"


def say(message: str) -> None:
    print(f"syncbn: {message}", file=sys.stderr, flush=True)


# ---- CPU kernels ----------------------------------------------------------------------------


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
    # -g0: no debug info (Python's CFLAGS ask for -g), which would triple the objects and the link
    return ["-O3", "-g0", *CPU_CAPABILITY_FLAGS[capability], *macros, *openmp_flags()]


def sources(*patterns: str) -> list[str]:
    """Source files relative to the repo (setuptools wants relative paths)."""
    return sorted(os.path.relpath(p, ROOT) for pattern in patterns for p in glob.glob(os.path.join(ROOT, pattern)))


def cpu_extension(capability: str) -> cpp_extension.CppExtension:
    return cpp_extension.CppExtension(
        name=f"syncbn.functions._C_{capability.lower()}",
        sources=sources(
            "src/bindings.cpp", "src/train_forward.cpp", "src/sync_batch_norm.cpp", "src/object_exchange.cpp",
            "src/torch_cuda_ops.cpp", "src/cpu/*.cpp",
        ),
        include_dirs=[os.path.join(ROOT, "src")],
        extra_compile_args={"cxx": cpu_compile_args(capability)},
        extra_link_args=[*openmp_flags(), *cxx_runtime_link_args()],
    )


# ---- the C++ runtime ------------------------------------------------------------------------


def loaded_cxx_runtime() -> str | None:
    """The shared GNU C++ runtime (libstdc++.so.6) that this process, and so torch, has loaded,
    or None (not Linux, or another runtime)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps if len(line.split()) >= 6]
    except OSError:
        return None
    return next((path for path in paths if os.path.basename(path).startswith("libstdc++.so")), None)


def cxx_runtime_link_args() -> list[str]:
    """The extensions link torch's C++ runtime itself, named on the link line.

    A compiler that links libstdc++ statically (``-static-libstdc++``, or a relocated GCC whose
    own library directory holds only ``libstdc++.a``: seen on a GPU machine whose ``CC`` was
    such a wrapper) gives each extension a second C++ runtime beside torch's. The two do not
    share their locale facets, so formatting a number into an error message crashes the process
    (every ``TORCH_CHECK`` that names a size or count segfaulted). A shared library named before
    the driver's own ``-lstdc++`` resolves every runtime symbol, and nothing comes from the
    archive; where the compiler links the shared runtime anyway this changes nothing.
    """
    runtime = loaded_cxx_runtime()
    return [runtime] if runtime else []


def cxx_runtime_definitions(path: str) -> list[str]:
    """The members of ``std::locale`` that the ELF64 little-endian shared object at ``path``
    defines itself (its dynamic and static symbol tables): only a copy of the C++ runtime linked
    in defines them; code that uses the shared runtime leaves them undefined. [] for any other
    file."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return []
    (section_offset,) = struct.unpack_from("<Q", data, 0x28)
    entry_size, count = struct.unpack_from("<HH", data, 0x3A)
    # Elf64_Shdr: name, type, flags, addr, offset, size, link, info, addralign, entsize
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, section_offset + i * entry_size) for i in range(count)]
    found = set()
    for _, kind, _, _, offset, size, link, _, _, _ in sections:
        if kind not in (2, 11):  # SHT_SYMTAB, SHT_DYNSYM
            continue
        strings = sections[link][4]
        # Elf64_Sym: name, info, other, section index (0: undefined), value, size
        for name, _, _, section, _, _ in struct.iter_unpack("<IBBHQQ", data[offset : offset + size]):
            start = strings + name
            if section != 0 and data.startswith(b"_ZNSt6locale", start):
                found.add(data[start : data.index(b"\0", start)].decode())
    return sorted(found)


def check_cxx_runtime(path: str) -> None:
    """Raise where the built extension at ``path`` carries its own C++ runtime beside torch's."""
    runtime = loaded_cxx_runtime()
    if runtime is None or not cxx_runtime_definitions(path):
        return
    raise RuntimeError(
        f"syncbn: {os.path.basename(path)} carries its own copy of the C++ runtime (the compiler linked "
        f"libstdc++ statically: CXX={os.environ.get('CXX', 'c++')}, CC={os.environ.get('CC', 'cc')}) beside "
        f"torch's {runtime}; its error messages would crash the process. Build with a compiler that links "
        "libstdc++ dynamically (the system's: `env -u CC -u CXX ./make_ext.sh`)."
    )


# ---- CUDA toolkit ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Toolkit:
    """A CUDA toolkit: its root, and how it was found (said in the build log)."""

    home: str
    found_by: str

    @property
    def nvcc(self) -> str:
        return os.path.join(self.home, "bin", "nvcc")

    def runtime_library_dir(self) -> str | None:
        """Where torch's build will look for libcudart (lib64, else lib), if it is there."""
        for name in ("lib64", "lib"):
            directory = os.path.join(self.home, name)
            if glob.glob(os.path.join(directory, "libcudart.so*")) or glob.glob(os.path.join(directory, "cudart.lib")):
                return directory
        return None


def real_nvcc(path: str) -> str:
    """The nvcc binary behind ``path``: symbolic links followed, and a shell wrapper script that
    ``exec``s (or names) another nvcc followed to it."""
    seen = set()
    path = os.path.realpath(path)
    while path not in seen:
        seen.add(path)
        try:
            with open(path, "rb") as f:
                head = f.read(4096)
        except OSError:
            return path
        if not head.startswith(b"#!"):
            return path  # a binary
        named = re.findall(rb"(/[^\s'\";]*/nvcc)(?![\w.-])", head)
        targets = [os.path.realpath(p.decode()) for p in named if os.path.exists(p.decode())]
        targets = [t for t in targets if t != path]
        if not targets:
            return path
        path = targets[0]
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


def unsupported_archs(toolkit: Toolkit, archs: str) -> list[str]:
    """Entries of ``archs`` (``7.5;8.0;8.7;9.0+PTX``) that this toolkit's nvcc cannot build for."""
    try:
        listed = subprocess.run([toolkit.nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []  # an old nvcc without the flag: let the compiler say
    supported = set(re.findall(r"compute_(\d+)", listed))
    wanted = [a for a in re.split(r"[;\s,]+", archs) if a]
    return [a for a in wanted if supported and a.split("+")[0].replace(".", "") not in supported]


def nvcc_release(toolkit: Toolkit) -> tuple[int, int] | None:
    """(major, minor) of the toolkit's nvcc, or None where it does not say."""
    try:
        text = subprocess.run([toolkit.nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+)\.(\d+)", text)
    return (int(found.group(1)), int(found.group(2))) if found else None


def cuda_blocker(toolkit: Toolkit | None) -> str | None:
    """Why the CUDA kernels cannot be built here (checked before compiling), or None."""
    if not torch.version.cuda:
        return f"torch {torch.__version__} is not a CUDA build"
    if toolkit is None:
        return "no CUDA toolkit found (set CUDA_HOME, or put nvcc on the PATH)"
    if not os.path.exists(toolkit.nvcc):
        return f"no nvcc in the CUDA toolkit {toolkit.home} ({toolkit.found_by})"
    if toolkit.runtime_library_dir() is None:
        return f"the CUDA toolkit {toolkit.home} ({toolkit.found_by}) has no runtime library (libcudart) in lib64 or lib"
    release = nvcc_release(toolkit)
    if release is not None and str(release[0]) != torch.version.cuda.split(".")[0]:
        return (
            f"nvcc {release[0]}.{release[1]} of {toolkit.home} ({toolkit.found_by}) does not match the CUDA "
            f"{torch.version.cuda} of torch {torch.__version__} (their major versions must agree)"
        )
    archs = cuda_arch_list()
    unsupported = unsupported_archs(toolkit, archs)
    if unsupported:
        return f"nvcc of {toolkit.home} cannot build for {', '.join(unsupported)} (TORCH_CUDA_ARCH_LIST={archs})"
    return None


def cuda_mode() -> str:
    """SYNCBN_CUDA: '0' (skip), '1' (require) or 'auto' (unset)."""
    mode = os.environ.get("SYNCBN_CUDA", "auto").strip().lower() or "auto"
    if mode not in ("0", "1", "auto"):
        raise SystemExit(f"SYNCBN_CUDA must be 0, 1 or unset, got {mode!r}")
    return mode


def forget_cuda_failure() -> None:
    """No note of an earlier failed CUDA build where this build does not try it."""
    path = failure_note_paths(CUDA_EXTENSION, ROOT)[0]
    if os.path.exists(path):
        os.remove(path)


def cuda_extensions() -> list[cpp_extension.CUDAExtension]:
    """functions._C_cuda where SYNCBN_CUDA and the checks before compiling allow it."""
    mode = cuda_mode()
    if mode != "1":
        forget_cuda_failure()
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
    return [
        cpp_extension.CUDAExtension(
            name=CUDA_EXTENSION,
            sources=sources("src/cuda/*.cu", "src/cuda/bindings.cpp", "src/train_forward.cpp"),
            include_dirs=[os.path.join(ROOT, "src")],
            extra_compile_args={"cxx": ["-O3", "-g0"], "nvcc": ["-O3"]},
            extra_link_args=cxx_runtime_link_args(),
        )
    ]


# ---- building: an optional extension's failure keeps the others ------------------------------


FIRST_ERROR = re.compile(r"error|cannot find|undefined reference|fatal|no such file", re.IGNORECASE)
COMMAND_LINE = re.compile(r"^\s*\[\d+/\d+\]|\s-[co]\s")  # ninja's progress lines, compiler and linker calls


def first_error_line(log: str) -> str:
    """The first line of a build log that reports an error (not a command that merely has
    "error" in its flags), else its last line."""
    for line in log.splitlines():
        if FIRST_ERROR.search(line) and not COMMAND_LINE.search(line):
            return line.strip()
    return next((line.strip() for line in reversed(log.splitlines()) if line.strip()), "(no output)")


def build_failure_paragraph(name: str, log: str, error: BaseException) -> str:
    return (
        f"syncbn: the CUDA kernels ({name}) failed to build; the CPU kernels are built and will be "
        f"used, and CUDA tensors get torch's own CUDA ops. First error: {first_error_line(log)} "
        f"[{type(error).__name__}]. To retry, fix the cause (the toolkit: CUDA_HOME; the "
        f"architectures: TORCH_CUDA_ARCH_LIST) and build again; {SKIP_HINT}."
    )


FAILURE_NOTE = "{name}.build-failure.txt"
"""Left beside the package's modules when an optional extension failed to build: pip hides the
build's output, so functions/backend.py says it again at import (and in backend_info())."""


def failure_note_paths(ext_name: str, build_lib: str) -> list[str]:
    package, _, name = ext_name.rpartition(".")
    note = FAILURE_NOTE.format(name=name)
    in_repository = PACKAGE_DIRS.get(package, package.replace(".", os.sep))
    return [os.path.join(ROOT, in_repository, note), os.path.join(build_lib, *package.split("."), note)]


class BuildExtension(cpp_extension.BuildExtension):
    """torch's BuildExtension, where an optional extension (``optional=True``: the CUDA kernels
    under ``SYNCBN_CUDA=auto``) that fails to build is left out with one paragraph on stderr (and
    in a note beside the package that the import repeats), and the others are still built,
    copied in place and installed."""

    def build_extensions(self) -> None:
        # torch checks the CUDA toolkit (nvcc --version against torch's CUDA) before it builds
        # anything: where that fails, the optional extensions go and the rest is built
        self.started = False
        try:
            super().build_extensions()
        except Exception as error:
            optional = [ext for ext in self._built() if getattr(ext, "optional", False)]
            if self.started or not optional:
                raise
            for ext in optional:
                self.record_failure(ext, str(error), error)
            kept, self.extensions = self.extensions, self._built()
            try:
                super().build_extensions()
            finally:
                self.extensions = kept

    def record_failure(self, ext, output: str, error: BaseException) -> None:
        """Leave ``ext`` out of what is copied and installed; say why, here and in a note."""
        self.failed_optional = [*getattr(self, "failed_optional", []), ext.name]
        paragraph = build_failure_paragraph(ext.name, output + "\n" + str(error), error)
        print(paragraph, file=sys.stderr, flush=True)
        for path in failure_note_paths(ext.name, self.build_lib):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(paragraph + "\n")

    def build_extension(self, ext) -> None:
        self.started = True
        if not getattr(ext, "optional", False):
            super().build_extension(ext)
            return check_cxx_runtime(self.get_ext_fullpath(ext.name))
        with tempfile.TemporaryFile(mode="w+") as log:
            saved = [os.dup(1), os.dup(2)]
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
            try:
                super().build_extension(ext)
                check_cxx_runtime(self.get_ext_fullpath(ext.name))
                error = None
            except Exception as caught:  # compiler, linker or setuptools errors alike
                error = caught
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os.dup2(saved[0], 1), os.dup2(saved[1], 2)
                for fd in saved:
                    os.close(fd)
            log.seek(0)
            output = log.read()
        sys.stdout.write(output)
        for path in failure_note_paths(ext.name, self.build_lib):
            if os.path.exists(path):
                os.remove(path)  # from an earlier failed build
        if error is not None:
            self.record_failure(ext, output, error)

    def _built(self) -> list:
        failed = set(getattr(self, "failed_optional", []))
        return [ext for ext in self.extensions if ext.name not in failed]

    def copy_extensions_to_source(self) -> None:
        kept, self.extensions = self.extensions, self._built()
        try:
            super().copy_extensions_to_source()
        finally:
            self.extensions = kept

    def get_outputs(self) -> list[str]:
        kept, self.extensions = self.extensions, self._built()
        try:
            return super().get_outputs()
        finally:
            self.extensions = kept


def extensions() -> list:
    result = [cpu_extension(capability) for capability in cpu_capabilities()]
    for ext in cuda_extensions():
        ext.optional = cuda_mode() == "auto"
        result.append(ext)
    return result


if __name__ == "__main__":
    from setuptools import setup

    setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExtension})
