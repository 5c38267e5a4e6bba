"""What a training step's activations cost in memory: in-place activated batch norm against
torch's batch norm + LeakyReLU(inplace=True), on the CPU.

The net: 8 blocks of a 3x3 convolution (no bias) and a batch norm with LeakyReLU (64 channels;
the first convolution takes 3), then a classifier head (global average pool, linear, 10 classes),
on a batch of (B, 3, 64, 64) float32; one training step: forward, cross-entropy loss, backward. Contenders, each in a fresh process:

- ``torch``: ``nn.BatchNorm2d`` + ``nn.LeakyReLU(inplace=True)`` (autograd keeps the batch
  norm's input and the activation's output: two full-size tensors per block);
- ``ours-fused``: ``SyncBatchNorm2d(activation="leaky_relu")`` (one layer, keeps its input);
- ``ours-inplace``: ``InPlaceABN`` (writes over its input, keeps only its output: one).

Both in the contiguous layout and in channels_last (models and input). Memory is the process's resident set (Linux ``/proc/self/status``): the step's peak (``VmHWM``,
reset through ``/proc/self/clear_refs`` just before the step) over the resting memory after a
warm-up step (model, gradients, input allocated; freed memory handed back with ``malloc_trim``
and large blocks mmapped, ``MALLOC_MMAP_THRESHOLD_``, so that freed memory does not hide in the
heap). Then the largest batch whose step peak fits a budget (``--budget-mib``), found by bisection,
a fresh process per trial.

The convolutions' own backward holds workspace beyond its input and output (in the contiguous
layout about two full-size tensors, the same for every contender), which the ratio carries too.

Writes the result ``memory`` (``benchmarks/results/memory.json``, see ``benchmarks/results.py``;
``report.py`` puts it into RESULTS.md, ``plots.py`` draws ``docs/img/memory.png`` from it): a row per
layout and contender, with its peak over resting memory, its ratio to torch's, and the largest batch
that fits the budget (torch and ``ours-inplace``); the batch and the budget are kept as ``batch`` and
``budget_mib``.

    python benchmarks/bench_memory.py                              # batch 16, a 1024 MiB budget
    python benchmarks/bench_memory.py --quick --no-write           # batch 4, a 256 MiB budget; prints only
    python benchmarks/bench_memory.py --quick --budget-mib 16 --results-dir /tmp/results
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import results  # noqa: E402  (benchmarks/ is on the path as a script)
from results import Column  # noqa: E402
from syncbn import nn as NN  # noqa: E402

CONTENDERS = ("torch", "ours-fused", "ours-inplace")
LAYOUTS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}
BLOCKS, CHANNELS, SIDE, CLASSES = 8, 64, 64, 10
MIB = 2**20


def norm_act(kind: str) -> list[nn.Module]:
    if kind == "torch":
        return [nn.BatchNorm2d(CHANNELS), nn.LeakyReLU(0.01, inplace=True)]
    if kind == "ours-fused":
        return [NN.SyncBatchNorm2d(CHANNELS, activation="leaky_relu", negative_slope=0.01)]
    return [NN.InPlaceABN(CHANNELS, activation="leaky_relu", activation_param=0.01)]


def net(kind: str) -> nn.Module:
    """The blocks, then a classifier head (global average pool, linear over 10 classes)."""
    layers: list[nn.Module] = []
    for block in range(BLOCKS):
        layers += [nn.Conv2d(3 if block == 0 else CHANNELS, CHANNELS, 3, padding=1, bias=False), *norm_act(kind)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(CHANNELS, CLASSES))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _settle() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def measure_step(kind: str, batch: int, layout: str) -> dict:
    """In this process: the step's peak resident memory over the resting memory, in bytes."""
    torch.manual_seed(0)
    memory_format = LAYOUTS[layout]
    model = net(kind).to(memory_format=memory_format)
    x = torch.randn(batch, 3, SIDE, SIDE).contiguous(memory_format=memory_format)
    labels = torch.randint(CLASSES, (batch,))

    def step() -> None:
        nn.functional.cross_entropy(model(x), labels).backward()

    step()  # warm-up: gradients allocated, kernels and caches ready
    _settle()
    resting = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    step()
    peak = _status_kib("VmHWM")
    return {"kind": kind, "layout": layout, "batch": batch, "resting": resting * 1024, "over": (peak - resting) * 1024}


