"""The benchmarks' results, machine-readable: each run of a benchmark writes one JSON file,
``benchmarks/results/<name>.json``, which replaces that benchmark's previous one (history lives in
git). ``benchmarks/report.py`` makes ``benchmarks/RESULTS.md`` from these files and
``benchmarks/plots.py`` the pictures; nothing reads figures back out of markdown.

A result file holds::

    {"name": "cpu_layers",                  # the file's stem
     "title": "...",                        # the heading of its table
     "machine": {...},                      # machine(): CPU, cores, GPU, torch, CUDA, Python, kernels
     "date": "2026-11-27", "commit": "1a2b3c4",
     "command": "python benchmarks/bench_cpu.py --part layers",
     "method": "...",                       # how it was measured, one sentence
     "columns": [{"key": "shape", "label": "input", "format": "{}"}, ...],
     "rows": [{"shape": "(32, 64, 56, 56)", ...}, ...],
     "summary": "..."}                      # two or three sentences on what the figures show
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class Column:
    """One column of a result's table: the row key it shows, its heading, and how a value is written
    (a ``str.format`` pattern; a missing or None value is written as "-")."""

    key: str
    label: str
    format: str = "{}"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """What the figures were measured on: CPU (model and torch's capability), cores, torch's
    threads, GPU (name, memory, SMs; None without CUDA), torch, CUDA and Python versions, and
    which of our kernels served (``syncbn.functions.backend_info``)."""
    from syncbn.functions import backend_info

    gpu = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = f"{props.name} ({props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs)"
    return {
        "cpu": f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()})",
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "kernels": backend_info(),
    }


def commit() -> str:
    """The checkout's short commit, "+changes" where the package's files differ from it; "unknown"
    outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--", "modules", "functions", "src", "syncbn", "benchmarks/*.py")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if changed else "")


def record(name: str, *, title: str, method: str, columns: list[Column], rows: list[dict[str, Any]],
           summary: str, **extra: Any) -> dict[str, Any]:
    """Benchmark result ``name`` (see the module's docstring) with this machine, today's date, the
    commit and the command line; ``extra`` keys (settings a plot needs) are kept as given."""
    return {
        "name": name,
        "title": title,
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
        "commit": commit(),
        "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
        "method": method,
        "columns": [asdict(column) for column in columns],
        "rows": rows,
        "summary": summary,
        **extra,
    }


def write(result: dict[str, Any], directory: Path | None = None) -> Path:
    """Write ``result`` (:func:`record`) as ``<directory>/<name>.json``, replacing the previous
    one. Returns the file's path."""
    path = (directory or RESULTS_DIR) / f"{result['name']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def load(name: str, directory: Path | None = None) -> dict[str, Any] | None:
    """Result ``name``, or None where no run has written it."""
    path = (directory or RESULTS_DIR) / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def cell(value: Any, pattern: str) -> str:
    """``value`` as a table writes it: "-" where missing."""
    return "-" if value is None else pattern.format(value)


def table(result: dict[str, Any]) -> str:
    """The result's rows as a markdown table, in its columns' order and formats."""
    columns = result["columns"]
    lines = ["| " + " | ".join(c["label"] for c in columns) + " |", "|" + "---|" * len(columns)]
    for row in result["rows"]:
        lines.append("| " + " | ".join(cell(row.get(c["key"]), c["format"]) for c in columns) + " |")
    return "\n".join(lines)


def machine_text(machine: dict[str, Any]) -> str:
    """One line naming what the figures were measured on."""
    where = machine["gpu"] or f"{machine['cores']}-core {machine['cpu']}, {machine['torch_threads']} torch threads"
    cuda = f" (CUDA {machine['cuda']})" if machine.get("cuda") else ""
    return f"{where}; torch {machine['torch']}{cuda}, Python {machine['python']}; kernels {machine['kernels']}"


def section(result: dict[str, Any]) -> str:
    """One result as RESULTS.md shows it: its title, a header naming machine, versions, date,
    commit and command, the method, the table and the summary."""
    header = (
        f"*{machine_text(result['machine'])}; {result['date']}, commit `{result['commit']}`; "
        f"`{result['command']}`.* {result['method']}"
    )
    return "\n\n".join([f"## {result['title']}", header, table(result), result["summary"]])


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """The options every benchmark takes for its result file."""
    parser.add_argument("--no-write", action="store_true",
                        help="print the table only, write no file (default: write it)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR,
                        help="the folder for the result's <name>.json (default: benchmarks/results)")


def output(args: argparse.Namespace, name: str, **fields: Any) -> None:
    """Print result ``name`` as RESULTS.md shows it (:func:`section`); write it unless --no-write."""
    result = record(name, **fields)
    print("\n" + section(result))
    if not args.no_write:
        print(f"wrote {write(result, args.results_dir)}")


def span(values: Iterable[float], unit: str = "x", digits: int = 2) -> str:
    """The range of ``values`` in a summary: "0.58-0.86x", or "0.58x" where both ends round alike."""
    values = list(values)
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return f"{low}{unit}" if low == high else f"{low}-{high}{unit}"
