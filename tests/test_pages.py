"""The pages a user reads: every shipped file speaks of the software only (no word about how its
work was organised), the results page is what the benchmarks' result files make, and the README's
cost table and the performance page stay short."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import report  # noqa: E402

# How the work was organised means nothing to a user: numbered stops and issues, sessions,
# machines lent, commit hashes written into prose (a result's header names its commit: allowed).
ORGANISATIONAL = {
    "a numbered stop": re.compile(r"\bstops? \d+", re.IGNORECASE),
    "a session": re.compile(r"\bsessions?\b", re.IGNORECASE),
    "an issue number": re.compile(r"\bissues? #?\d+", re.IGNORECASE),
    "a machine lent": re.compile(r"\blent\b", re.IGNORECASE),
    "a commit hash": re.compile(r"(?<![\w.#/`\"-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w`\"-])"),
}
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()


def shipped_text_files() -> list[Path]:
    """Every file git tracks in this checkout (and the untracked ones it does not ignore), text only."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the shipped files are what git tracks")
    files = []
    for name in listed:
        path = ROOT / name
        if name == THIS_FILE or not path.is_file():
            continue
        if b"\0" not in path.read_bytes()[:4096]:
            files.append(path)
    return files


def test_no_shipped_file_speaks_of_how_the_work_was_organised() -> None:
    found = []
    for path in shipped_text_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for what, pattern in ORGANISATIONAL.items():
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {what}: {line.strip()[:120]}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("line, what", [
    ("as measured at stop 44", "a numbered stop"), ("in this session", "a session"),
    ("see issue 22", "an issue number"), ("an H200 lent for a while", "a machine lent"),
    ("fixed in 48062bb", "a commit hash"),
])
def test_the_guard_sees_each_kind_of_word(line: str, what: str) -> None:
    assert ORGANISATIONAL[what].search(line)
    assert not any(p.search("the layer's statistics, 0.58x of nn.BatchNorm2d, commit `48062bb`")
                   for p in ORGANISATIONAL.values())


def test_the_results_page_is_what_the_result_files_make() -> None:
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    assert text == report.page(), "run python benchmarks/report.py after a benchmark writes its result"
    assert text.count("\n") <= 300


def test_the_readme_cost_table_is_short() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## What it costs", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # past heading and rule
    assert 0 < len(rows) <= 8
    assert all(len(line) <= 160 for line in section.splitlines()), max(section.splitlines(), key=len)
    assert any("H200" in row or "H100" in row for row in rows), "a GPU row"
    assert not re.search(r"(?<![\w.])-\d", section), "a negative cost: write a figure within noise as such"


def test_the_performance_page_is_short_and_shows_its_pictures_first() -> None:
    page = (ROOT / "docs" / "performance.md").read_text()
    assert page.count("\n") <= 150
    first_picture = page.find("![")
    assert 0 <= first_picture < page.find("\n## ", page.find("\n## ") + 1), "pictures first"


def test_the_code_map_names_every_test_file() -> None:
    """The testing page sends readers to the code map for the list of test files: it must be whole."""
    code_map = (ROOT / "docs" / "code-map.md").read_text(encoding="utf-8")
    missing = [path.name for path in sorted((ROOT / "tests").glob("test_*.py")) if f"`{path.name}`" not in code_map]
    assert not missing, f"docs/code-map.md does not name: {missing}"
