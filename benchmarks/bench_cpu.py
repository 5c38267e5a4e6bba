"""CPU benchmark: nn.BatchNorm against our layers on one replica and under ThreadedDataParallel.

Part ``layers`` (result ``cpu_layers``): per case (shape, layout, dtype), forward (training mode,
input requiring grad) and forward + backward (torch.autograd.grad for input, weight and bias) of
nn.BatchNorm (the reference of every ratio), of our layer on one replica (what a lone CPU replica
runs), and of our layer under ThreadedDataParallel with 2 and 4 replicas on the same total batch;
and, in a fresh process, how far one forward + backward raises the resident memory.

Part ``fused`` (result ``cpu_fused``): forward + backward (gradients for every input and
parameter) of ``nn.BatchNorm2d`` in eval mode with trainable affine against ours with
``frozen=True``, and of ``nn.BatchNorm2d`` + ``z`` + ReLU run separately against ours with
``activation='relu'`` called as ``layer(x, z)``, with batch and with frozen statistics.

Each part writes ``benchmarks/results/<name>.json`` (``benchmarks/results.py``), from which
``python benchmarks/report.py`` makes RESULTS.md.

    python benchmarks/bench_cpu.py                 # both parts, every case, ~5 minutes on 2 cores
    python benchmarks/bench_cpu.py --quick         # the (32, 64, 56, 56) float32 cases only
    python benchmarks/bench_cpu.py --part fused    # only the frozen and fused part
    python benchmarks/bench_cpu.py --quick --no-write   # print the tables, write nothing

The other benchmarks share its helpers: interleaved timing, steal time, the copy bandwidth, the
memory and the allocator; the timing helpers are in ``timing.py``, the output ones in ``results.py``.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import Column, add_output_options, output, span  # noqa: E402
from timing import copy_bandwidth_gbs, interleaved_medians  # noqa: E402
from syncbn import nn as NN  # noqa: E402
from syncbn.modules.parallel import ThreadedDataParallel  # noqa: E402

Row = dict[str, Any]
CONTENDERS = ("torch", "ours x1", "threads x2", "threads x4")


@dataclass(frozen=True)
class Case:
    shape: tuple[int, ...]
    channels_last: bool
    dtype: torch.dtype

    def layout(self) -> str:
        return "channels_last" if self.channels_last else {4: "NCHW", 3: "(N, C, L)"}.get(len(self.shape), "(N, C)")

    def fields(self) -> Row:
        """The case as a row names it: its label, layout and dtype."""
        dtype = str(self.dtype).replace("torch.", "")
        return {"case": f"{self.shape} {self.layout()} {dtype}", "layout": self.layout(), "dtype": dtype}

    def label(self) -> str:
        return self.fields()["case"]

    def input(self) -> torch.Tensor:
        x = torch.randn(self.shape, dtype=self.dtype)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x.requires_grad_()


def cases(quick: bool) -> list[Case]:
    shapes = [(32, 64, 56, 56)] if quick else [(32, 64, 56, 56), (8, 256, 28, 28), (64, 512, 7, 7)]
    dtypes = [torch.float32] if quick else [torch.float32, torch.bfloat16]
    out = [Case(s, cl, d) for s in shapes for cl in (False, True) for d in dtypes]
    if not quick:
        out += [Case((256, 2048), False, d) for d in dtypes]
    return out


def layers(case: Case) -> dict[str, nn.Module]:
    """The four contenders, with identical parameters (float32, as under autocast)."""
    C = case.shape[1]
    torch_cls = nn.BatchNorm1d if len(case.shape) == 2 else nn.BatchNorm2d
    ours = NN.convert_sync_batchnorm(torch_cls(C))
    return {
        "torch": torch_cls(C),
        "ours x1": ours,
        "threads x2": ThreadedDataParallel(ours, ["cpu"] * 2),
        "threads x4": ThreadedDataParallel(ours, ["cpu"] * 4),
    }


def step_functions(model: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict[str, Callable[[], object]]:
    params = [p for p in model.parameters()]

    def forward():
        return model(x)

    def forward_backward():
        return torch.autograd.grad(model(x), [x, *params], dy)

    return {"forward": forward, "forward+backward": forward_backward}


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def _mallopt(*settings: tuple[int, int]) -> bool:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return all(libc.mallopt(param, value) == 1 for param, value in settings) and libc.malloc_trim(0) >= 0


def keep_freed_blocks() -> bool:
    """Timing: glibc keeps freed blocks up to 32 MiB in its heap and reuses them (fixed
    M_MMAP_THRESHOLD and M_TRIM_THRESHOLD, much as jemalloc or tcmalloc, which PyTorch's CPU
    performance guide recommends, behave). With glibc's dynamic defaults, whether a step's
    fresh output is page-faulted in again (~10 ms per 25 MB on this VM) depends on the order
    of frees, which made medians swing by 2x between runs of the same case."""
    return _mallopt((M_MMAP_THRESHOLD, 32 * 2**20), (M_TRIM_THRESHOLD, 2**30))


def allocator() -> str:
    """Keeps freed blocks where it can (keep_freed_blocks) and says which allocator times."""
    return "glibc malloc, freed blocks kept (see keep_freed_blocks)" if keep_freed_blocks() else "default allocator"


def peak_memory_mb(fn: Callable[[], object]) -> float | None:
    """How far the process's resident memory rose above where it stood, at most, during fn
    (Linux: VmHWM after resetting it through /proc/self/clear_refs; every thread counts).
    None where that is not available."""
    try:
        gc.collect()
        base = _status_kb("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        fn()
        return (_status_kb("VmHWM") - base) / 1024
    except OSError:
        return None


def time_row(case: Case, min_run_time: float) -> Row:
    """The case's medians (ms): ``<contender>_ms`` forward + backward, ``<contender>_forward_ms``;
    and the ratios the table shows, against torch."""
    x = case.input()
    dy = torch.randn_like(x)
    fns = {(name, what): fn for name, model in layers(case).items() for what, fn in step_functions(model, x, dy).items()}
    t = interleaved_medians(fns, min_run_time)
    row = case.fields()
    for name in CONTENDERS:
        key = name.replace(" ", "_")
        row[f"{key}_ms"], row[f"{key}_forward_ms"] = t[name, "forward+backward"], t[name, "forward"]
        row[key] = t[name, "forward+backward"] / t["torch", "forward+backward"]
    row["ours_x1_forward"] = t["ours x1", "forward"] / t["torch", "forward"]
    print(row["case"], {name: round(t[name, "forward+backward"], 2) for name in CONTENDERS}, flush=True)
    return row


def memory_row(case: Case) -> Row:
    """The input's MB and each contender's ``<contender>_peak_mb`` (None where unknown), measured in
    this process: run it where freed blocks go back to the OS (see memory_in_a_fresh_process)."""
    x = case.input()
    dy = torch.randn_like(x)
    row: Row = {"input_mb": x.numel() * x.element_size() / 2**20}
    for name, model in layers(case).items():
        step = step_functions(model, x, dy)["forward+backward"]
        step()
        row[name.replace(" ", "_") + "_peak_mb"] = peak_memory_mb(step)
    return row


def memory_in_a_fresh_process(quick: bool) -> list[Row]:
    """memory_row of every case, from a fresh process whose glibc serves every block over 128 KiB
    by mmap and unmaps it when freed, so that the resident set follows the tensors alive (here the
    timing's allocator settings keep freed blocks resident)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    command = [sys.executable, os.path.abspath(__file__), "--memory-rows", *(["--quick"] if quick else [])]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


LAYER_COLUMNS = [
    Column("case", "input"),
    Column("torch_ms", "nn.BatchNorm, ms", "{:.2f}"),
    Column("ours_x1", "ours x1, x torch", "{:.2f}x"),
    Column("threads_x2", "threads x2, x torch", "{:.2f}x"),
    Column("threads_x4", "threads x4, x torch", "{:.2f}x"),
    Column("ours_x1_forward", "ours x1 forward only, x torch", "{:.2f}x"),
    Column("torch_peak_mb", "nn.BatchNorm peak, MB", "{:.0f}"),
    Column("ours_x1_peak_mb", "ours x1 peak, MB", "{:.0f}"),
]


def memory_text(rows: list[Row]) -> tuple[str, str]:
    """What the peaks say, for one replica and for 4 threads ("" where unknown)."""
    rows = [r for r in rows if None not in (r["torch_peak_mb"], r["ours_x1_peak_mb"], r["threads_x4_peak_mb"])
            and r["torch_peak_mb"] > 0]
    if not rows:
        return "", ""
    if max(abs(r["ours_x1_peak_mb"] - r["torch_peak_mb"]) for r in rows) <= 1:
        one = " and the same peak memory (within 1 MB)"
    else:
        one = f" and {span(r['ours_x1_peak_mb'] / r['torch_peak_mb'] for r in rows)} its peak memory"
    four = span((r["threads_x4_peak_mb"] / r["torch_peak_mb"] for r in rows), digits=1)
    return one, f", and {four} its peak memory with 4"


def layers_summary(rows: list[Row]) -> str:
    dtypes = dict.fromkeys(r["dtype"] for r in rows)
    per_dtype = ", ".join(f"{d} {span(r['ours_x1'] for r in rows if r['dtype'] == d)}" for d in dtypes)
    one, four = memory_text(rows)
    return (
        f"On one replica ours takes {span(r['ours_x1'] for r in rows)} the time of nn.BatchNorm forward + "
        f"backward{f' ({per_dtype})' if len(dtypes) > 1 else ''}{one}. Under ThreadedDataParallel the same total "
        f"batch takes {span(r['threads_x2'] for r in rows)} its time with 2 replicas and "
        f"{span(r['threads_x4'] for r in rows)} with 4 on this {os.cpu_count()}-core machine{four}."
    )


def timing_method(min_run_time: float, bandwidth: float, allocator: str) -> Callable[[str], str]:
    """The method sentence of an interleaved CPU timing, given what was timed."""
    return lambda what: (
        f"Medians of torch.utils.benchmark blocked_autorange with {torch.get_num_threads()} torch threads over 5 "
        f"rounds that take the contenders in turn (min_run_time {min_run_time} s per contender in all); {what}; "
        f"copy bandwidth {bandwidth:.1f} GB/s; {allocator}."
    )


def run_layers(args: argparse.Namespace, method: Callable[[str], str]) -> None:
    rows = [time_row(case, args.min_run_time) for case in cases(args.quick)]
    for row, memory in zip(rows, memory_in_a_fresh_process(args.quick)):
        row.update(memory)
    what = ("forward + backward is a training-mode forward and torch.autograd.grad for input, weight and bias; "
            "`ours x1` is our layer on one replica, `threads xR` ThreadedDataParallel over R CPU replicas on the "
            "same total batch; peak memory is how far one step raised the resident set, in a fresh process")
    title = "CPU: forward + backward against nn.BatchNorm, one replica and ThreadedDataParallel"
    output(args, "cpu_layers", title=title, method=method(what), columns=LAYER_COLUMNS, rows=rows,
           summary=layers_summary(rows), min_run_time=args.min_run_time)


def fused_cases(quick: bool) -> list[Case]:
    shapes = [(32, 64, 56, 56)] if quick else [(32, 64, 56, 56), (8, 256, 28, 28)]
    dtypes = [torch.float32] if quick else [torch.float32, torch.bfloat16]
    return [Case(s, cl, d) for s in shapes for cl in (False, True) for d in dtypes]


class TorchUnfused(nn.Module):
    """relu(bn(x) + z) as three ops of torch."""

    def __init__(self, bn: nn.Module) -> None:
        super().__init__()
        self.bn = bn

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(x) + z)


