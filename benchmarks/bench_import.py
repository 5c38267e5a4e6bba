"""What importing the library costs on top of ``import torch; import torch.nn``: seconds and
modules, in fresh processes (an import happens once a process, so ``torch.utils.benchmark``'s
repeated timing in one process cannot measure it).

Each run starts a new interpreter that times ``import torch, torch.nn``, then ``from syncbn import
nn; import syncbn.modules.parallel, syncbn.functions`` (``perf_counter`` around each), and counts the modules
the second import added and those of torch's compiler stack among them. Medians of ``--runs``.
``--root`` measures another checkout of the repository (say, an older commit in a git worktree).

    python benchmarks/bench_import.py [--runs 9] [--root DIR] [--no-write]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from statistics import median

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu import cpu_model, publish  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- bench_import: begin -->", "<!-- bench_import: end -->"
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


def one_run(root: str) -> dict:
    env = {**os.environ, "PYTHONPATH": root, "PYTHONWARNINGS": "ignore"}
    code = f"STACK = {STACK!r}\n" + RUN
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd=root)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(root: str, runs: int) -> dict:
    results = [one_run(root) for _ in range(runs)]
    return {key: median(r[key] for r in results) for key in results[0]} | {
        "ours_range": (min(r["ours"] for r in results), max(r["ours"] for r in results))
    }


def commit_of(root: str) -> str:
    found = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return found.stdout.strip() or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--root", action="append", help="a checkout to measure (repeatable; default: this one)")
    parser.add_argument("--no-write", action="store_true", help="print, do not touch RESULTS.md")
    args = parser.parse_args()
    roots = args.root or [HERE]
    import torch

    lines = [
        BEGIN,
        "## Import time (bench_import.py)",
        "",
        f"Machine: {os.cpu_count()}-core {cpu_model()} ({torch.backends.cpu.get_cpu_capability()}) VM; torch "
        f"{torch.__version__}, Python {platform.python_version()}; {datetime.date.today().isoformat()}. Fresh "
        f"processes, medians of {args.runs} runs, seconds.",
        "",
        "| checkout | `import torch, torch.nn` | our import after it (range) | modules it adds | of them torch's compiler stack |",
        "|---|---|---|---|---|",
    ]
    for root in roots:
        m = measure(root, args.runs)
        low, high = m["ours_range"]
        lines.append(
            f"| {commit_of(root)} | {m['torch']:.3f} | {m['ours']:.3f} ({low:.3f}-{high:.3f}) | {m['modules']:.0f} | {m['stack']:.0f} |"
        )
    lines.append(END)
    section = "\n".join(lines)
    publish(section, not args.no_write, BEGIN, END)


if __name__ == "__main__":
    main()
