"""torch.compile across ranks: a training step of the small ResNet under DDP over 2 Gloo ranks on
loopback (one intra-op thread each), compiled (``DDP(torch.compile(model, fullgraph=True))``,
Inductor, our layers' exchange in the graph as functional collectives) against eager, for our
converted model and for torch's unsynced ``nn.BatchNorm2d`` in the same model.

The model: ``resnet_step.small_resnet`` (stem + 8 basic blocks: 17 batch norms, residual
adds), a local batch of (8, 3, 16, 16) float32 per rank; one step is forward, loss, backward (no
optimizer). Every rank runs the same fixed sequence (collectives need all ranks): the four
contenders taken in turn over rounds, a fixed number of steps each; the slowest rank's median
counts. Compilation happens before timing (one warm-up step each).

Writes the result ``compile_ranks`` (``benchmarks/results/compile_ranks.json``, see
``benchmarks/results.py``; ``report.py`` puts it into RESULTS.md, ``plots.py`` draws
``docs/img/compile_ranks.png`` from it): a row per model, eager and compiled in ms and their ratio.

    python benchmarks/bench_compile_ranks.py                        # 10 steps a round, 7 rounds
    python benchmarks/bench_compile_ranks.py --quick --no-write     # 3 steps, 3 rounds; prints only
    python benchmarks/bench_compile_ranks.py --steps 1 --rounds 2 --results-dir /tmp/results
"""
from __future__ import annotations

import argparse
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

import results  # noqa: E402
from resnet_step import small_resnet  # noqa: E402
from results import Column  # noqa: E402
from testkit.local_group import run_local_group  # noqa: E402

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


COLUMNS = [
    Column("model", "model"),
    Column("eager_ms", "eager, ms", "{:.2f}"),
    Column("compiled_ms", "compiled (fullgraph, Inductor), ms", "{:.2f}"),
    Column("ratio", "compiled / eager", "{:.2f}x"),
]


def table_rows(times: dict[str, float]) -> list[dict]:
    """A row per model: the slowest rank's eager and compiled step, in ms."""
    rows = []
    for who, label in (("ours", "ours (synchronized)"), ("torch", "torch's nn.BatchNorm2d (unsynced)")):
        eager, compiled = times[f"{who} eager"] * 1e3, times[f"{who} compiled"] * 1e3
        rows.append({"model": label, "who": who, "eager_ms": round(eager, 3), "compiled_ms": round(compiled, 3),
                     "ratio": round(compiled / eager, 4)})
    return rows


def summary(rows: list[dict]) -> str:
    """What the table says: what compiling does to each model's step, and ours against torch's."""
    ours, theirs = rows
    return (
        f"Under torch.compile our synchronized model's DDP step takes {ours['ratio']:.2f}x the time of its eager step, "
        f"torch's unsynced model's {theirs['ratio']:.2f}x. Compiled, ours takes "
        f"{ours['compiled_ms'] / theirs['compiled_ms']:.2f}x torch's unsynced step ({ours['eager_ms'] / theirs['eager_ms']:.2f}x eager)."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 steps a round, 3 rounds (default: off, 10 and 7)")
    parser.add_argument("--steps", type=int, help="steps of each contender a round (default: 10, 3 with --quick)")
    parser.add_argument("--rounds", type=int, help="rounds taking the contenders in turn (default: 7, 3 with --quick)")
    results.add_output_options(parser)
    args = parser.parse_args()
    steps = args.steps or (3 if args.quick else 10)
    rounds = args.rounds or (3 if args.quick else 7)
    per_rank = run_local_group(rank_times, 2, steps, rounds, timeout_s=1200)
    rows = table_rows({name: max(rank[name] for rank in per_rank) for name in CONTENDERS})
    result = dict(
        title="torch.compile across ranks",
        method=f"The small ResNet (17 batch norms, residual adds), a local batch of (8, 3, 16, 16) float32, one training "
               f"step under DDP over 2 Gloo ranks (one intra-op thread each), {steps} steps of each contender in each of "
               f"{rounds} rounds taken in turn, compiled after one warm-up step; the slowest rank's median.",
        columns=COLUMNS, rows=rows, summary=summary(rows),
    )
    results.output(args, "compile_ranks", **result)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