def fused_contenders(C: int) -> dict[str, tuple[nn.Module, nn.Module, bool]]:
    """key: (torch's module, ours, takes z), with equal parameters and running statistics
    (float32, as under autocast); modules that are to be frozen are set so."""
    frozen_torch = nn.BatchNorm2d(C).eval()  # weight and bias still require grad
    return {
        "frozen": (frozen_torch, NN.BatchNorm2d(C, frozen=True), False),
        "fused": (TorchUnfused(nn.BatchNorm2d(C)), NN.BatchNorm2d(C, activation="relu"), True),
        "frozen_fused": (TorchUnfused(nn.BatchNorm2d(C).eval()), NN.BatchNorm2d(C, frozen=True, activation="relu"), True),
    }


def fused_step(model: nn.Module, x: torch.Tensor, z: torch.Tensor | None, dy: torch.Tensor) -> Callable[[], object]:
    """Forward + backward: gradients for x (and z) and every parameter."""
    inputs = [x, *([z] if z is not None else []), *model.parameters()]
    args = (x,) if z is None else (x, z)
    return lambda: torch.autograd.grad(model(*args), inputs, dy)


FUSED = {"frozen": "frozen", "fused": "BN+add+ReLU", "frozen_fused": "frozen BN+add+ReLU"}
FUSED_COLUMNS = [Column("case", "input")] + [
    column for key, label in FUSED.items()
    for column in (Column(f"{key}_torch_ms", f"{label}: torch, ms", "{:.2f}"),
                   Column(key, f"{label}: ours, x torch", "{:.2f}x"))
]


