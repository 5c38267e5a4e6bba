"""Is the lone-replica rule (``functions/operators/lone_replica.py``) right on this machine? Which kernels
should serve a lone CPU replica: ours or torch's batch norm.

For every case (batch or fixed statistics, fused residual + ReLU or not, dtype, layout) and a
ladder of sizes, it times forward + backward (``torch.autograd.grad`` for the input, the residual
where there is one, weight and bias) of:
  - ``torch``: ``nn.BatchNorm*`` (training, or eval for fixed statistics), with ``+ z`` and
    ``F.relu`` separately where fused;
  - ``via ours`` and ``via torch``: our layer forced through each route;
and prints, per row, the two routes against ``torch`` and the route the rule takes with its ratio.
The rule is right where its ratio is never clearly above 1 and it takes ours where ours is
clearly faster.

    python benchmarks/bench_lone_replica.py               # every case, ~10 minutes on 2 cores
    python benchmarks/bench_lone_replica.py --dtypes float32 float64 --json lone.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, NamedTuple

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu import (  # noqa: E402
    TorchUnfused,
    copy_bandwidth_gbs,
    fused_step,
    interleaved_medians,
    keep_freed_blocks,
    machine_line,
)
from syncbn.functions import backend_name  # noqa: E402
from syncbn.functions.operators import lone_replica
from syncbn import nn as NN  # noqa: E402

LADDERS = {
    "contiguous": [(2, 64, 4, 4), (2, 64, 16, 16), (8, 64, 28, 28), (8, 256, 28, 28), (64, 512, 7, 7), (32, 64, 56, 56)],
    "no_spatial": [(32, 64), (256, 512), (256, 2048), (1024, 2048)],
}
LADDERS["channels_last"] = LADDERS["contiguous"]
class LoneCase(NamedTuple):
    """``stats`` ``'batch'`` (training) or ``'fixed'`` (frozen); ``fused`` whether a residual and
    ReLU are fused; the input's dtype name; its layout: ``'contiguous'``, ``'channels_last'`` or
    ``'no_spatial'`` ((N, C))."""

    stats: str
    fused: bool
    dtype: str
    layout: str


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def contenders(case: LoneCase, C: int, rank: int) -> tuple[nn.Module, nn.Module]:
    """torch's module and ours for ``case``, float32 parameters for half inputs (as under
    autocast), float64 ones for float64."""
    torch_cls = nn.BatchNorm1d if rank == 2 else nn.BatchNorm2d
    ours_cls = NN.BatchNorm1d if rank == 2 else NN.BatchNorm2d
    dtype = torch.float64 if case.dtype == "float64" else torch.float32
    theirs = torch_cls(C).to(dtype)
    ours = ours_cls(C, frozen=case.stats == "fixed", activation="relu" if case.fused else None).to(dtype)
    if case.stats == "fixed":
        theirs.eval()  # weight and bias still require grad
    return (TorchUnfused(theirs) if case.fused else theirs), ours


def make_input(shape: tuple[int, ...], layout: str, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(shape).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    return x.requires_grad_()


def routed(route: str, fn: Callable[[], object]) -> Callable[[], object]:
    def call():
        with lone_replica.forced(route):
            return fn()

    return call


def time_case(case: LoneCase, shape: tuple[int, ...], min_run_time: float) -> dict[str, float]:
    x = make_input(shape, case.layout, DTYPES[case.dtype])
    z = torch.randn_like(x).requires_grad_() if case.fused else None
    dy = torch.randn_like(x)
    theirs, ours = contenders(case, shape[1], len(shape))
    fns = {"torch": fused_step(theirs, x, z, dy)}
    fns.update({f"via {route}": routed(route, fused_step(ours, x, z, dy)) for route in ("ours", "torch")})
    return interleaved_medians(fns, min_run_time)


def measure(dtypes: list[str], min_run_time: float) -> list[dict]:
    """One record per case and size: the three times (ms) and which route the rule takes."""
    records = []
    for stats in ("batch", "fixed"):
        for fused in (False, True):
            for dtype in dtypes:
                for layout, ladder in LADDERS.items():
                    case = LoneCase(stats, fused, dtype, layout)
                    for shape in ladder:
                        t = time_case(case, shape, min_run_time)
                        x = make_input(shape, layout, DTYPES[dtype])
                        rule = "ours" if lone_replica.takes_our_kernels(x, fixed_stats=stats == "fixed") else "torch"
                        records.append({**case._asdict(), "shape": list(shape), "torch_ms": t["torch"],
                                        "via_ours_ms": t["via ours"], "via_torch_ms": t["via torch"], "rule": rule})
                        print(row(records[-1]), flush=True)
    return records


def row(r: dict) -> str:
    """A record as a markdown row: times in ms, ratios against ``torch``."""
    chosen = r["via_ours_ms"] if r["rule"] == "ours" else r["via_torch_ms"]
    return (
        f"| {r['stats']} | {'yes' if r['fused'] else 'no'} | {r['dtype']} | {r['layout']} | {tuple(r['shape'])} "
        f"| {r['torch_ms']:.3f} | {r['via_ours_ms'] / r['torch_ms']:.2f}x | {r['via_torch_ms'] / r['torch_ms']:.2f}x "
        f"| {r['rule']} {chosen / r['torch_ms']:.2f}x |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES), help="input dtypes (default: all four)")
    parser.add_argument("--min-run-time", type=float, default=0.5, help="seconds per contender and size, in 5 interleaved rounds (default: 0.5)")
    parser.add_argument("--json", default=None, help="also write the records to this JSON file (default: print only)")
    args = parser.parse_args()
    backend = backend_name(torch.device("cpu"))
    if not backend.startswith("compiled-cpu"):
        sys.exit(f"no compiled CPU kernels here ({backend}): torch's batch norm serves every lone replica")
    torch.manual_seed(0)
    allocator = "glibc malloc, freed blocks kept (see keep_freed_blocks)" if keep_freed_blocks() else "default allocator"
    machine = machine_line(copy_bandwidth_gbs(args.min_run_time), args.min_run_time, allocator)
    print(machine)
    print("| stats | fused | dtype | layout | shape | torch ms | via ours | via torch | the rule |")
    print("|---|---|---|---|---|---|---|---|---|")
    records = measure(args.dtypes, args.min_run_time)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": backend, "machine": machine, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
