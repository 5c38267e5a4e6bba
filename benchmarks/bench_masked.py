"""CPU benchmark of ``mask=`` (statistics over the valid positions of a padded batch).

Per case (shape, layout, dtype), forward + backward (torch.autograd.grad for input, weight and
bias) of our layer on one replica with a mask of padded images (each sample valid in a top-left
rectangle, about 70% of the positions), against the same layer without a mask (the anchor:
what the mask costs), against ``nn.BatchNorm`` without a mask, and against masked batch norm
written by hand in torch ops (what users write without ``mask=``). Then, for synchronized
replicas, what synchronizing adds per layer with and without a mask: a small layer's step under
ThreadedDataParallel with 2 replicas against the same layer alone, masked and unmasked.

    python benchmarks/bench_masked.py                 # every case, ~3 minutes on 2 cores
    python benchmarks/bench_masked.py --quick         # the (32, 64, 56, 56) float32 cases only
    python benchmarks/bench_masked.py --quick --no-write

Writes ``benchmarks/results/cpu_masked.json`` (``python benchmarks/report.py`` makes RESULTS.md).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

import torch
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu import Case, allocator, timing_method  # noqa: E402
from results import Column, add_output_options, output, span  # noqa: E402
from timing import copy_bandwidth_gbs, interleaved_medians, interleaved_samples  # noqa: E402
from syncbn import nn as NN  # noqa: E402
from syncbn.modules.parallel import ThreadedDataParallel  # noqa: E402

Row = dict[str, Any]


def cases(quick: bool) -> list[Case]:
    shapes = [(32, 64, 56, 56)] if quick else [(32, 64, 56, 56), (8, 256, 28, 28)]
    dtypes = [torch.float32] if quick else [torch.float32, torch.bfloat16]
    out = [Case(s, cl, d) for s in shapes for cl in (False, True) for d in dtypes]
    return out if quick else out + [Case((16, 256, 400), False, torch.float32)]


def padded_images_mask(shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    """(N, *spatial): sample i valid in a leading block of each spatial dim, 60-100% of its size."""
    n, spatial = shape[0], shape[2:]
    mask = torch.ones(n, *spatial, dtype=torch.bool)
    for i in range(n):
        for d, size in enumerate(spatial):
            keep = int(size * (0.6 + 0.4 * torch.rand(1, generator=generator).item()))
            mask[(i, *([slice(None)] * d), slice(keep, None))] = False
    return mask


class ByHand(nn.Module):
    """Masked batch norm in torch ops, as users write it: the statistics of the valid positions
    by sums over ``where``, every position normalized, autograd for the backward."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(channels)), nn.Parameter(torch.zeros(channels))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        valid = mask.unsqueeze(1)
        dims = [0, *range(2, x.dim())]
        shape = (1, -1) + (1,) * (x.dim() - 2)
        count = mask.sum()
        mean = torch.where(valid, x, 0).sum(dims) / count
        xmu = x - mean.view(shape)
        var = torch.where(valid, xmu, 0).square().sum(dims) / count
        return xmu * torch.rsqrt(var + 1e-5).view(shape) * self.weight.view(shape) + self.bias.view(shape)


def layer_for(case: Case) -> nn.Module:
    return {3: NN.BatchNorm1d, 4: NN.BatchNorm2d}[len(case.shape)](case.shape[1])


def step(model: nn.Module, x: Tensor, dy: Tensor, **kwargs: Tensor) -> Callable[[], object]:
    params = list(model.parameters())
    return lambda: torch.autograd.grad(model(x, **kwargs), [x, *params], dy)


def time_row(case: Case, min_run_time: float, generator: torch.Generator) -> Row:
    x = case.input()
    dy = torch.randn_like(x)
    mask = padded_images_mask(case.shape, generator)
    ours, torchs, by_hand = layer_for(case), {3: nn.BatchNorm1d, 4: nn.BatchNorm2d}[len(case.shape)](case.shape[1]), ByHand(case.shape[1])
    t = interleaved_medians({
        "ours": step(ours, x, dy), "ours masked": step(ours, x, dy, mask=mask),
        "torch": step(torchs, x, dy), "by hand": step(by_hand, x, dy, mask=mask),
    }, min_run_time)
    row = case.fields()
    row.update({"valid": mask.float().mean().item(), "ours_ms": t["ours"], "masked_ms": t["ours masked"],
                "masked": t["ours masked"] / t["ours"], "torch": t["torch"] / t["ours"], "by_hand": t["by hand"] / t["ours masked"]})
    print(row["case"], {key: round(value, 2) for key, value in t.items()}, flush=True)
    return row