def fused_row(case: Case, min_run_time: float) -> Row:
    """Per contender: ``<key>_torch_ms``, ``<key>_ours_ms`` and the ratio ``<key>``."""
    x = case.input()
    z, dy = torch.randn_like(x).requires_grad_(), torch.randn_like(x)
    row = case.fields()
    for key, (theirs, ours, takes_z) in fused_contenders(case.shape[1]).items():
        t = interleaved_medians({m: fused_step(m, x, z if takes_z else None, dy) for m in (theirs, ours)}, min_run_time)
        row.update({f"{key}_torch_ms": t[theirs], f"{key}_ours_ms": t[ours], key: t[ours] / t[theirs]})
    print(row["case"], {key: round(row[key], 2) for key in FUSED}, flush=True)
    return row


def fused_summary(rows: list[Row]) -> str:
    ratios = [row[key] for row in rows for key in FUSED]
    slower = [r for r in ratios if r > 1]
    tail = (f"ours is slower in {len(slower)} of {len(ratios)} cases (up to {max(slower):.2f}x)" if slower
            else "ours is faster in every case")
    return (
        f"Frozen, ours takes {span(r['frozen'] for r in rows)} the time of nn.BatchNorm2d in eval mode with "
        f"trainable weight and bias; fused BN + add + ReLU {span(r['fused'] for r in rows)} the time of torch's "
        f"three separate ops, and {span(r['frozen_fused'] for r in rows)} with frozen statistics. Against torch, {tail}."
    )


