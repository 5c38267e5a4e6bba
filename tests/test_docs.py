"""The README and the user's guide (docs/*.md) say only what holds in this checkout.

- every ```bash / ```sh line that runs ``python <file>``, ``torchrun ... <file>``, ``tools/...``,
  ``./make_ext.sh`` or ``-r <requirements file>`` names a file that exists, and each such Python
  script that parses arguments answers ``--help`` (all at once, in parallel; nothing is trained);
- the README's set-up and test commands are the ones CI runs (``.ci/run``, which says it runs
  the README's commands);
- every ```python block's import lines import, in one fresh interpreter outside the repository
  (as a user's script would); those of an optional package (Lightning) where it is installed;
- every relative link (and image) points to an existing file, and every ``#anchor`` to a heading
  of the page it names;
- the README stays a five-minute read: at most 150 lines.

The example scripts themselves are run by tests/test_examples.py.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import re
import shlex
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 150

FENCE = re.compile(r"^```(\w*)\s*$")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def blocks(page: Path) -> list[tuple[str, str]]:
    """(language, text) of every fenced code block of a page."""
    return blocks_of(page.read_text(encoding="utf-8"))


def prose(page: Path) -> str:
    """A page without its code blocks and inline code (links there are examples, not links)."""
    kept, inside = [], False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.strip()) or (inside and line.strip() == "```"):
            inside = not inside
            continue
        if not inside:
            kept.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(kept)


def shell_commands(text: str) -> list[list[str]]:
    """The simple commands of a shell block, as words, comments and env assignments dropped."""
    commands = []
    for line in text.splitlines():
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        for part in re.split(r"&&|\|\||;|\|", line):
            try:
                words = shlex.split(part)
            except ValueError:
                words = part.split()
            while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
                words = words[1:]
            if words:
                commands.append(words)
    return commands


def named_files(words: list[str]) -> list[str]:
    """Paths in the repository that a command runs or reads."""
    paths = []
    program = words[0]
    if program.startswith(("tools/", "./")):
        paths.append(program)
    if Path(program).name in ("python", "python3") and len(words) > 1 and words[1] != "-m" \
            and not words[1].startswith("-"):
        paths.append(words[1])
    if program == "torchrun":
        paths.extend(word for word in words[1:] if word.endswith(".py"))
    paths.extend(words[i + 1] for i, word in enumerate(words[:-1]) if word == "-r")
    return paths


def shell_blocks() -> list[tuple[Path, list[str]]]:
    return [(page, words) for page in PAGES for language, text in blocks(page)
            if language in ("bash", "sh", "shell", "console") for words in shell_commands(text)]


def test_readme_is_short():
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the guide (docs/) is the place for more"


def test_shell_blocks_name_existing_files():
    missing = [f"{page.relative_to(ROOT)}: {' '.join(words)}: no {path}"
               for page, words in shell_blocks() for path in named_files(words)
               if not (ROOT / path).is_file()]
    assert not missing, "\n".join(missing)


HELP_RUNNER = """
import contextlib, io, json, runpy, sys
results = {}
for script in sys.argv[1:]:
    out = io.StringIO()
    sys.argv = [script, "--help"]
    code = None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        code = done.code or 0
    except BaseException as error:
        code = repr(error)
    results[script] = [code, out.getvalue()]
