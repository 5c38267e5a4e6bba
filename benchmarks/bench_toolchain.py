"""Fixed cost and torch.compile: what the operators (torch.ops.syncbn) changed for a lone replica.

- fixed cost: forward + backward (input, weight and bias gradients) of one layer on a tiny
  (2, 64, 4, 4) float32 input, where the time is the Python and dispatch around the kernels:
  ``nn.BatchNorm2d`` against ours (a lone CPU replica: one ``batch_norm_train`` operator forward,
  ``backward_reduce`` + ``backward_elemt`` backward); the difference in microseconds.
- torch.compile: one SGD-free training step (forward, loss, backward) of a small ResNet-style net
  (conv stem, 2 basic blocks with residual adds, BN1d head) on (16, 3, 32, 32) float32, eager and
  ``torch.compile(fullgraph=True)``, with torch's layers and with ours.

    python benchmarks/bench_toolchain.py            # writes its section of RESULTS.md
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from bench_cpu import copy_bandwidth_gbs, machine_line, median_ms, write_results  # noqa: E402
from helpers import SmallResNet  # noqa: E402
from modules import nn as NN  # noqa: E402

BEGIN, END = "<!-- bench_toolchain:begin -->", "<!-- bench_toolchain:end -->"


def fixed_cost_rows(min_run_time: float) -> list[str]:
    x = torch.randn(2, 64, 4, 4, requires_grad=True)
    dy = torch.randn_like(x)
    rows = []
    times = {}
    for name, layer in [("nn.BatchNorm2d", nn.BatchNorm2d(64)), ("ours", NN.BatchNorm2d(64))]:
        params = list(layer.parameters())
        times[name] = median_ms(lambda: torch.autograd.grad(layer(x), [x, *params], dy), min_run_time) * 1e3
    extra = times["ours"] - times["nn.BatchNorm2d"]
    rows.append(
        f"| (2, 64, 4, 4) float32, forward+backward | {times['nn.BatchNorm2d']:.1f} | {times['ours']:.1f} | "
        f"{extra:+.1f} us (target <= +25) |"
    )
    return rows


def training_step(model: nn.Module, x: torch.Tensor):
    def step():
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    return step


def compile_rows(min_run_time: float) -> list[str]:
    torch.manual_seed(0)
    x = torch.randn(16, 3, 32, 32)
    theirs = SmallResNet(channels=32, classes=10, head_momentum=0.1)
    ours = NN.convert_sync_batchnorm(copy.deepcopy(theirs))
    rows = []
    for name, model in [("torch's layers", theirs), ("ours", ours)]:
        eager = median_ms(training_step(model, x), min_run_time)
        compiled_model = torch.compile(model, fullgraph=True)
        compiled = median_ms(training_step(compiled_model, x), min_run_time)
        rows.append(f"| small ResNet step, {name} | {eager:.2f} | {compiled:.2f} | {compiled / eager:.2f}x |")
    return rows


def report(fixed: list[str], compiled: list[str], bandwidth: float, min_run_time: float) -> str:
    return "\n".join([
        BEGIN,
        "## CPU: fixed cost and torch.compile (`bench_toolchain.py`)",
        "",
        machine_line(bandwidth, min_run_time, "default allocator"),
        "",
        "Fixed cost of one layer, in microseconds (a lone replica: ours runs the `batch_norm_train` "
        "operator forward and `backward_reduce` + `backward_elemt` backward):",
        "",
        "| case | nn.BatchNorm2d, us | ours, us | ours - torch |",
        "|---|---|---|---|",
        *fixed,
        "",
        "One training step (forward, loss, backward; no optimizer) of a small ResNet-style net "
        "(32 channels, 2 basic blocks with residual adds, BN1d head) on (16, 3, 32, 32) float32, in ms:",
        "",
        "| model | eager | torch.compile(fullgraph=True) | compiled / eager |",
        "|---|---|---|---|",
        *compiled,
        END,
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min-run-time", type=float, default=1.0, help="seconds per measurement")
    parser.add_argument("--no-write", action="store_true", help="print, do not touch RESULTS.md")
    args = parser.parse_args()
    bandwidth = copy_bandwidth_gbs(args.min_run_time)
    section = report(fixed_cost_rows(args.min_run_time), compile_rows(args.min_run_time), bandwidth, args.min_run_time)
    print(section)
    if not args.no_write:
        write_results(section, BEGIN, END)


if __name__ == "__main__":
    main()
