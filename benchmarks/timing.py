"""How the benchmarks time: ``torch.utils.benchmark`` medians, contenders interleaved over rounds
(a VM's steal comes in bursts: a burst then slows one round of each contender, not every round of
one), the copy bandwidth that the memory-bound kernels are compared against, and the share of the
CPU that the hypervisor stole during a measurement."""
from __future__ import annotations

import statistics
from typing import Any, Callable, TypeVar

import torch
from torch.utils import benchmark

T = TypeVar("T")


def median_ms(fn: Callable[[], object], min_run_time: float) -> float:
    """Median time of fn in ms, with torch's intra-op threads as set in this process (Timer's
    own default is 1 thread)."""
    fn()  # warm up (allocator, thread pool)
    timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def interleaved_samples(fns: dict, min_run_time: float, rounds: int = 5) -> dict[Any, list[list[float]]]:
    """Each fn's times (s), per round, over ``rounds`` rounds that take every fn in turn: on a VM
    whose steal time comes in bursts, a burst then slows one round of each, not all rounds of one."""
    timers = {}
    for name, fn in fns.items():
        fn()  # warm up (allocator, thread pool)
        timers[name] = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    samples: dict[Any, list[list[float]]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, timer in timers.items():
            samples[name].append(list(timer.blocked_autorange(min_run_time=min_run_time / rounds).times))
    return samples


def interleaved_medians(fns: dict, min_run_time: float, rounds: int = 5) -> dict:
    """Median ms of each fn over all rounds of :func:`interleaved_samples`."""
    samples = interleaved_samples(fns, min_run_time, rounds)
    return {name: statistics.median(t for times in per_round for t in times) * 1e3
            for name, per_round in samples.items()}


def copy_bandwidth_gbs(min_run_time: float) -> float:
    x = torch.randn(32, 64, 56, 56)
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x), min_run_time)
    return 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e9


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
