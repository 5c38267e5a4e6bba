"""Synchronized batch norm across processes: time per layer and the collectives it runs.

    python benchmarks/bench_distributed.py [--processes 2] [--number 50] [--repeats 5]

Starts N local processes (Gloo on loopback, CPU, one intra-op thread each) and, in each of
them, times forward + backward (with the input gradient, as inside a network) of ONE batch norm
layer wrapped in DistributedDataParallel, with ``torch.utils.benchmark``: our
``SyncBatchNorm2d`` (statistics over all ranks) against plain ``nn.BatchNorm2d`` (per-rank
statistics) under the same DDP run, so that DDP's own gradient all_reduce is in both. Every
rank runs the same fixed number of iterations (collectives need all ranks), and the slowest
rank's median is reported. Then it counts the collectives that our layers run per training
step of a small net, with their sizes.
"""
from __future__ import annotations

import argparse
import os
import sys
from statistics import median

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils import benchmark

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--number", type=int, default=50, help="iterations per measurement")
    parser.add_argument("--repeats", type=int, default=5, help="measurements (median)")
    args = parser.parse_args()
    results = run_local_group(run_rank, args.processes, args.number, args.repeats, timeout_s=120)
    print(f"torch {torch.__version__}, {args.processes} Gloo processes on loopback, 1 thread each, float32")
    print(
        "| per-rank input (N, C, H, W) | SyncBatchNorm2d under DDP | nn.BatchNorm2d under DDP | ratio "
        "| our kernels alone (no DDP, no collectives) |"
    )
    print("|---|---|---|---|---|")
    for shape in SHAPES:
        ours, plain, alone = (max(r["times"][shape][k] for r in results) for k in range(3))
        print(f"| {shape} | {ours * 1e6:.0f} us | {plain * 1e6:.0f} us | {ours / plain:.2f} | {alone * 1e6:.0f} us |")
    counts = results[0]["counts"]
    total = sum(len(v) for v in counts.values())
    print(f"\ncollectives of our layers in one training step of a net with 3 SyncBatchNorm2d (16, 32, 64 channels): {total}")
    for name, sizes in counts.items():
        print(f"  {name}: {len(sizes)} calls, float64 elements sent per call by this rank: {sizes} "
              f"({', '.join(f'{8 * n} B' for n in sizes)})")


if __name__ == "__main__":
    main()
