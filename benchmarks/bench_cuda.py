"""CUDA benchmark: our CUDA kernels (``functions._C_cuda``) against cuDNN's batch norm and torch's
SyncBN kernel sequence, as fractions of the device's copy bandwidth.

For each case (shape, layout, dtype) it times, with torch.utils.benchmark in one run:
  - copy: ``y.copy_(x)`` of the case's input (the bandwidth every fraction is taken of);
  - cudnn: ``F.batch_norm`` in training mode + ``torch.autograd.grad`` for input, weight, bias;
  - torch ops: torch's SyncBN sequence on one replica (``batch_norm_stats``,
    ``batch_norm_gather_stats_with_counts``, ``batch_norm_elemt``, ``batch_norm_backward_reduce``,
    ``batch_norm_backward_elemt``);
  - ours: the same sequence through our kernels (``local_stats``, the merge, ``elemt_forward``,
    ``backward_reduce``, ``backward_elemt``);
  - ours frozen: ``elemt_forward`` + ``backward_affine_act`` (dx and the sums);
  - ours fused BN+ReLU+add: ``local_stats``, ``elemt_forward`` with residual and ReLU,
    ``backward_affine_act`` (g and its sums), ``backward_elemt`` of g.
Traffic models (passes over a tensor of the input's size): batch norm forward+backward 8
(forward reads x twice and writes y; backward reads dy and x twice and writes dx); frozen 5
(forward 2, backward 3); fused 11 (forward 4: x for the statistics, x and z, y; backward 7: dy,
x, z and g, then g, x and dx). Inputs rotate over enough buffers that together they are at
least 4x the L2 cache, so that L2 does not flatter small cases.

Writes ``benchmarks/results/cuda.json`` (``benchmarks/results.py``): per case the times (ms), our
ratios against cuDNN and torch's ops, and each fraction of the copy bandwidth; ``python
benchmarks/report.py`` makes RESULTS.md from it.

    python benchmarks/bench_cuda.py --min-run-time 0.2     # every case (26)
    python benchmarks/bench_cuda.py --quick --no-write     # (64, 256, 56, 56) only, print only

Where CUDA is not available it says so and exits 0, writing nothing.
"""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils import benchmark

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from syncbn.functions.operators import backend  # noqa: E402
from bench_cpu import Case  # noqa: E402
from results import add_output_options, output, span  # noqa: E402
from results import Column  # noqa: E402

EPS = 1e-5
PASSES = {"bn": 8, "frozen": 5, "fused": 11}

SHAPES = [(64, 256, 56, 56), (32, 64, 112, 112), (8, 256, 128, 128), (4, 2048, 64, 64), (32, 2048, 7, 7),
          (64, 4, 224, 224), (256, 2048)]


def case_bytes(case: Case) -> int:
    """Bytes of one tensor of the case's input size."""
    return math.prod(case.shape) * torch.empty((), dtype=case.dtype).element_size()


def cases(quick: bool) -> list[Case]:
    out = []
    for shape in SHAPES[:1] if quick else SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            for channels_last in (False, True) if len(shape) == 4 else (False,):
                out.append(Case(shape, channels_last, dtype))
    return out


