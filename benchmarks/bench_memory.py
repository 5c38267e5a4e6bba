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

    python benchmarks/bench_memory.py [--batch 16] [--budget-mib 1024] [--quick] [--no-write]
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
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

from bench_cpu import cpu_model, publish  # noqa: E402  (benchmarks/ is on the path as a script)
from syncbn.functions import backend_info  # noqa: E402
from syncbn import nn as NN  # noqa: E402

CONTENDERS = ("torch", "ours-fused", "ours-inplace")
LAYOUTS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}
BLOCKS, CHANNELS, SIDE, CLASSES = 8, 64, 64, 10
BEGIN, END = "<!-- bench_memory: begin -->", "<!-- bench_memory: end -->"
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


def report(batch: int, rows: list[dict], budget: int, fits: dict[tuple[str, str], int]) -> str:
    torch_over = {r["layout"]: r["over"] for r in rows if r["kind"] == "torch"}
    lines = [
        BEGIN,
        "## Activation memory of a training step (bench_memory.py)",
        "",
        f"Machine: {os.cpu_count()}-core {cpu_model()}, no GPU; torch {torch.__version__}; kernels {backend_info()['cpu']}; "
        f"{datetime.date.today()}. {BLOCKS} blocks of conv 3x3 + batch norm + LeakyReLU, {CHANNELS} channels, "
        f"a pooled linear head, batch ({batch}, 3, {SIDE}, {SIDE}) float32, cross-entropy; the step's peak resident "
        "memory over the resting memory, each contender in a fresh process.",
        "",
        "| layout | contender | step peak over resting (MiB) | against torch |",
        "|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["over"] / torch_over[r["layout"]]
        lines.append(f"| {r['layout']} | {r['kind']} | {r['over'] / MIB:.1f} | {ratio:.3f}x |")
    lines += ["", f"Largest batch whose step fits {budget // MIB} MiB over resting memory:", ""]
    lines += [f"- {layout}, {kind}: {fits[kind, layout]}" for kind, layout in fits]
    lines.append(END)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--budget-mib", type=int, default=1024, help="the budget of the largest-batch search")
    parser.add_argument("--quick", action="store_true", help="batch 4, budget 256 MiB")
    parser.add_argument("--no-write", action="store_true", help="print, do not touch RESULTS.md")
    parser.add_argument("--one", choices=CONTENDERS, help=argparse.SUPPRESS)  # a fresh process's own run
    parser.add_argument("--layout", choices=list(LAYOUTS), default="contiguous", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if args.one:
        print(json.dumps(measure_step(args.one, args.batch, args.layout)))
        return
    batch, budget = (4, 256 * MIB) if args.quick else (args.batch, args.budget_mib * MIB)
    rows = [in_fresh_process(kind, batch, layout) for layout in LAYOUTS for kind in CONTENDERS]
    for r in rows:
        print(f"{r['layout']:>13} {r['kind']:>13}: {r['over'] / MIB:8.1f} MiB over {r['resting'] / MIB:.1f} MiB resting")
    high = 4 * batch * budget // max(1, rows[0]["over"]) + 1
    fits = {(kind, layout): largest_batch(kind, layout, budget, 1, high) for layout in LAYOUTS for kind in ("torch", "ours-inplace")}
    text = report(batch, rows, budget, fits)
    publish(text, not args.no_write, BEGIN, END)


if __name__ == "__main__":
    main()
