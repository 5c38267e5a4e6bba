"""torch.compile across ranks: a training step of the small ResNet under DDP over 2 Gloo ranks on
loopback (one intra-op thread each), compiled (``DDP(torch.compile(model, fullgraph=True))``,
Inductor, our layers' exchange in the graph as functional collectives) against eager, for our
converted model and for torch's unsynced ``nn.BatchNorm2d`` in the same model.

The model: ``bench_sync_overhead.small_resnet`` (stem + 8 basic blocks: 17 batch norms, residual
adds), a local batch of (8, 3, 16, 16) float32 per rank; one step is forward, loss, backward (no
optimizer). Every rank runs the same fixed sequence (collectives need all ranks): the four
contenders taken in turn over rounds, a fixed number of steps each; the slowest rank's median
counts. Compilation happens before timing (one warm-up step each).

    python benchmarks/bench_compile_ranks.py [--quick] [--no-write]
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from bench_cpu import cpu_model, publish  # noqa: E402
from bench_sync_overhead import small_resnet  # noqa: E402
from testkit.local_group import run_local_group  # noqa: E402

BEGIN, END = "<!-- bench_compile_ranks: begin -->", "<!-- bench_compile_ranks: end -->"
CONTENDERS = ("ours eager", "ours compiled", "torch eager", "torch compiled")


def rank_times(rank: int, world: int, steps: int, rounds: int) -> dict[str, float]:
    """Seconds per step of each contender on this rank (medians over the rounds)."""
    from torch.nn.parallel import DistributedDataParallel

    from syncbn import nn as NN

    torch.set_num_threads(1)
    torch.manual_seed(0)
    models = {}
    for name in CONTENDERS:
        torch.manual_seed(0)
        model = small_resnet()
        if name.startswith("ours"):
            model = NN.convert_sync_batchnorm(model)
        if name.endswith("compiled"):
            model = torch.compile(model, fullgraph=True, dynamic=False)
        models[name] = DistributedDataParallel(model, forward_sync_buffers=False)
    x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(rank))

    def step(model) -> None:
        model(x).square().mean().backward()

    for model in models.values():
        step(model)  # compiles
    samples: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for _ in range(rounds):
        for name, model in models.items():
            start = time.perf_counter()
            for _ in range(steps):
                step(model)
            samples[name].append((time.perf_counter() - start) / steps)
    return {name: median(values) for name, values in samples.items()}


def report(times: dict[str, float]) -> str:
    ms = {name: t * 1e3 for name, t in times.items()}
    lines = [
        BEGIN,
        "## torch.compile across ranks (bench_compile_ranks.py)",
        "",
        f"Machine: {os.cpu_count()}-core {cpu_model()}, no GPU; torch {torch.__version__}; {datetime.date.today()}. The small ResNet "
        "(17 batch norms, residual adds), a local batch of (8, 3, 16, 16) float32, one training step under DDP "
        "over 2 Gloo ranks (one intra-op thread each), ms, the slowest rank's median:",
        "",
        "| model | eager | compiled (fullgraph, Inductor) | compiled / eager |",
        "|---|---|---|---|",
    ]
    for who in ("ours", "torch"):
        eager, compiled = ms[f"{who} eager"], ms[f"{who} compiled"]
        label = "ours (synchronized)" if who == "ours" else "torch's nn.BatchNorm2d (unsynced)"
        lines.append(f"| {label} | {eager:.2f} | {compiled:.2f} | {compiled / eager:.2f}x |")
    lines.append(END)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    parser.add_argument("--no-write", action="store_true", help="print, do not touch RESULTS.md")
    args = parser.parse_args()
    steps, rounds = (3, 3) if args.quick else (10, 7)
    per_rank = run_local_group(rank_times, 2, steps, rounds, timeout_s=1200)
    times = {name: max(rank[name] for rank in per_rank) for name in CONTENDERS}
    text = report(times)
    publish(text, not args.no_write, BEGIN, END)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