class Rotating:
    """``count`` independent sets of (x, dy, z) handed out in turn: each call of ``next()`` gives
    the next set, so that one timing loop never finds its input in L2."""

    def __init__(self, case: Case) -> None:
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
        self.count = max(2, -(-4 * l2 // (3 * case_bytes(case))))
        fmt = torch.channels_last if case.channels_last else torch.contiguous_format
        make = lambda: torch.randn(case.shape, device="cuda").to(case.dtype).contiguous(memory_format=fmt)  # noqa: E731
        self.sets = [(make(), make(), make()) for _ in range(self.count)]
        self.i = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.i = (self.i + 1) % self.count
        return self.sets[self.i]


def median_ms(fn: Callable[[], object], min_run_time: float) -> float:
    fn()  # warm up (and the allocator)
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn})
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def step_functions(case: Case, buffers: Rotating) -> dict[str, Callable[[], object]]:
    C = case.shape[1]
    weight = torch.rand(C, device="cuda") + 0.5
    bias = torch.randn(C, device="cuda")
    running_mean, running_var = torch.zeros(C, device="cuda"), torch.ones(C, device="cuda")
    ops = torch.ops.syncbn if backend.SERVING["cuda"] == "compiled" else None  # our CUDA kernels, when loaded

    def copy():
        x, y, _ = buffers.next()
        y.copy_(x)

    w_grad, b_grad = weight.clone().requires_grad_(), bias.clone().requires_grad_()

    def cudnn():
        x, dy, _ = buffers.next()
        x = x.detach().requires_grad_()
        y = F.batch_norm(x, running_mean, running_var, w_grad, b_grad, True, 0.1, EPS)
        torch.autograd.grad(y, [x, w_grad, b_grad], dy)

    counts = torch.full((1,), float(case_bytes(case) // (C * buffers.sets[0][0].element_size())), device="cuda")
    count_int = torch.tensor([int(counts.item())], dtype=torch.int32, device="cuda")

    def torch_ops():
        x, dy, _ = buffers.next()
        mean, invstd = torch.batch_norm_stats(x, EPS)
        mean, invstd = torch.batch_norm_gather_stats_with_counts(
            x, mean.unsqueeze(0), invstd.unsqueeze(0), running_mean, running_var, 0.1, EPS, counts)
        torch.batch_norm_elemt(x, weight, bias, mean, invstd, EPS)
        sum_dy, sum_dy_xmu, _, _ = torch.batch_norm_backward_reduce(dy, x, mean, invstd, weight, True, True, True)
        torch.batch_norm_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count_int)

    functions = {"copy": copy, "cudnn": cudnn, "torch ops": torch_ops}
    if ops is None:
        return functions

    def stats(x):
        n = x.numel() // x.size(1)
        mean, m2 = ops.local_stats(x)
        var = m2 / n
        return n, mean.float(), torch.rsqrt(var + EPS).float()

    def ours():
        x, dy, _ = buffers.next()
        n, mean, invstd = stats(x)
        ops.elemt_forward(x, mean, invstd, weight, bias)
        sum_dy, sum_dy_xmu = ops.backward_reduce(dy, x, mean)
        ops.backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, n)

    frozen_mean, frozen_invstd = torch.zeros(C, device="cuda"), torch.ones(C, device="cuda")

    def frozen():
        x, dy, _ = buffers.next()
        ops.elemt_forward(x, frozen_mean, frozen_invstd, weight, bias)
        ops.backward_affine_act(
            dy, x, frozen_mean, frozen_invstd, weight, bias, None, None, input_grad=True, residual_grad=False, sums=True
        )

    def fused():
        x, dy, z = buffers.next()
        n, mean, invstd = stats(x)
        ops.elemt_forward(x, mean, invstd, weight, bias, z, 0.0)
        _, g, sum_g, sum_g_xmu = ops.backward_affine_act(
            dy, x, mean, invstd, weight, bias, z, 0.0, input_grad=False, residual_grad=True, sums=True
        )
        ops.backward_elemt(g, x, mean, invstd, weight, sum_g, sum_g_xmu, n)

    functions.update({"ours": ours, "ours frozen": frozen, "ours fused": fused})
    return functions


def fraction(passes: int, case: Case, ms: float, bandwidth_gbs: float) -> float:
    return passes * case_bytes(case) / (ms * 1e-3) / 1e9 / bandwidth_gbs


NAMES = {"cudnn": "cudnn", "torch ops": "ops", "ours": "ours", "ours frozen": "frozen", "ours fused": "fused"}
MODEL = {"cudnn": "bn", "ops": "bn", "ours": "bn", "frozen": "frozen", "fused": "fused"}


def time_row(case: Case, min_run_time: float) -> dict[str, Any]:
    """The case's times (``<name>_ms``), each one's fraction of the copy bandwidth
    (``<name>_bandwidth``) and our ratios; ours None where our kernels are not built."""
    buffers = Rotating(case)
    times = {name: median_ms(fn, min_run_time) for name, fn in step_functions(case, buffers).items()}
    copy_ms = times.pop("copy")
    times = {NAMES[name]: ms for name, ms in times.items()}
    del buffers
    torch.cuda.empty_cache()
    copy_gbs = 2 * case_bytes(case) / (copy_ms * 1e-3) / 1e9
    row: dict[str, Any] = {**case.fields(), "copy_gbs": copy_gbs}
    for name in MODEL:
        ms = times.get(name)
        row[f"{name}_ms"] = ms
        row[f"{name}_bandwidth"] = None if ms is None else fraction(PASSES[MODEL[name]], case, ms, copy_gbs)
    ours = times.get("ours")
    row["ours_vs_ops"] = None if ours is None else ours / times["ops"]
    row["ours_vs_cudnn"] = None if ours is None else ours / times["cudnn"]
    print(row["case"], {name: round(ms, 3) for name, ms in times.items()}, flush=True)
    return row


