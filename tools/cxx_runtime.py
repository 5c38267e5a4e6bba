"""Torch's shared C++ runtime: the link argument with which setup.py makes every extension use it,
and a check that a built extension carries no copy of its own.

A compiler that links libstdc++ statically (``-static-libstdc++``, or a relocated GCC whose
library directory holds only ``libstdc++.a``) gives each extension a second C++ runtime beside
torch's. The two do not share their locale facets, so formatting a number into an error message
(every ``TORCH_CHECK`` that names a size or count) crashes the process. Naming torch's
``libstdc++.so.6`` on the link line, before the driver's own ``-lstdc++``, resolves every runtime
symbol from it, so nothing comes from the archive; where the compiler links the shared runtime
anyway this changes nothing.

The check, for built extensions (exit status 1 where one carries its own runtime)::

    python tools/cxx_runtime.py functions/_C_*.so
"""
from __future__ import annotations

import argparse
import glob
import os
import struct
import sys

import torch  # loads the shared C++ runtime that the extensions must use

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHT_SYMTAB, SHT_DYNSYM = 2, 11


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
    """The link arguments that give an extension torch's C++ runtime: its path, else none."""
    runtime = loaded_cxx_runtime()
    return [runtime] if runtime else []


def elf64_sections(data: bytes) -> list[tuple]:
    """The section headers of an ELF64 little-endian file: (name, type, flags, addr, offset,
    size, link, info, addralign, entsize) each; [] for any other file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return []
    (section_offset,) = struct.unpack_from("<Q", data, 0x28)
    entry_size, count = struct.unpack_from("<HH", data, 0x3A)
    return [struct.unpack_from("<IIQQQQIIQQ", data, section_offset + i * entry_size) for i in range(count)]


def cxx_runtime_definitions(path: str) -> list[str]:
    """The members of ``std::locale`` that the shared object at ``path`` defines itself (its
    dynamic and static symbol tables): only a copy of the C++ runtime linked in defines them;
    code that uses the shared runtime leaves them undefined. [] for a file that is not ELF64."""
    with open(path, "rb") as f:
        data = f.read()
    sections = elf64_sections(data)
    found = set()
    for _, kind, _, _, offset, size, link, _, _, _ in sections:
        if kind not in (SHT_SYMTAB, SHT_DYNSYM):
            continue
        strings = sections[link][4]
        # Elf64_Sym: name, info, other, section index (0: undefined), value, size
        for name, _, _, section, _, _ in struct.iter_unpack("<IBBHQQ", data[offset : offset + size]):
            start = strings + name
            if section != 0 and data.startswith(b"_ZNSt6locale", start):
                found.add(data[start : data.index(b"\0", start)].decode())
    return sorted(found)


def own_runtime_problem(path: str) -> str | None:
    """Why the built extension at ``path`` would crash the process (it carries its own C++
    runtime beside torch's), or None."""
    runtime = loaded_cxx_runtime()
    if runtime is None or not cxx_runtime_definitions(path):
        return None
    return (
        f"{os.path.basename(path)} carries its own copy of the C++ runtime (the compiler linked libstdc++ "
        f"statically: CXX={os.environ.get('CXX', 'c++')}, CC={os.environ.get('CC', 'cc')}) beside torch's "
        f"{runtime}; its error messages would crash the process. Build with a compiler that links "
        "libstdc++ dynamically (the system's: `env -u CC -u CXX ./make_ext.sh`)."
    )


def main(argv: list[str] | None = None) -> int:
    """Check each built extension named (default: the kernels built in place); 1 where one fails."""
    parser = argparse.ArgumentParser(description="Check that built extensions use torch's shared C++ runtime.")
    parser.add_argument("paths", nargs="*", help="built extensions (default: functions/_C_*.so)")
    paths = parser.parse_args(argv).paths or sorted(glob.glob(os.path.join(ROOT, "functions", "_C_*.so")))
    if loaded_cxx_runtime() is None:
        print(f"cxx_runtime: torch {torch.__version__} loaded no shared libstdc++ here: nothing to check")
        return 0
    problems = [problem for problem in map(own_runtime_problem, paths) if problem]
    for problem in problems:
        print(f"cxx_runtime: FAILED: {problem}", file=sys.stderr)
    if not paths:
        print("cxx_runtime: no built extension to check", file=sys.stderr)
        return 1
    if not problems:
        print(f"cxx_runtime: ok     {len(paths)} extension(s) use torch's {loaded_cxx_runtime()}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
