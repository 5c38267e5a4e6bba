"""CPU benchmark: nn.BatchNorm against our layers on one replica and under ThreadedDataParallel.

For each case (shape, layout, dtype) it times, with torch.utils.benchmark in one run:
  - forward (training mode, input requiring grad, as in a training step), and
  - forward + backward (torch.autograd.grad of the output for the input, weight and bias)
of nn.BatchNorm (the reference for every ratio), of our layer on one replica (the synchronized
Function through the compiled kernels, which is what a lone CPU replica runs), and of our layer
under ThreadedDataParallel with 2 and 4 replicas on the same total batch. It also measures the
device copy bandwidth and the peak memory that one forward + backward allocates (from the
profiler's allocation events), and writes the tables into benchmarks/RESULTS.md.

A second part times frozen batch norm and the fused residual + activation, forward + backward
(gradients for every input and parameter), against what a user runs without them:
  - frozen: ``nn.BatchNorm2d`` in eval mode with trainable weight and bias, against ours with
    ``frozen=True``;
  - fused: ``nn.BatchNorm2d`` (training), ``+ z`` and ReLU run separately, against ours with
    ``activation='relu'`` called as ``layer(x, z)``; and the same with frozen statistics.

    python benchmarks/bench_cpu.py                 # every case, ~5 minutes on 2 cores
    python benchmarks/bench_cpu.py --quick         # the (32, 64, 56, 56) float32 cases only
    python benchmarks/bench_cpu.py --part fused    # only the frozen and fused part
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import os
import platform
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils import benchmark

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from syncbn.functions import backend_info  # noqa: E402
from syncbn import nn as NN  # noqa: E402
from syncbn.modules.parallel import ThreadedDataParallel  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
BEGIN, END = "<!-- bench_cpu:begin -->", "<!-- bench_cpu:end -->"
FUSED_BEGIN, FUSED_END = "<!-- bench_cpu_fused:begin -->", "<!-- bench_cpu_fused:end -->"


def keyed_markers(name: str, key: str) -> tuple[str, str]:
    """The markers of benchmark ``name``'s section for ``key`` (a backend, a CPU capability), where
    RESULTS.md keeps one section per key so that each machine's run stays beside the others."""
    return f"<!-- {name}:{key}:begin -->", f"<!-- {name}:{key}:end -->"
T = TypeVar("T")


@dataclass(frozen=True)
class Case:
    shape: tuple[int, ...]
    channels_last: bool
    dtype: torch.dtype

    def label(self) -> str:
        layout = "channels_last" if self.channels_last else ("NCHW" if len(self.shape) == 4 else "(N, C)")
        return f"{self.shape} {layout} {str(self.dtype).replace('torch.', '')}"

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


def median_ms(fn: Callable[[], object], min_run_time: float) -> float:
    """Median time of fn in ms, with torch's intra-op threads as set in this process (Timer's
    own default is 1 thread)."""
    fn()  # warm up (allocator, thread pool)
    timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def interleaved_medians(fns: dict, min_run_time: float, rounds: int = 5) -> dict:
    """Median ms of each fn over ``rounds`` rounds that take every fn in turn: on a VM whose
    steal time comes in bursts, a burst then slows one round of each, not all rounds of one."""
    timers = {}
    for name, fn in fns.items():
        fn()  # warm up (allocator, thread pool)
        timers[name] = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    samples: dict = {name: [] for name in fns}
    for _ in range(rounds):
        for name, timer in timers.items():
            measurement = timer.blocked_autorange(min_run_time=min_run_time / rounds)
            samples[name] += measurement.times
    return {name: statistics.median(times) * 1e3 for name, times in samples.items()}


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


def copy_bandwidth_gbs(min_run_time: float) -> float:
    x = torch.randn(32, 64, 56, 56)
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x), min_run_time)
    return 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e9


def time_rows(quick: bool, min_run_time: float) -> list[str]:
    rows = []
    for case in cases(quick):
        x = case.input()
        dy = torch.randn_like(x)
        fns = {(name, what): fn for name, model in layers(case).items() for what, fn in step_functions(model, x, dy).items()}
        times = interleaved_medians(fns, min_run_time)
        row = [case.label()]
        for what in ("forward", "forward+backward"):
            base = times["torch", what]
            row.append(f"{base:.2f}")
            row += [f"{times[n, what]:.2f} ({times[n, what] / base:.2f}x)" for n in ("ours x1", "threads x2", "threads x4")]
        rows.append("| " + " | ".join(row) + " |")
        print(rows[-1], flush=True)
    return rows


