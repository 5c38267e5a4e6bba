"""Synchronized batch norm across processes: time per layer and the collectives it runs.

Starts N local processes (Gloo on loopback, CPU, one intra-op thread each) and, in each of
them, times forward + backward (with the input gradient, as inside a network) of ONE batch norm
layer wrapped in DistributedDataParallel, with ``torch.utils.benchmark``: our
``SyncBatchNorm2d`` (statistics over all ranks) against plain ``nn.BatchNorm2d`` (per-rank
statistics) under the same DDP run, so that DDP's own gradient all_reduce is in both. Every
rank runs the same fixed number of iterations (collectives need all ranks), and the slowest
rank's median is reported. Then it counts the collectives that our layers run per training
step of a small net, with their sizes.

Writes the result ``distributed`` (``benchmarks/results/distributed.json``, see
``benchmarks/results.py``; ``report.py`` puts it into RESULTS.md): a row per input shape, and the
collectives counted under ``collectives`` ({name: float64 elements sent per call by a rank}).

    python benchmarks/bench_distributed.py                          # 2 processes, 50 iterations, 5 measurements
    python benchmarks/bench_distributed.py --processes 4 --no-write  # prints only
    python benchmarks/bench_distributed.py --number 5 --repeats 2 --results-dir /tmp/results
"""
from __future__ import annotations

import argparse
import os
import sys
from statistics import median

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils import benchmark

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import results  # noqa: E402  (benchmarks/ is on the path as a script)
from results import Column  # noqa: E402
from syncbn.functions import sync_batch_norm  # noqa: E402
from testkit.collectives import count_collectives  # noqa: E402
from testkit.local_group import run_local_group  # noqa: E402
from syncbn import nn as NN  # noqa: E402

SHAPES = [(8, 64, 28, 28), (4, 256, 14, 14), (32, 32, 8, 8)]  # per rank, float32


def time_layer(layer: nn.Module, shape: tuple[int, ...], number: int, repeats: int) -> float:
    """Median seconds of one forward + backward of ``layer`` under DDP on this rank's batch."""
    model = DistributedDataParallel(layer, forward_sync_buffers=False)
    x = torch.randn(shape, requires_grad=True)
    grad = torch.randn(shape)
    timer = benchmark.Timer("model(x).backward(grad)", globals=dict(model=model, x=x, grad=grad))
    return median(timer.timeit(number).median for _ in range(repeats))


def time_kernels_alone(channels: int, shape: tuple[int, ...], number: int, repeats: int) -> float:
    """Median seconds of our forward + backward through the same kernels, without collectives
    and without DDP (``functions.sync_batch_norm`` with no replica or process call)."""
    layer = NN.SyncBatchNorm2d(channels)
    x = torch.randn(shape, requires_grad=True)
    grad = torch.randn(shape)
    stmt = "sync_batch_norm(x, layer.running_mean, layer.running_var, layer.weight, layer.bias).backward(grad)"
    timer = benchmark.Timer(stmt, globals=dict(sync_batch_norm=sync_batch_norm, layer=layer, x=x, grad=grad))
    return median(timer.timeit(number).median for _ in range(repeats))


def small_net() -> nn.Module:
    return NN.convert_sync_batchnorm(
        nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64),
        )
    )


def collectives_per_step() -> dict[str, list[int]]:
    """Our collectives in one training step (forward + backward) of a net of 3 sync layers."""
    model = DistributedDataParallel(small_net(), forward_sync_buffers=False)
    x = torch.randn(4, 3, 16, 16)
    model(x).sum().backward()  # the first step (DDP prepares its buckets)
    with count_collectives() as counts:
        model(x).sum().backward()
    return counts


def run_rank(rank: int, world: int, number: int, repeats: int) -> dict:
    times = {}
    for shape in SHAPES:
        channels = shape[1]
        times[shape] = (
            time_layer(NN.SyncBatchNorm2d(channels), shape, number, repeats),
            time_layer(nn.BatchNorm2d(channels), shape, number, repeats),
            time_kernels_alone(channels, shape, number, repeats),
        )
    return dict(times=times, counts=collectives_per_step())


COLUMNS = [
    Column("shape", "per-rank input (N, C, H, W)"),
    Column("ours_us", "SyncBatchNorm2d under DDP, us", "{:.0f}"),
    Column("torch_us", "nn.BatchNorm2d under DDP, us", "{:.0f}"),
    Column("ratio", "ours / torch's", "{:.2f}x"),
    Column("alone_us", "our kernels alone (no DDP, no collectives), us", "{:.0f}"),
]


def table_rows(per_rank: list[dict]) -> list[dict]:
    """A row per shape: the slowest rank's medians, in us."""
    rows = []
    for shape in SHAPES:
        ours, plain, alone = (max(r["times"][shape][k] for r in per_rank) * 1e6 for k in range(3))
        rows.append({"shape": str(shape), "ours_us": round(ours, 2), "torch_us": round(plain, 2),
                     "ratio": round(ours / plain, 4), "alone_us": round(alone, 2)})
    return rows


def difference_text(extra: list[float]) -> str:
    """The layers' extra time in words; a negative difference (this run's noise) is never written as a cost."""
    if min(extra) >= 0:
        return f"{min(extra):.0f}-{max(extra):.0f} us more"
    return f"up to {max(extra):.0f} us more; in {sum(e < 0 for e in extra)} of {len(extra)} rows none, within this run's noise"


def summary(rows: list[dict], processes: int, counts: dict[str, list[int]]) -> str:
    """What the table says, and the collectives counted."""
    ratios = [r["ratio"] for r in rows]
    extra = [r["ours_us"] - r["torch_us"] for r in rows]
    calls = ", ".join(f"{len(sizes)} {name} of {min(sizes)}-{max(sizes)} float64" for name, sizes in counts.items() if sizes)
    return (
        f"Under DDP over {processes} Gloo processes one synchronized layer takes {min(ratios):.2f}-{max(ratios):.2f}x "
        f"torch's per-rank batch norm ({difference_text(extra)}), against "
        f"{min(r['alone_us'] for r in rows):.0f}-{max(r['alone_us'] for r in rows):.0f} us for our kernels alone, without "
        f"DDP or collectives. A training step of a net with 3 synchronized layers made {sum(map(len, counts.values()))} "
        f"collectives of ours: {calls} (elements a rank sends)."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2, help="Gloo processes (default: %(default)s)")
    parser.add_argument("--number", type=int, default=50, help="iterations per measurement (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="measurements, their median counts (default: %(default)s)")
    results.add_output_options(parser)
    args = parser.parse_args()
    per_rank = run_local_group(run_rank, args.processes, args.number, args.repeats, timeout_s=120)
    rows = table_rows(per_rank)
    counts = {name: list(sizes) for name, sizes in per_rank[0]["counts"].items()}
    result = dict(
        title="Synchronized batch norm across processes (Gloo, CPU)",
        method=f"Forward + backward (input gradient) of one layer under DistributedDataParallel on {args.processes} Gloo "
               f"processes on loopback, one intra-op thread each, float32: medians of {args.repeats} measurements of "
               f"{args.number} iterations, the slowest rank's; our kernels alone run functions.sync_batch_norm without "
               f"DDP or a process group.",
        columns=COLUMNS, rows=rows, summary=summary(rows, args.processes, counts), processes=args.processes,
        collectives=counts,
    )
    results.output(args, "distributed", **result)


if __name__ == "__main__":
    main()
