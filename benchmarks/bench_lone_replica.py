"""Which kernels should serve a lone CPU replica: ours or torch's batch norm (see
``functions/lone_replica.py``)? Measured here, for this machine's backend.

For every case (batch or fixed statistics, fused residual + ReLU or not, dtype, layout) and a
ladder of sizes, it times forward + backward (``torch.autograd.grad`` for the input, the residual
where there is one, weight and bias) of:
  - ``torch``: ``nn.BatchNorm*`` (training, or eval for fixed statistics), with ``+ z`` and
    ``F.relu`` separately where fused;
  - ``ours (our kernels)`` and ``ours (torch's kernel)``: our layer forced through each route.
It decides, per case, from how many elements our kernels serve (the smallest size from which
ours was faster than torch's route at that size and every larger one; None where it never was),
prints the table for ``OURS_FROM_ELEMENTS`` in ``functions/lone_replica.py``, and writes this
backend's section of RESULTS.md (one section per backend, so each machine's run stays).

    python benchmarks/bench_lone_replica.py               # every case, ~10 minutes on 2 cores
    python benchmarks/bench_lone_replica.py --dtypes float32 --no-write
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

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
    keyed_markers,
    machine_line,
    write_results,
)
from syncbn.functions import backend_name, lone_replica  # noqa: E402
from syncbn.functions.lone_replica import LoneCase  # noqa: E402
from syncbn import nn as NN  # noqa: E402

LADDERS = {
    "contiguous": [(2, 64, 4, 4), (2, 64, 16, 16), (8, 64, 28, 28), (8, 256, 28, 28), (64, 512, 7, 7), (32, 64, 56, 56)],
    "no_spatial": [(32, 64), (256, 512), (256, 2048), (1024, 2048)],
}
LADDERS["channels_last"] = LADDERS["contiguous"]
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


def ours_from(points: list[tuple[int, dict[str, float]]]) -> int | None:
    """The smallest size from which our kernels beat torch's route at every measured size."""
    for size in sorted({numel for numel, _ in points}):
        if all(t["via ours"] < t["via torch"] for numel, t in points if numel >= size):
            return size
    return None


def measure(dtypes: list[str], min_run_time: float) -> tuple[dict[LoneCase, int | None], list[str]]:
    table, rows = {}, []
    for stats in ("batch", "fixed"):
        for fused in (False, True):
            for dtype in dtypes:
                for layout, ladder in LADDERS.items():
                    case = LoneCase(stats, fused, dtype, layout)
                    points = [(torch.Size(s).numel(), time_case(case, s, min_run_time)) for s in ladder]
                    table[case] = ours_from(points)
                    for shape, (numel, t) in zip(ladder, points):
                        chosen = t["via ours"] if table[case] is not None and numel >= table[case] else t["via torch"]
                        rows.append(
                            f"| {stats} | {'yes' if fused else 'no'} | {dtype} | {layout} | {shape} | {t['torch']:.3f} "
                            f"| {t['via ours']:.3f} ({t['via ours'] / t['torch']:.2f}x) "
                            f"| {t['via torch']:.3f} ({t['via torch'] / t['torch']:.2f}x) | {chosen / t['torch']:.2f}x |"
                        )
                        print(rows[-1], flush=True)
    return table, rows


def table_source(table: dict[LoneCase, int | None]) -> str:
    """``table`` as this backend's entry of OURS_FROM_ELEMENTS, written as the file writes it."""
    lines = [f'    "{backend_name(torch.device("cpu"))}": {{']
    for stats in ("batch", "fixed"):
        for fused in (False, True):
            lines.append(f'        **_cases("{stats}", {fused}, {{')
            lines += [
                f'            ("{case.dtype}", "{case.layout}"): {n!r},'
                for case, n in table.items()
                if case.stats == stats and case.fused == fused
            ]
            lines.append("        }),")
    return "\n".join(lines + ["    },"])


def section(backend: str, table_code: str, rows: list[str], bandwidth: float, min_run_time: float, allocator: str) -> str:
    begin, end = keyed_markers("bench_lone_replica", backend)
    return "\n".join([
        begin,
        f"## CPU: which kernels serve a lone replica, `{backend}` (`bench_lone_replica.py`)",
        "",
        machine_line(bandwidth, min_run_time, allocator),
        "",
        "Forward + backward (gradients for the input, z where fused, weight and bias). `torch`: "
        "`nn.BatchNorm*` (eval for fixed statistics; `+ z` and `F.relu` apart where fused); "
        "`ours via ours` / `ours via torch`: our layer through our kernels / through torch's batch "
        "norm; `chosen`: what the table below picks, against `torch`. Each time is the median over 5 "
        "rounds that take the three in turn (bursts of steal time hit one round of each).",
        "",
        "| stats | fused | dtype | layout | shape | torch ms | ours via ours | ours via torch | chosen |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "The table this run gives (`OURS_FROM_ELEMENTS` in `functions/lone_replica.py`):",
        "",
        "```python",
        table_code,
        "```",
        end,
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--min-run-time", type=float, default=0.5, help="seconds per contender and size, in 5 interleaved rounds")
    parser.add_argument("--no-write", action="store_true", help="print, do not touch RESULTS.md")
    args = parser.parse_args()
    backend = backend_name(torch.device("cpu"))
    if not backend.startswith("compiled-cpu"):
        sys.exit(f"no compiled CPU kernels here ({backend}): torch's batch norm serves every lone replica")
    torch.manual_seed(0)
    allocator = "glibc malloc, freed blocks kept (see keep_freed_blocks)" if keep_freed_blocks() else "default allocator"
    bandwidth = copy_bandwidth_gbs(args.min_run_time)
    table, rows = measure(args.dtypes, args.min_run_time)
    code = table_source(table)
    print(code)
    if not args.no_write:
        write_results(section(backend, code, rows, bandwidth, args.min_run_time, allocator), *keyed_markers("bench_lone_replica", backend))


if __name__ == "__main__":
    main()