def run_fused(args: argparse.Namespace, method: Callable[[str], str]) -> None:
    rows = [fused_row(case, args.min_run_time) for case in fused_cases(args.quick)]
    what = ("forward + backward with gradients for the input, the residual z where there is one, weight and bias; "
            "`frozen`: nn.BatchNorm2d in eval mode with trainable weight and bias against ours with frozen=True; "
            "`BN+add+ReLU`: nn.BatchNorm2d (training), + z and F.relu run separately against ours with "
            "activation='relu' called as layer(x, z); `frozen BN+add+ReLU`: the same, statistics frozen")
    output(args, "cpu_fused", title="CPU: frozen batch norm and fused residual + activation, forward + backward",
           method=method(what), columns=FUSED_COLUMNS, rows=rows, summary=fused_summary(rows),
           min_run_time=args.min_run_time)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only (32, 64, 56, 56) float32 (default: every case)")
    parser.add_argument("--part", choices=["all", "layers", "fused"], default="all",
                        help="layers: cpu_layers; fused: cpu_fused; all: both (default: all)")
    parser.add_argument("--min-run-time", type=float, default=1.0, help="seconds per contender and case (default: 1.0)")
    add_output_options(parser)
    parser.add_argument("--memory-rows", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_rows:
        print(json.dumps([memory_row(case) for case in cases(args.quick)]))
        return
    torch.manual_seed(0)
    method = timing_method(args.min_run_time, copy_bandwidth_gbs(args.min_run_time), allocator())
    if args.part in ("all", "layers"):
        run_layers(args, method)
    if args.part in ("all", "fused"):
        run_fused(args, method)


if __name__ == "__main__":
    main()
