"""Writes ``benchmarks/RESULTS.md`` from the benchmarks' result files (``benchmarks/results/*.json``,
see ``benchmarks/results.py``): per benchmark one table, headed by its machine, versions, date,
commit and command, with the sentences its run wrote on what the figures show.

    python benchmarks/report.py            # rewrite RESULTS.md
    python benchmarks/report.py --check    # exit 1 where RESULTS.md is not what the files make
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import RESULTS_DIR, ROOT, load, section  # noqa: E402

PAGE = ROOT / "benchmarks" / "RESULTS.md"

# The page's order: what a user asks first (the layer's speed) before how it is made.
ORDER = [
    "cuda",
    "cpu_layers",
    "cpu_fused",
    "cpu_masked",
    "lone_replica",
    "sync_overhead",
    "barrier_floor",
    "distributed",
    "compile_ranks",
    "toolchain",
    "memory",
    "import",
]

INTRO = """# Benchmark results

Each benchmark in `benchmarks/` writes its figures to `benchmarks/results/<name>.json`; this page is
made from those files by `python benchmarks/report.py` (do not edit it by hand). Every table is the
latest run of its benchmark, on the machine its header names; ratios are against the anchor
measured in the same run. The pictures of `docs/performance.md` come from the same files
(`benchmarks/plots.py`)."""


def page(directory: Path = RESULTS_DIR) -> str:
    """RESULTS.md as the result files in ``directory`` make it: the known ones in ORDER, then any
    other in name order."""
    names = ORDER + sorted(p.stem for p in directory.glob("*.json") if p.stem not in ORDER)
    results = [r for r in (load(name, directory) for name in names) if r is not None]
    return "\n\n".join([INTRO, *(section(r) for r in results)]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare RESULTS.md with what the files make; write nothing")
    args = parser.parse_args()
    text = page()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            sys.exit(f"{PAGE.relative_to(ROOT)} is not what benchmarks/results/*.json make: run python benchmarks/report.py")
        return
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)} ({text.count(chr(10))} lines)")


if __name__ == "__main__":
    main()
