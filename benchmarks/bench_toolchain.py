"""Fixed cost and torch.compile: what the operators (torch.ops.syncbn) changed for a lone replica.

- fixed cost: forward + backward (input, weight and bias gradients) of one layer on a tiny
  (2, 64, 4, 4) float32 input, where the time is the Python and dispatch around the kernels:
  ``nn.BatchNorm2d`` against ours, through the route the rule picks (torch's kernel at
  this size: the cost of our module's Python) and forced through our kernels (one
  ``batch_norm_train`` operator forward, ``backward_reduce`` + ``backward_elemt`` backward); the
  differences in microseconds.
- torch.compile: one SGD-free training step (forward, loss, backward) of a small ResNet-style net
  (conv stem, 2 basic blocks with residual adds, BN1d head) on (16, 3, 32, 32) float32, eager and
  ``torch.compile(fullgraph=True)``, with torch's layers and with ours (the rule's routes, and
  forced through our kernels).

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
from bench_cpu import copy_bandwidth_gbs, fused_step, interleaved_medians, machine_line, publish  # noqa: E402
from bench_lone_replica import routed  # noqa: E402
from syncbn.functions.operators import lone_replica  # noqa: E402
from helpers import SmallResNet  # noqa: E402
from syncbn import nn as NN  # noqa: E402

BEGIN, END = "<!-- bench_toolchain:begin -->", "<!-- bench_toolchain:end -->"
FIXED_COST_SHAPE = (2, 64, 4, 4)


def fixed_cost_steps(**layers: nn.Module) -> dict:
    """Forward + backward (input, weight and bias gradients) of each of ``layers`` on one
    FIXED_COST_SHAPE float32 input, where the time is the Python and dispatch around the kernels."""
    x = torch.randn(*FIXED_COST_SHAPE, requires_grad=True)
    dy = torch.randn_like(x)
    return {name: fused_step(layer, x, None, dy) for name, layer in layers.items()}


def fixed_cost_rows(min_run_time: float) -> list[str]:
    """nn.BatchNorm2d against our layer through the route the rule picks at this size
    (torch's kernel: what the fixed cost of our module is) and forced through our kernels."""
    ours = NN.BatchNorm2d(FIXED_COST_SHAPE[1])
    steps = fixed_cost_steps(torch=nn.BatchNorm2d(FIXED_COST_SHAPE[1]), ours=ours)
    times = interleaved_medians(
        {"torch": steps["torch"], "rule": routed("rule", steps["ours"]), "ours": routed("ours", steps["ours"])},
        min_run_time,
    )
    times = {name: ms * 1e3 for name, ms in times.items()}
    return [
        f"| {FIXED_COST_SHAPE} float32, forward+backward, {what} | {times['torch']:.1f} | {times[route]:.1f} | "
        f"{times[route] - times['torch']:+.1f} us |"
        for route, what in [("rule", "the rule's route (torch's kernel here)"), ("ours", "forced through our kernels")]
    ]


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
    for name, model, route in [
        ("torch's layers", theirs, "rule"),
        ("ours, the rule's routes", ours, "rule"),
        ("ours, forced through our kernels", ours, "ours"),
    ]:
        with lone_replica.forced(route):
            compiled_model = torch.compile(model, fullgraph=True)
            times = interleaved_medians({"eager": training_step(model, x), "compiled": training_step(compiled_model, x)}, min_run_time)
            torch._dynamo.reset()  # the next route traces afresh
        rows.append(f"| small ResNet step, {name} | {times['eager']:.2f} | {times['compiled']:.2f} | {times['compiled'] / times['eager']:.2f}x |")
    return rows


def report(fixed: list[str], compiled: list[str], bandwidth: float, min_run_time: float) -> str:
    return "\n".join([
        BEGIN,
        "## CPU: fixed cost and torch.compile (`bench_toolchain.py`)",
        "",
        machine_line(bandwidth, min_run_time, "default allocator"),
        "",
        "Fixed cost of one layer, in microseconds, a lone replica (through our kernels: the "
        "`batch_norm_train` operator forward, `backward_reduce` + `backward_elemt` backward; the "
        "rule picks torch's kernel at this size, see `functions/operators/lone_replica.py`). Medians "
        "over 5 rounds that take the contenders in turn:",
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
    publish(section, not args.no_write, BEGIN, END)


if __name__ == "__main__":
    main()
