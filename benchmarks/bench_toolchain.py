"""Fixed cost and torch.compile on a lone replica: what the operators (torch.ops.syncbn) cost and
whether torch.compile takes our layers (result ``toolchain``).

- fixed cost: forward + backward (input, weight and bias gradients) of one layer on a tiny
  (2, 64, 4, 4) float32 input, where the time is the Python and dispatch around the kernels:
  ``nn.BatchNorm2d`` against ours, through the route the rule picks (torch's kernel at this size:
  the cost of our module's Python) and forced through our kernels (one ``batch_norm_train``
  operator forward, ``backward_reduce`` + ``backward_elemt`` backward).
- torch.compile: one SGD-free training step (forward, loss, backward) of a small ResNet-style net
  (conv stem, 2 basic blocks with residual adds, BN1d head) on (16, 3, 32, 32) float32, eager and
  ``torch.compile(fullgraph=True)``, with torch's layers and with ours (the rule's routes, and
  forced through our kernels).

Each row is a measurement against its reference in the same run, with the difference in
microseconds, or "within noise" where it is within half the interquartile range of its values
over the rounds.
Writes ``benchmarks/results/toolchain.json`` (``benchmarks/results.py``), from which
``python benchmarks/report.py`` makes RESULTS.md.

    python benchmarks/bench_toolchain.py                          # min_run_time 1 s
    python benchmarks/bench_toolchain.py --min-run-time 0.1 --no-write   # print only
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from bench_cpu import fused_step, timing_method  # noqa: E402
from results import add_output_options, output  # noqa: E402
from timing import copy_bandwidth_gbs, interleaved_samples  # noqa: E402
from bench_lone_replica import routed  # noqa: E402
from results import Column  # noqa: E402
from syncbn.functions.operators import lone_replica  # noqa: E402
from helpers import SmallResNet  # noqa: E402
from syncbn import nn as NN  # noqa: E402

FIXED_COST_SHAPE = (2, 64, 4, 4)
Samples = dict[str, list[list[float]]]

COLUMNS = [
    Column("case", "case"),
    Column("measured_ms", "measured, ms", "{:.3f}"),
    Column("reference", "against"),
    Column("reference_ms", "against, ms", "{:.3f}"),
    Column("ratio", "x against", "{:.2f}x"),
    Column("difference", "difference, us"),
]


def fixed_cost_steps(**layers: nn.Module) -> dict:
    """Forward + backward (input, weight and bias gradients) of each of ``layers`` on one
    FIXED_COST_SHAPE float32 input, where the time is the Python and dispatch around the kernels."""
    x = torch.randn(*FIXED_COST_SHAPE, requires_grad=True)
    dy = torch.randn_like(x)
    return {name: fused_step(layer, x, None, dy) for name, layer in layers.items()}


def median_us(per_round: list[list[float]]) -> float:
    return statistics.median(t for times in per_round for t in times) * 1e6


def compared(samples: Samples, measured: str, reference: str) -> dict[str, Any]:
    """``measured`` against ``reference``: their medians, the ratio, and the difference with its
    noise: half the interquartile range of the per-round differences (one burst of steal time
    moves one round, not the noise)."""
    diffs = [(statistics.median(m) - statistics.median(r)) * 1e6 for m, r in zip(samples[measured], samples[reference])]
    low, _, high = statistics.quantiles(diffs, n=4, method="inclusive")
    diff, noise = median_us(samples[measured]) - median_us(samples[reference]), (high - low) / 2
    return {
        "measured_ms": median_us(samples[measured]) / 1e3, "reference_ms": median_us(samples[reference]) / 1e3,
        "ratio": median_us(samples[measured]) / median_us(samples[reference]),
        "difference": f"within noise (±{noise:.1f})" if abs(diff) <= noise else f"{diff:+.1f}",
        "difference_us": diff, "noise_us": noise,
    }


def fixed_cost_rows(min_run_time: float) -> list[dict[str, Any]]:
    """nn.BatchNorm2d against our layer through the route the rule picks at this size and forced
    through our kernels."""
    C = FIXED_COST_SHAPE[1]
    steps = fixed_cost_steps(torch=nn.BatchNorm2d(C), ours=NN.BatchNorm2d(C))
    samples = interleaved_samples(
        {"torch": steps["torch"], "rule": routed("rule", steps["ours"]), "ours": routed("ours", steps["ours"])},
        min_run_time,
    )
    ours_here = lone_replica.takes_our_kernels(torch.empty(FIXED_COST_SHAPE), fixed_stats=False)
    picked = "our kernels" if ours_here else "torch's kernel"
    return [
        {"case": f"{FIXED_COST_SHAPE} layer, fwd+bwd: ours, {what}", "reference": "nn.BatchNorm2d", "route": route,
         "kernels": kernels, **compared(samples, route, "torch")}
        for route, what, kernels in [("rule", f"the rule's route ({picked} here)", picked),
                                     ("ours", "forced through our kernels", "our kernels")]
    ]


def training_step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    return step


def compile_rows(min_run_time: float) -> list[dict[str, Any]]:
    """Per model, the compiled step against the eager one."""
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
            steps = {"eager": training_step(model, x), "compiled": training_step(compiled_model, x)}
            samples = interleaved_samples(steps, min_run_time)
            torch._dynamo.reset()  # the next route traces afresh
        rows.append({"case": f"small ResNet step, {name}: torch.compile(fullgraph=True)", "reference": "eager",
                     "route": route, **compared(samples, "compiled", "eager")})
    return rows


def extra_text(row: dict[str, Any]) -> str:
    """How the row's measurement compares with its reference, in words."""
    if row["difference"].startswith("within"):
        return f"the same time, within noise (±{row['noise_us']:.1f} us), as"
    return f"{abs(row['difference_us']):.1f} us {'more' if row['difference_us'] > 0 else 'less'} than"


def summary(fixed: list[dict[str, Any]], compiled: list[dict[str, Any]]) -> str:
    rule, forced = fixed
    return (
        f"A tiny {FIXED_COST_SHAPE} layer (forward + backward) through the rule's route ({rule['kernels']}) takes "
        f"{extra_text(rule)} nn.BatchNorm2d ({rule['reference_ms'] * 1e3:.1f} us); forced through our kernels it takes "
        f"{extra_text(forced)} nn.BatchNorm2d. Under torch.compile(fullgraph=True) the small ResNet's training step takes "
        f"{compiled[0]['ratio']:.2f}x its eager time with torch's layers, {compiled[1]['ratio']:.2f}x with ours through "
        f"the rule's routes and {compiled[2]['ratio']:.2f}x with ours forced through our kernels."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min-run-time", type=float, default=1.0,
                        help="seconds per contender, in 5 interleaved rounds (default: 1.0)")
    add_output_options(parser)
    args = parser.parse_args()
    method = timing_method(args.min_run_time, copy_bandwidth_gbs(args.min_run_time), "default allocator")
    fixed, compiled = fixed_cost_rows(args.min_run_time), compile_rows(args.min_run_time)
    what = ("the small ResNet (32 channels, 2 basic blocks with residual adds, BN1d head) takes one training step "
            "(forward, loss, backward; no optimizer) on (16, 3, 32, 32) float32; a difference within half the interquartile "
            "range of its per-round values is written as within noise")
    output(args, "toolchain", title="CPU: fixed cost of a tiny layer, and torch.compile", method=method(what),
           columns=COLUMNS, rows=fixed + compiled, summary=summary(fixed, compiled), min_run_time=args.min_run_time)


if __name__ == "__main__":
    main()