def memory_rows(quick: bool) -> list[str]:
    """One row per case, measured in this process: run it where freed blocks go back to the OS
    (see measure_memory_in_a_fresh_process)."""
    rows = []
    for case in cases(quick):
        x = case.input()
        dy = torch.randn_like(x)
        row = [case.label(), f"{x.numel() * x.element_size() / 2**20:.0f}"]
        for model in layers(case).values():
            step = step_functions(model, x, dy)["forward+backward"]
            step()
            peak = peak_memory_mb(step)
            row.append("n/a" if peak is None else f"{peak:.0f}")
        rows.append("| " + " | ".join(row) + " |")
    return rows


def measure_memory_in_a_fresh_process(quick: bool) -> list[str]:
    """Memory rows from a fresh process whose glibc serves every block over 128 KiB by mmap and
    unmaps it when freed, so that the resident set follows the tensors alive (in this process,
    the timing's allocator settings keep freed blocks resident)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    command = [sys.executable, os.path.abspath(__file__), "--memory-rows", *(["--quick"] if quick else [])]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.startswith("| ")]


def report(times: list[str], memory: list[str], bandwidth: float, min_run_time: float, allocator: str) -> str:
    return "\n".join([
        BEGIN,
        "## CPU (`benchmarks/bench_cpu.py`)",
        "",
        machine_line(bandwidth, min_run_time, allocator),
        "",
        "`ours x1` is our layer on one replica (the synchronized Function through the compiled "
        "kernels); `threads xR` is `ThreadedDataParallel` over R CPU replicas on the same total "
        "batch. Forward is a training-mode forward of an input that requires grad; "
        "forward+backward adds `torch.autograd.grad` for input, weight and bias.",
        "",
        "| case | torch fwd | ours x1 fwd | threads x2 fwd | threads x4 fwd "
        "| torch fwd+bwd | ours x1 fwd+bwd | threads x2 fwd+bwd | threads x4 fwd+bwd |",
        "|---|---|---|---|---|---|---|---|---|",
        *times,
        "",
        "Peak memory of one forward + backward: how far the resident set rose above its level "
        "before the step (MB; the input and dy, allocated before, are not counted):",
        "",
        "| case | input | torch | ours x1 | threads x2 | threads x4 |",
        "|---|---|---|---|---|---|",
        *memory,
        END,
    ])


def _cpu_ticks() -> tuple[int, int] | None:
    """(stolen, all) clock ticks of the machine's CPUs since boot, from /proc/stat's first line
    (user nice system idle iowait irq softirq steal ...; guest time is counted in user already);
    None where unknown."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    ticks = [int(value) for value in fields[1:9]]
    return ticks[7], sum(ticks)


class StolenShare:
    """Within a ``with`` block, the share of the machine's CPU time that the hypervisor gave to
    other guests (steal time): ``share``, 0 to 1, None where /proc/stat does not say. A VM's
    timings are comparable only between spells of like steal."""

    share: float | None = None

    def __enter__(self) -> "StolenShare":
        self._start = _cpu_ticks()
        return self

    def __exit__(self, *exc: object) -> None:
        end = _cpu_ticks()
        if self._start is not None and end is not None and end[1] > self._start[1]:
            self.share = (end[0] - self._start[0]) / (end[1] - self._start[1])


def least_stolen(measure: Callable[[], T], tries: int = 2, calm: float = 0.05) -> tuple[T, float | None]:
    """``measure()``, taken again (``tries`` in all) while the hypervisor stole more than ``calm``
    of the CPU time during it: the result of the least stolen try, with its stolen share. Every
    contender of a row is in each try, so a retry favours none of them."""
    best: tuple[T, float | None] | None = None
    for _ in range(tries):
        with StolenShare() as stolen:
            result = measure()
        if best is None or (stolen.share is not None and (best[1] is None or stolen.share < best[1])):
            best = (result, stolen.share)
        if stolen.share is None or stolen.share <= calm:
            break
    assert best is not None
    return best


def stolen_text(share: float | None) -> str:
    """A stolen share as a row prints it: "3%", or "?" where unknown."""
    return "?" if share is None else f"{share:.0%}"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line(bandwidth: float, min_run_time: float, allocator: str) -> str:
    cpu = f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()})"
    return (
        f"Machine: {os.cpu_count()}-core {cpu} VM, {torch.get_num_threads()} torch threads, no GPU; "
        f"torch {torch.__version__}, Python {platform.python_version()}; backends {backend_info()}; "
        f"{datetime.date.today().isoformat()}. Copy bandwidth (32x64x56x56 float32, read + write): "
        f"{bandwidth:.1f} GB/s. Medians of `torch.utils.benchmark` blocked_autorange "
        f"(min_run_time {min_run_time} s per contender, in 5 rounds that take the contenders in "
        f"turn), in ms; ratios against torch in the same run; "
        f"{allocator}."
    )


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
    """name: (torch's module, ours, takes z), with equal parameters and running statistics
    (float32, as under autocast); modules that are to be frozen are set so."""
    frozen_torch = nn.BatchNorm2d(C).eval()  # weight and bias still require grad
    return {
        "frozen": (frozen_torch, NN.BatchNorm2d(C, frozen=True), False),
        "BN+add+ReLU": (TorchUnfused(nn.BatchNorm2d(C)), NN.BatchNorm2d(C, activation="relu"), True),
        "frozen BN+add+ReLU": (TorchUnfused(nn.BatchNorm2d(C).eval()), NN.BatchNorm2d(C, frozen=True, activation="relu"), True),
    }


