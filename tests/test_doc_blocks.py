"""Every ```python block of the README and the user's guide (docs/*.md) runs as written, as a
user's script would: in a fresh interpreter, from a directory outside the repository, with what
the install gave. A block that cannot (it needs torchrun, several processes, a GPU, an optional
package, or it shows part of a larger program) says so: the line before its fence is
``<!-- fragment -->``. The blocks run in parallel, one subprocess each."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FRAGMENT = "<!-- fragment -->"
BLOCK_TIMEOUT = 120.0


def runnable_blocks() -> dict[str, str]:
    """``page:line`` of each unmarked ```python block -> its code."""
    found = {}
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        start = None
        for number, line in enumerate(lines):
            if start is None and line.strip() == "```python":
                start = number
            elif start is not None and line.strip() == "```":
                marked = next((text.strip() for text in reversed(lines[:start]) if text.strip()), "") == FRAGMENT
                if not marked:
                    found[f"{page.relative_to(ROOT)}:{start + 1}"] = "\n".join(lines[start + 1:number]) + "\n"
                start = None
    return found


def run_block(code: str, directory: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}  # as a user's shell: the install, not the tests' path
    return subprocess.run([sys.executable, "-c", code], cwd=directory, env=env, capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT)


def test_the_pages_have_blocks_that_run() -> None:
    assert len(runnable_blocks()) >= 5


def test_every_unmarked_python_block_runs_as_written(tmp_path: Path) -> None:
    blocks = runnable_blocks()
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(blocks, pool.map(lambda code: run_block(code, tmp_path), blocks.values())))
    failed = [f"{where}: exit {result.returncode}\n{result.stderr[-1500:]}"
              for where, result in results.items() if result.returncode != 0]
    assert not failed, "blocks that do not run as written (fix them, or mark them " + FRAGMENT + "):\n" + "\n".join(failed)


@pytest.mark.parametrize("text, runnable", [
    ("```python\nprint(1)\n```\n", True),
    (FRAGMENT + "\n```python\nprint(undefined)\n```\n", False),
    (FRAGMENT + "\n\n```python\nx = 1\n```\n", False),
])
def test_a_marked_block_is_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, runnable: bool) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n" + text, encoding="utf-8")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PAGES", [page])
    assert len(runnable_blocks()) == int(runnable)