def in_fresh_process(kind: str, batch: int, layout: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    out = subprocess.run(
        [sys.executable, __file__, "--one", kind, "--batch", str(batch), "--layout", layout],
        env=env, check=True, capture_output=True, text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def largest_batch(kind: str, layout: str, budget: int, low: int, high: int) -> int:
    """The largest batch in [low, high] whose step fits ``budget`` bytes (bisection: the peak
    grows with the batch); ``low - 1`` where none does."""
    best = low - 1
    while low <= high:
        middle = (low + high) // 2
        if in_fresh_process(kind, middle, layout)["over"] <= budget:
            best, low = middle, middle + 1
        else:
            high = middle - 1
    return best


def columns(budget_mib: int) -> list[Column]:
    return [
        Column("layout", "layout"),
        Column("contender", "contender"),
        Column("over_mib", "step peak over resting, MiB", "{:.1f}"),
        Column("ratio", "against torch", "{:.3f}x"),
        Column("fits", f"largest batch within {budget_mib} MiB", "{}"),
    ]


def table_rows(measured: list[dict], fits: dict[tuple[str, str], int]) -> list[dict]:
    """A row per layout and contender: the peak over resting memory, its ratio to torch's in the
    same layout, and the largest batch that fits the budget where searched."""
    torch_over = {r["layout"]: r["over"] for r in measured if r["kind"] == "torch"}
    return [
        {"layout": r["layout"], "contender": r["kind"], "over_mib": round(r["over"] / MIB, 2),
         "ratio": round(r["over"] / torch_over[r["layout"]], 4), "fits": fits.get((r["kind"], r["layout"])),
         "resting_mib": round(r["resting"] / MIB, 2)}
        for r in measured
    ]


def summary(rows: list[dict], budget_mib: int) -> str:
    """What the table says: each of ours against torch, and the batches the budget fits."""
    def find(layout: str, contender: str) -> dict:
        return next(r for r in rows if r["layout"] == layout and r["contender"] == contender)

    def each(contender: str, key: str, pattern: str) -> str:
        return " and ".join(pattern.format(find(layout, contender)[key]) for layout in LAYOUTS)

    return (
        f"Above resting memory, InPlaceABN's training step needs {each('ours-inplace', 'ratio', '{:.2f}x')} of what "
        f"torch's batch norm + LeakyReLU needs in the {' and '.join(LAYOUTS)} layouts (SyncBatchNorm2d with its fused "
        f"activation: {each('ours-fused', 'ratio', '{:.2f}x')}). Within {budget_mib} MiB it fits a batch of "
        f"{each('ours-inplace', 'fits', '{}')}, torch's layers {each('torch', 'fits', '{}')}."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, help="batch of the measured step (default: 16, 4 with --quick)")
    parser.add_argument("--budget-mib", type=int, help="the budget of the largest-batch search (default: 1024, 256 with --quick)")
    parser.add_argument("--quick", action="store_true", help="batch 4, budget 256 MiB (default: off)")
    results.add_output_options(parser)
    parser.add_argument("--one", choices=CONTENDERS, help=argparse.SUPPRESS)  # a fresh process's own run
    parser.add_argument("--layout", choices=list(LAYOUTS), default="contiguous", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    batch = args.batch or (4 if args.quick else 16)
    if args.one:
        print(json.dumps(measure_step(args.one, batch, args.layout)))
        return
    budget_mib = args.budget_mib or (256 if args.quick else 1024)
    measured = [in_fresh_process(kind, batch, layout) for layout in LAYOUTS for kind in CONTENDERS]
    for r in measured:
        print(f"{r['layout']:>13} {r['kind']:>13}: {r['over'] / MIB:8.1f} MiB over {r['resting'] / MIB:.1f} MiB resting")
    high = 4 * batch * budget_mib * MIB // max(1, measured[0]["over"]) + 1
    fits = {(kind, layout): largest_batch(kind, layout, budget_mib * MIB, 1, high) for layout in LAYOUTS for kind in ("torch", "ours-inplace")}
    rows = table_rows(measured, fits)
    result = dict(
        title="Activation memory of a training step",
        method=f"{BLOCKS} blocks of conv 3x3 + batch norm + LeakyReLU ({CHANNELS} channels) and a pooled linear head, "
               f"batch ({batch}, 3, {SIDE}, {SIDE}) float32, cross-entropy: the step's peak resident memory over the "
               f"resting memory, each contender in a fresh process, and the largest batch within the budget by bisection.",
        columns=columns(budget_mib), rows=rows, summary=summary(rows, budget_mib), batch=batch, budget_mib=budget_mib,
    )
    results.output(args, "memory", **result)


if __name__ == "__main__":
    main()
