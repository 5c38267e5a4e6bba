"""What importing the library costs on top of ``import torch; import torch.nn``: seconds and
modules, in fresh processes (an import happens once a process, so ``torch.utils.benchmark``'s
repeated timing in one process cannot measure it).

Each run starts a new interpreter that times ``import torch, torch.nn``, then ``from syncbn import
nn; import syncbn.modules.parallel, syncbn.functions`` (``perf_counter`` around each), and counts the modules
the second import added and those of torch's compiler stack among them. Medians of ``--runs``.
``--root`` measures another checkout of the repository (say, an older commit in a git worktree).

Writes ``benchmarks/results/import.json`` (``benchmarks/results.py``; every run under ``runs``),
from which ``python benchmarks/report.py`` makes RESULTS.md.

    python benchmarks/bench_import.py                       # this checkout, 9 runs
    python benchmarks/bench_import.py --root DIR --root .   # another checkout beside this one
    python benchmarks/bench_import.py --runs 3 --no-write   # print only
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from statistics import median
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import add_output_options, output  # noqa: E402
from results import Column  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STACK = ("torch._dynamo", "torch._inductor", "torch.distributed.nn", "torch._functorch")

RUN = """
import json, sys, time
start = time.perf_counter()
import torch, torch.nn
torch_done = time.perf_counter()
before = set(sys.modules)
from syncbn import nn as NN
import syncbn.modules.parallel, syncbn.functions
ours_done = time.perf_counter()
added = set(sys.modules) - before
stack = [m for m in added if any(m == p or m.startswith(p + ".") for p in STACK)]
print(json.dumps({"torch": torch_done - start, "ours": ours_done - torch_done, "modules": len(added), "stack": len(stack)}))
"""


def one_run(root: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": root, "PYTHONWARNINGS": "ignore"}
    code = f"STACK = {STACK!r}\n" + RUN
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd=root)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(root: str, runs: int) -> dict[str, Any]:
    """The medians of ``runs`` fresh processes, the range of our import's time, and every run."""
    every = [one_run(root) for _ in range(runs)]
    ours = [r["ours"] for r in every]
    medians = {key: median(r[key] for r in every) for key in every[0]}
    return medians | {"ours_low": min(ours), "ours_high": max(ours), "runs": every}


def checkout(root: str) -> str:
    """"this checkout" for the one this script is in, else the other checkout's short commit."""
    if os.path.realpath(root) == os.path.realpath(HERE):
        return "this checkout"
    found = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return found.stdout.strip() or root


COLUMNS = [
    Column("checkout", "checkout"),
    Column("torch", "import torch, torch.nn, s", "{:.3f}"),
    Column("ours", "our import after it, s", "{:.3f}"),
    Column("ours_low", "fastest, s", "{:.3f}"),
    Column("ours_high", "slowest, s", "{:.3f}"),
    Column("modules", "modules it adds", "{:.0f}"),
    Column("stack", "of them torch's compiler stack", "{:.0f}"),
]


def summary(rows: list[dict[str, Any]], runs: int) -> str:
    first, *others = rows
    processes = f"{runs} fresh process{'es' if runs != 1 else ''}"
    text = (
        f"Importing the library after torch takes {first['ours']:.3f} s ({first['ours_low']:.3f}-{first['ours_high']:.3f} "
        f"s over {processes}; torch's own import {first['torch']:.3f} s) and adds {first['modules']:.0f} modules, "
        f"{first['stack']:.0f} of them from torch's compiler stack."
    )
    return " ".join([text, *(f"{r['checkout']}: {r['ours']:.3f} s and {r['modules']:.0f} modules "
                             f"({r['stack']:.0f} of the stack)." for r in others)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=9, help="fresh processes per checkout (default: 9)")
    parser.add_argument("--root", action="append", help="a checkout to measure (repeatable; default: this one)")
    add_output_options(parser)
    args = parser.parse_args()
    rows = [{"checkout": checkout(root), **measure(root, args.runs)} for root in args.root or [HERE]]
    runs = {row["checkout"]: row.pop("runs") for row in rows}
    output(
        args, "import", title="Import time", columns=COLUMNS, rows=rows, summary=summary(rows, args.runs),
        method=f"Fresh interpreters, perf_counter around `import torch, torch.nn` and then around our imports "
        f"(`from syncbn import nn; import syncbn.modules.parallel, syncbn.functions`), medians of {args.runs} runs; "
        f"the compiler stack is the modules under {', '.join(STACK)}.",
        runs=runs,
    )


if __name__ == "__main__":
    main()