def sync_row(min_run_time: float, generator: torch.Generator) -> Row:
    """What synchronizing 2 thread replicas adds to a small layer's step, masked and unmasked:
    median difference (us) against the same layer alone, ± half the range over the rounds."""
    shape = (8, 64, 8, 8)
    x, dy = torch.randn(shape).requires_grad_(), torch.randn(shape)
    mask = padded_images_mask(shape, generator)
    layer = NN.BatchNorm2d(64)
    threads = ThreadedDataParallel(layer, ["cpu"] * 2)
    fns = {(who, masked): step(model, x, dy, **({"mask": mask} if masked else {}))
           for who, model in (("alone", layer), ("threads", threads)) for masked in (False, True)}
    samples = interleaved_samples(fns, min_run_time)
    row: Row = {"case": f"{shape} NCHW float32, 2 thread replicas"}
    for masked, key in ((False, "unmasked"), (True, "masked")):
        added = [1e6 * (t - a) for t, a in zip(_medians(samples[("threads", masked)]), _medians(samples[("alone", masked)]))]
        added.sort()
        row[f"{key}_sync_us"], row[f"{key}_spread_us"] = added[len(added) // 2], (added[-1] - added[0]) / 2
    print(row, flush=True)
    return row


def _medians(rounds: list[list[float]]) -> list[float]:
    return [sorted(r)[len(r) // 2] for r in rounds]


COLUMNS = [
    Column("case", "input"),
    Column("valid", "valid positions", "{:.0%}"),
    Column("ours_ms", "ours, no mask, ms", "{:.2f}"),
    Column("masked", "ours masked, x ours", "{:.2f}x"),
    Column("torch", "nn.BatchNorm (no mask), x ours", "{:.2f}x"),
    Column("by_hand", "masked by hand, x ours masked", "{:.2f}x"),
    Column("unmasked_sync_us", "2 replicas add, no mask, us", "{:.1f}"),
    Column("masked_sync_us", "2 replicas add, masked, us", "{:.1f}"),
]


def summary(rows: list[Row], sync: Row) -> str:
    return (
        f"On one replica a mask costs {span(r['masked'] for r in rows)} the time of the same layer without one "
        f"(forward + backward); masked batch norm written by hand in torch ops takes {span(r['by_hand'] for r in rows)} "
        f"the time of ours. Synchronizing 2 thread replicas adds {sync['unmasked_sync_us']:.0f} ± "
        f"{sync['unmasked_spread_us']:.0f} us per layer without a mask and {sync['masked_sync_us']:.0f} ± "
        f"{sync['masked_spread_us']:.0f} us with one."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only (32, 64, 56, 56) float32 (default: every case)")
    parser.add_argument("--min-run-time", type=float, default=1.0, help="seconds per contender and case (default: 1.0)")
    add_output_options(parser)
    args = parser.parse_args()
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    method = timing_method(args.min_run_time, copy_bandwidth_gbs(args.min_run_time), allocator())
    rows = [time_row(case, args.min_run_time, generator) for case in cases(args.quick)]
    sync = sync_row(args.min_run_time, generator)
    rows.append(sync)
    what = ("forward + backward is a training-mode forward and torch.autograd.grad for input, weight and bias; the "
            "mask is padded images' (each sample valid in a leading block of every spatial dim); `masked by hand` is "
            "the statistics of the valid positions in torch ops with autograd; the last row is what "
            "ThreadedDataParallel with 2 replicas adds to a layer's step, median difference over the rounds")
    output(args, "cpu_masked", title="CPU: mask= (statistics over the valid positions of a padded batch)",
           method=method(what), columns=COLUMNS, rows=rows, summary=summary(rows[:-1], sync),
           min_run_time=args.min_run_time)


if __name__ == "__main__":
    main()
