"""Is the lone-replica rule (``functions/operators/lone_replica.py``) right on this machine? Which kernels
should serve a lone CPU replica: ours or torch's batch norm (result ``lone_replica``).

For every case (batch or fixed statistics, fused residual + ReLU or not, dtype, layout) and a
ladder of sizes, it times forward + backward (``torch.autograd.grad`` for the input, the residual
where there is one, weight and bias) of:
  - ``torch``: ``nn.BatchNorm*`` (training, or eval for fixed statistics), with ``+ z`` and
    ``F.relu`` separately where fused;
  - ``via ours`` and ``via torch``: our layer forced through each route;
and which route the rule takes. The rule is right where its route is never clearly slower than
the other and it takes ours where ours is clearly faster.

Writes ``benchmarks/results/lone_replica.json`` (``benchmarks/results.py``): every measurement
under ``records``, and a table per dtype and size (below or from the rule's LARGE_INPUT
elements) of the ratios against ``torch``; ``python benchmarks/report.py`` makes RESULTS.md.

    python benchmarks/bench_lone_replica.py                      # every case, ~10 minutes on 2 cores
    python benchmarks/bench_lone_replica.py --dtypes float32 float64
    python benchmarks/bench_lone_replica.py --quick --dtypes float32 --no-write   # a smoke test
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu import TorchUnfused, allocator, fused_step, timing_method  # noqa: E402
from results import Column, add_output_options, output, span  # noqa: E402
from timing import copy_bandwidth_gbs, interleaved_medians  # noqa: E402
from syncbn.functions import backend_name  # noqa: E402
from syncbn.functions.operators import lone_replica  # noqa: E402
from syncbn import nn as NN  # noqa: E402

LADDERS = {
    "contiguous": [(2, 64, 4, 4), (2, 64, 16, 16), (8, 64, 28, 28), (8, 256, 28, 28), (64, 512, 7, 7), (32, 64, 56, 56)],
    "no_spatial": [(32, 64), (256, 512), (256, 2048), (1024, 2048)],
}
LADDERS["channels_last"] = LADDERS["contiguous"]
CLEARLY = 1.10  # a route is clearly faster where the other takes more than this times its time
Record = dict[str, Any]


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


def measure(dtypes: list[str], min_run_time: float, quick: bool) -> list[Record]:
    """One record per case and size: the three times (ms) and which route the rule takes."""
    records = []
    for stats in ("batch", "fixed"):
        for fused in (False, True):
            for dtype in dtypes:
                for layout, ladder in LADDERS.items():
                    case = LoneCase(stats, fused, dtype, layout)
                    for shape in ladder[::3] if quick else ladder:
                        t = time_case(case, shape, min_run_time)
                        x = make_input(shape, layout, DTYPES[dtype])
                        rule = "ours" if lone_replica.takes_our_kernels(x, fixed_stats=stats == "fixed") else "torch"
                        records.append({**case._asdict(), "shape": list(shape), "elements": x.numel(),
                                        "torch_ms": t["torch"], "via_ours_ms": t["via ours"],
                                        "via_torch_ms": t["via torch"], "rule": rule})
                        print(progress(records[-1]), flush=True)
    return records


def ratio(r: Record, route: str) -> float:
    """Route ``route`` ("ours", "torch", or "rule": the one the rule takes) against nn.BatchNorm*."""
    return r[f"via_{r['rule'] if route == 'rule' else route}_ms"] / r["torch_ms"]


def name(r: Record) -> str:
    return f"{r['stats']} {r['dtype']} {r['layout']} {tuple(r['shape'])}{' fused' if r['fused'] else ''}"


def progress(r: Record) -> str:
    return (f"{name(r)}: torch {r['torch_ms']:.3f} ms, "
            f"via ours {ratio(r, 'ours'):.2f}x, via torch {ratio(r, 'torch'):.2f}x, the rule takes {r['rule']}")


COLUMNS = [
    Column("dtype", "dtype"),
    Column("size", "elements"),
    Column("cases", "cases"),
    Column("takes_ours", "the rule takes ours, cases"),
    Column("via_ours", "via ours, median x torch", "{:.2f}x"),
    Column("rule_low", "the rule's route, best x torch", "{:.2f}x"),
    Column("rule_median", "the rule's route, median x torch", "{:.2f}x"),
    Column("rule_high", "the rule's route, worst x torch", "{:.2f}x"),
]


def size_band(r: Record) -> str:
    large = lone_replica.LARGE_INPUT
    return f"below {large / 1e6:.1f} M" if r["elements"] < large else f"{large / 1e6:.1f} M or more"


def rows_of(records: list[Record]) -> list[dict[str, Any]]:
    """One row per dtype and size band: how many cases, how many the rule gives ours, the ratios."""
    groups: dict[tuple[str, str], list[Record]] = {}
    for r in sorted(records, key=lambda r: r["elements"] >= lone_replica.LARGE_INPUT):
        groups.setdefault((r["dtype"], size_band(r)), []).append(r)
    rows = []
    for (dtype, size), group in sorted(groups.items(), key=lambda item: list(DTYPES).index(item[0][0])):
        rule = [ratio(r, "rule") for r in group]
        rows.append({
            "dtype": dtype, "size": size, "cases": len(group), "takes_ours": sum(r["rule"] == "ours" for r in group),
            "via_ours": statistics.median(ratio(r, "ours") for r in group),
            "via_torch": statistics.median(ratio(r, "torch") for r in group),
            "rule_low": min(rule), "rule_median": statistics.median(rule), "rule_high": max(rule),
        })
    return rows


def missed(records: list[Record]) -> list[Record]:
    """The records where the route the rule leaves was clearly faster than the one it takes."""
    return [r for r in records if ratio(r, "rule") > CLEARLY * ratio(r, "torch" if r["rule"] == "ours" else "ours")]


def summary(records: list[Record]) -> str:
    rule = [ratio(r, "rule") for r in records]
    ours = [ratio(r, "rule") for r in records if r["rule"] == "ours"]
    where = f"; where it takes our kernels ({len(ours)} cases), {span(ours)}" if ours else "; it never takes ours"
    wrong = missed(records)
    named = "; ".join(name(r) for r in wrong[:3]) + ("; ..." if len(wrong) > 3 else "")
    check = (f"In {len(wrong)} of {len(records)} cases the route the rule leaves was more than {CLEARLY - 1:.0%} "
             f"faster ({named})." if wrong
             else f"In no case was the route the rule leaves more than {CLEARLY - 1:.0%} faster than the one it takes.")
    small = [ratio(r, "ours") for r in records if r["elements"] < lone_replica.LARGE_INPUT]
    large = [ratio(r, "ours") for r in records if r["elements"] >= lone_replica.LARGE_INPUT]
    bands = [(f"below {lone_replica.LARGE_INPUT / 1e6:.1f} M elements", small), ("larger inputs", large)]
    forced = ", ".join(f"{band} a median {statistics.median(v):.2f}x" for band, v in bands if v)
    return (
        f"The rule's route takes {span(rule)} the time of nn.BatchNorm* (median {statistics.median(rule):.2f}x) over "
        f"{len(records)} cases{where}. Forced through our kernels, {forced}. {check}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES),
                        help="input dtypes (default: all four)")
    parser.add_argument("--min-run-time", type=float, default=0.5,
                        help="seconds per contender and size, in 5 interleaved rounds (default: 0.5)")
    parser.add_argument("--quick", action="store_true",
                        help="two sizes of each ladder, the 1st and the 4th (default: every size)")
    add_output_options(parser)
    args = parser.parse_args()
    backend = backend_name(torch.device("cpu"))
    if not backend.startswith("compiled-cpu"):
        sys.exit(f"no compiled CPU kernels here ({backend}): torch's batch norm serves every lone replica")
    torch.manual_seed(0)
    method = timing_method(args.min_run_time, copy_bandwidth_gbs(args.min_run_time), allocator())
    records = measure(args.dtypes, args.min_run_time, args.quick)
    what = ("forward + backward (gradients for input, the residual where fused, weight and bias) of "
            "nn.BatchNorm* (eval for fixed statistics; + z and F.relu apart where fused) against our layer forced "
            "through our kernels (`via ours`) or torch's batch norm, and the route the rule takes, for batch and "
            "fixed statistics, fused or not, NCHW, channels_last and (N, C), on a ladder of sizes; each row pools "
            "a dtype's cases in one size band")
    output(args, "lone_replica", title=f"CPU: which kernels serve a lone replica, ours or torch's ({backend})",
           method=method(what), columns=COLUMNS, rows=rows_of(records), summary=summary(records),
           backend=backend, min_run_time=args.min_run_time, large_input=lone_replica.LARGE_INPUT, records=records)


if __name__ == "__main__":
    main()