def fused_step(model: nn.Module, x: torch.Tensor, z: torch.Tensor | None, dy: torch.Tensor) -> Callable[[], object]:
    """Forward + backward: gradients for x (and z) and every parameter."""
    inputs = [x, *([z] if z is not None else []), *model.parameters()]
    args = (x,) if z is None else (x, z)
    return lambda: torch.autograd.grad(model(*args), inputs, dy)


def fused_rows(quick: bool, min_run_time: float) -> list[str]:
    rows = []
    for case in fused_cases(quick):
        x = case.input()
        z, dy = torch.randn_like(x).requires_grad_(), torch.randn_like(x)
        for name, (theirs, ours, takes_z) in fused_contenders(case.shape[1]).items():
            medians = interleaved_medians({m: fused_step(m, x, z if takes_z else None, dy) for m in (theirs, ours)}, min_run_time)
            times = [medians[theirs], medians[ours]]
            rows.append(f"| {case.label()} | {name} | {times[0]:.2f} | {times[1]:.2f} | {times[1] / times[0]:.2f}x |")
            print(rows[-1], flush=True)
    return rows


def fused_report(rows: list[str], bandwidth: float, min_run_time: float, allocator: str) -> str:
    return "\n".join([
        FUSED_BEGIN,
        "## CPU: frozen batch norm and fused residual + activation (`bench_cpu.py --part fused`)",
        "",
        machine_line(bandwidth, min_run_time, allocator),
        "",
        "Forward + backward (`torch.autograd.grad` for the input, the residual z where there is "
        "one, weight and bias). `frozen`: `nn.BatchNorm2d` in eval mode with trainable weight and "
        "bias against ours with `frozen=True` (in training mode). `BN+add+ReLU`: `nn.BatchNorm2d` "
        "(training), `+ z` and `F.relu` run separately against ours with `activation='relu'` "
        "called as `layer(x, z)`. `frozen BN+add+ReLU`: the same with statistics frozen (torch's in "
        "eval mode).",
        "",
        "| case | what | torch, separately | ours, fused | ratio |",
        "|---|---|---|---|---|",
        *rows,
        FUSED_END,
    ])


def publish(section: str, write: bool, begin: str = BEGIN, end: str = END) -> None:
    """Print ``section``, and put it into RESULTS.md when ``write`` (see :func:`write_results`)."""
    print(section)
    if write:
        write_results(section, begin, end)


def write_results(section: str, begin: str = BEGIN, end: str = END) -> None:
    """Put ``section`` (which starts with ``begin`` and ends with ``end``) into RESULTS.md in
    place of the one between those markers, or at its end."""
    text = open(RESULTS).read() if os.path.exists(RESULTS) else "# Benchmark results\n"
    if begin in text and end in text:
        text = text[: text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    with open(RESULTS, "w") as f:
        f.write(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only (32, 64, 56, 56) float32")
    parser.add_argument("--part", choices=["all", "layers", "fused"], default="all",
                        help="layers: nn.BatchNorm against ours and ThreadedDataParallel; fused: frozen and fused")
    parser.add_argument("--min-run-time", type=float, default=1.0, help="seconds per measurement")
    parser.add_argument("--no-write", action="store_true", help="print, do not touch RESULTS.md")
    parser.add_argument("--memory-rows", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_rows:
        print("\n".join(memory_rows(args.quick)))
        return
    torch.manual_seed(0)
    allocator = "glibc malloc, freed blocks kept (see keep_freed_blocks)" if keep_freed_blocks() else "default allocator"
    bandwidth = copy_bandwidth_gbs(args.min_run_time)
    sections = []
    if args.part in ("all", "layers"):
        times = time_rows(args.quick, args.min_run_time)
        memory = measure_memory_in_a_fresh_process(args.quick)
        sections.append((report(times, memory, bandwidth, args.min_run_time, allocator), BEGIN, END))
    if args.part in ("all", "fused"):
        rows = fused_rows(args.quick, args.min_run_time)
        sections.append((fused_report(rows, bandwidth, args.min_run_time, allocator), FUSED_BEGIN, FUSED_END))
    for section, begin, end in sections:
        publish(section, not args.no_write, begin, end)


if __name__ == "__main__":
    main()