print(json.dumps(results))
"""


def test_python_scripts_answer_help():
    """One interpreter runs every script's ``--help`` in turn (torch is imported once: fast)."""
    scripts = sorted({path for _, words in shell_blocks() for path in named_files(words)
                      if path.endswith(".py") and (ROOT / path).is_file()
                      and "argparse" in (ROOT / path).read_text(encoding="utf-8")})
    assert scripts, "no Python script named in the docs' shell blocks"
    result = subprocess.run([sys.executable, "-c", HELP_RUNNER, *scripts], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    answers = json.loads(result.stdout.strip().splitlines()[-1])
    failed = [f"python {script} --help: {code!r}\n{output[-2000:]}"
              for script, (code, output) in answers.items() if code != 0 or "usage" not in output.lower()]
    assert not failed, "\n".join(failed)


def _ci_form(line: str) -> str:
    """A command as CI and the README both write it: no comment, no quiet/verbose flags, no redirection,
    no package index (CI installs torch's CPU build from a local wheel; the README names PyTorch's index),
    no ``--exhaustive`` (CI runs the suite with its slow cases)."""
    line = re.split(r"\s#", line)[0]
    line = re.split(r"\s(?:>|\|\|)\s", line)[0]
    line = re.sub(r"\s--index-url\s+\S+", "", line)
    line = line.replace(" --exhaustive", "")  # CI runs the README's suite with its slow cases
    words = [word for word in line.split() if word not in ("--quiet", "-q", "-v")]
    return " ".join(words)


def test_readme_setup_commands_are_what_ci_runs():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Set up and test", 1)[1].split("\n## ", 1)[0]
    readme = [line for language, body in blocks_of(section) if language == "bash"
              for line in body.splitlines() if line.strip()]
    ci = {_ci_form(line) for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()}
    assert readme, "the README's set-up section has no bash block"
    missing = [line for line in readme if _ci_form(line) not in ci]
    assert not missing, f"README commands that .ci/run does not run: {missing}"
    pytest_lines = [line for line in readme if "pytest" in line]
    assert any("--kernels reference" in line for line in pytest_lines)


def blocks_of(text: str) -> list[tuple[str, str]]:
    """(language, text) of every fenced code block of a markdown text."""
    found, inside, language, lines = [], False, "", []
    for line in text.splitlines():
        match = FENCE.match(line.strip())
        if not inside and match:
            inside, language, lines = True, match.group(1).lower(), []
        elif inside and line.strip() == "```":
            inside = False
            found.append((language, "\n".join(lines)))
        elif inside:
            lines.append(line)
    return found


def import_lines(text: str) -> list[str]:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return [line.strip() for line in text.splitlines()
                if re.match(r"^(import \w|from [\w.]+ import \w)", line.strip())]
    return [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


OPTIONAL = {"lightning": ("lightning", "pytorch_lightning", "syncbn.lightning"), "timm": ("timm",),
            "ultralytics": ("ultralytics",), "segmentation_models_pytorch": ("segmentation_models_pytorch",),
            "accelerate": ("accelerate",), "mmengine": ("mmengine",)}
"""Packages that a page may import and the library does not need (requirements-test.txt installs
Lightning; timm and the model libraries run in a second environment, .ci/run), with the modules that need each: where one is not installed, its import lines are not checked."""


def needs_missing_package(line: str) -> bool:
    try:
        node = ast.parse(line).body[0]
    except SyntaxError:  # a line cut from a block that does not parse: checked as it is
        return False
    if isinstance(node, ast.Import):
        modules = [alias.name for alias in node.names]
    else:  # from a import b: b may be a module
        modules = [node.module or "", *(f"{node.module}.{alias.name}" for alias in node.names)]
    needed = {package for package, names in OPTIONAL.items()
              for m in modules for n in names if m == n or m.startswith(n + ".")}
    return any(importlib.util.find_spec(package) is None for package in needed)


def test_python_blocks_import(tmp_path):
    lines = []
    for page in PAGES:
        for language, text in blocks(page):
            if language in ("python", "py"):
                lines.extend(line for line in import_lines(text)
                             if line not in lines and not needs_missing_package(line))
    assert any("syncbn" in line for line in lines), "no block imports syncbn"
    script = "\n".join(
        f"try:\n    {line}\nexcept Exception as error:\n    failed.append(f'{line}: {{error!r}}')"
        for line in lines)
    code = f"failed = []\n{script}\nassert not failed, '\\n'.join(failed)\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"`|\*\*?|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LMN")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for line in prose(page).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            result.add(base if count == 0 else f"{base}-{count}")
    return result


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in LINK.findall(prose(page)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
                continue  # http(s), mailto: not checked here
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}: no such file")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target}: no heading #{anchor} in {resolved.name}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("name", ["sync_overhead.png", "memory.png", "compile_ranks.png"])
def test_performance_pictures_are_shown(name):
    assert f"img/{name}" in (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
