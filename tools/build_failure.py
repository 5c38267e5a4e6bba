"""What setup.py leaves when an optional extension (the CUDA kernels) fails to build: one
paragraph (what failed, the first error line, how to retry or skip), printed and kept in a note
beside the package's modules, since pip hides the build's output; functions/operators/backend.py repeats
the note at import (``cuda_build_failure``)."""
from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

FIRST_ERROR = re.compile(r"error|cannot find|undefined reference|fatal|no such file", re.IGNORECASE)
COMMAND_LINE = re.compile(r"^\s*\[\d+/\d+\]|\s-[co]\s")  # ninja's progress lines, compiler and linker calls
SKIP_HINT = "SYNCBN_CUDA=0 skips the CUDA kernels; SYNCBN_CUDA=1 makes any CUDA failure an error"
FAILURE_NOTE = "{name}.build-failure.txt"


def first_error_line(log: str) -> str:
    """The first line of a build log that reports an error (not a command that merely has
    "error" in its flags), else its last line."""
    for line in log.splitlines():
        if FIRST_ERROR.search(line) and not COMMAND_LINE.search(line):
            return line.strip()
    return next((line.strip() for line in reversed(log.splitlines()) if line.strip()), "(no output)")


def failure_paragraph(name: str, log: str, error: BaseException) -> str:
    """The paragraph that says the CUDA kernels ``name`` failed, why, and what to do."""
    return (
        f"syncbn: the CUDA kernels ({name}) failed to build; the CPU kernels are built and will be "
        f"used, and CUDA tensors get torch's own CUDA ops. First error: {first_error_line(log)} "
        f"[{type(error).__name__}]. To retry, fix the cause (the toolkit: CUDA_HOME; the "
        f"architectures: TORCH_CUDA_ARCH_LIST) and build again; {SKIP_HINT}."
    )


def failure_note_paths(
    ext_name: str, root: str, package_dirs: dict[str, str], build_lib: str | None = None
) -> list[str]:
    """Where the note for extension ``ext_name`` goes: beside its package's modules in the
    repository at ``root`` (``package_dirs``: pyproject.toml's package-dir), and in ``build_lib``."""
    package, _, name = ext_name.rpartition(".")
    note = FAILURE_NOTE.format(name=name)
    paths = [os.path.join(root, package_dirs.get(package, package.replace(".", os.sep)), note)]
    if build_lib is not None:
        paths.append(os.path.join(build_lib, *package.split("."), note))
    return paths


def write_failure_note(paths: list[str], paragraph: str) -> None:
    """Keep ``paragraph`` at each of ``paths``."""
    for path in paths:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(paragraph + "\n")


def forget_failure_notes(paths: list[str]) -> None:
    """Remove the notes of an earlier failed build."""
    for path in paths:
        if os.path.exists(path):
            os.remove(path)


class CapturedOutput:
    """What was written to file descriptors 1 and 2 (compilers that ninja runs included)."""

    text: str = ""


@contextmanager
def captured_output() -> Iterator[CapturedOutput]:
    """Send file descriptors 1 and 2 to a temporary file; its text is the result's ``text``
    once the block ends."""
    captured = CapturedOutput()
    with tempfile.TemporaryFile(mode="w+") as log:
        saved = [os.dup(1), os.dup(2)]
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            log.seek(0)
            captured.text = log.read()