TITLE = "CUDA: forward + backward against cuDNN and torch's SyncBN ops"
COLUMNS = [
    Column("case", "input"),
    Column("cudnn_ms", "cuDNN, ms", "{:.3f}"),
    Column("ops_ms", "torch SyncBN ops, ms", "{:.3f}"),
    Column("ours_ms", "ours, ms", "{:.3f}"),
    Column("ours_vs_ops", "ours, x ops", "{:.2f}x"),
    Column("ours_vs_cudnn", "ours, x cuDNN", "{:.2f}x"),
    Column("frozen_ms", "ours frozen, ms", "{:.3f}"),
    Column("fused_ms", "ours fused BN+ReLU+add, ms", "{:.3f}"),
]


def method(min_run_time: float) -> str:
    return (
        f"Medians of torch.utils.benchmark blocked_autorange (min_run_time {min_run_time} s) of one forward + "
        "backward, inputs rotating over buffers of 4x the L2 size; `torch SyncBN ops` is torch's SyncBatchNorm "
        "kernel sequence on one replica, `ours` the same sequence through our kernels; each row also holds every "
        "time as a fraction of the copy bandwidth (`y.copy_(x)` of the same size, same run) under traffic models "
        f"of {PASSES['bn']} passes for batch norm, {PASSES['frozen']} frozen and {PASSES['fused']} fused."
    )


def layout_text(layout: str, rows: list[dict[str, Any]]) -> str:
    """Our ratios on one layout: against the ops / cuDNN, with cuDNN's per dtype where there are several."""
    dtypes = dict.fromkeys(r["dtype"] for r in rows)
    per_dtype = ", ".join(f"{d} {span(r['ours_vs_cudnn'] for r in rows if r['dtype'] == d)}" for d in dtypes)
    both = sum(r["ours_vs_ops"] < 1 and r["ours_vs_cudnn"] < 1 for r in rows)
    return (
        f"{layout} {span(r['ours_vs_ops'] for r in rows)} / {span(r['ours_vs_cudnn'] for r in rows)} "
        f"(faster than both in {both} of {len(rows)} cases{f'; cuDNN {per_dtype}' if len(dtypes) > 1 else ''})"
    )


def summary(rows: list[dict[str, Any]]) -> str:
    """What the table says, from its rows (the hand-written cuda.json's summary is made by this too)."""
    built = [r for r in rows if r["ours_ms"] is not None]
    if not built:
        return "Our CUDA kernels were not built here: only cuDNN and torch's SyncBN ops were timed."
    layouts = dict.fromkeys(r["layout"] for r in built)
    worst = {key: max(built, key=lambda r: r[key]) for key in ("ours_vs_ops", "ours_vs_cudnn")}
    fractions = {key: [r[f"{key}_bandwidth"] for r in built if r.get(f"{key}_bandwidth") is not None]
                 for key in ("ours", "frozen", "fused")}
    bandwidth = (
        f" Under the traffic models ours reaches up to {max(fractions['ours']):.0%} of the copy bandwidth in batch "
        f"norm, {max(fractions['frozen']):.0%} frozen and {max(fractions['fused']):.0%} fused."
        if all(fractions.values()) else ""
    )
    return (
        "Against torch's SyncBN ops / cuDNN, ours takes: "
        f"{'; '.join(layout_text(layout, [r for r in built if r['layout'] == layout]) for layout in layouts)}. "
        f"Its slowest case against the ops is {worst['ours_vs_ops']['case']} ({worst['ours_vs_ops']['ours_vs_ops']:.2f}x), "
        f"against cuDNN {worst['ours_vs_cudnn']['case']} ({worst['ours_vs_cudnn']['ours_vs_cudnn']:.2f}x).{bandwidth}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only (64, 256, 56, 56) (default: every case)")
    parser.add_argument("--min-run-time", type=float, default=0.5, help="seconds per measurement (default: 0.5)")
    add_output_options(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_cuda: CUDA is not available (no GPU, or a CPU build of torch): nothing to measure")
        return 0
    try:
        backend.use_kernels(cuda="compiled")
    except RuntimeError as error:
        print(f"bench_cuda: {error}; timing torch's kernels only")
    torch.manual_seed(0)
    rows = timed_rows(cases(args.quick), args.min_run_time)
    output(args, "cuda", title=TITLE, method=method(args.min_run_time), columns=COLUMNS, rows=rows,
           summary=summary(rows), min_run_time=args.min_run_time, passes=PASSES)
    return 0


def timed_rows(all_cases: list[Case], min_run_time: float) -> list[dict[str, Any]]:
    """Every case's row; a run stopped from outside (SIGTERM, as `timeout` sends, or Ctrl-C) keeps
    the rows it finished, so that a bounded GPU check still writes what it measured."""
    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    rows: list[dict[str, Any]] = []
    try:
        for case in all_cases:
            rows.append(time_row(case, min_run_time))
    except KeyboardInterrupt:
        print(f"bench_cuda: stopped after {len(rows)} of {len(all_cases)} cases; writing those", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
