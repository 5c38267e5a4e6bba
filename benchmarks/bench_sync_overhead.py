"""What synchronizing costs per layer, where kernels cost nothing: the host's price of a meeting.

Writes the result ``sync_overhead`` (``benchmarks/results/sync_overhead.json``, see
``benchmarks/results.py``; ``report.py`` puts it into RESULTS.md, ``plots.py`` draws
``docs/img/sync_overhead.png`` from it): a row per path, in microseconds, with ours, torch's
unsynced layer in the same setting, what synchronizing adds, and of that the meeting (the
collectives in place, the ResNet's meetings) and our own part. Per layer = (step with 16 stacked
layers - step with 1 layer) / 15, a step being forward + backward (the input requires grad, as
inside a network) of a tiny (8, 8, 4, 4) float32 input, one intra-op thread; the ResNet's rows
are per training step:

- threads: ``ThreadedDataParallel(["cpu"] * R)`` over our ``SyncBatchNorm2d`` against
  ``nn.BatchNorm2d`` (unsynced) in the same wrapper, R = 2, 4, 8; our replicas meet natively
  (one call per layer and direction); and our ``InPlaceABN`` against ``nn.BatchNorm2d`` with an
  in-place LeakyReLU, each layer on a copy of its input (a multiplication by 1);
- processes: R Gloo ranks on loopback under DDP, ours against ``nn.BatchNorm2d`` and against
  torch's layer making our two collectives where ours makes them (the meeting in place, with the
  ranks' skew between collectives); every rank runs the same fixed number of steps, the slowest
  rank of each repeat counts; checks read at each layer (CPU tensors' default) and deferred
  (``checks.DEFER_ON_HOST``, CUDA's default); the two collectives back to back are kept as
  ``collectives_alone_us``;
- our own part across processes without the collectives: this process posing as a rank of a world
  of 2 whose collectives cost nothing;
- a lone replica's fixed cost: our ``SyncBatchNorm2d`` with no wrapper and no process group against
  ``nn.BatchNorm2d``, on ``bench_toolchain.FIXED_COST_SHAPE``;
- a small ResNet (stem + 8 basic blocks: 17 batch norms) per training step under 4 thread
  replicas, converted against unsynced, and the converted net whose layers meet no one (each
  replica normalizing its own chunk through the same native call); with one intra-op thread and
  the process's default (shared among the replicas; and torch's step once more with every replica
  starting a team of all of them); the contenders alternate step by step (blocks of steps taken in
  turn let a slow spell of a VM fall on one contender), measured first, while
  ThreadedDataParallel's pool of worker threads holds only theirs.

A cost is the difference of the contenders' medians over the rounds, and its noise half the range
of that difference over the rounds (the ResNet's: over blocks of alternating steps); a cost within
its noise is written "within noise (±X us)", one below zero "none (X ± N less)". Each row keeps
the share of the VM's CPU time the hypervisor stole while it ran (``timing.StolenShare``) and
is measured once more where that exceeded 5%, the less stolen of the two kept.

    python benchmarks/bench_sync_overhead.py                        # every row, writes the result
    python benchmarks/bench_sync_overhead.py --quick --no-write     # 2 and 4 replicas, 2 ranks; prints only
    python benchmarks/bench_sync_overhead.py --quick --rounds 2 --steps 20 --results-dir /tmp/results
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from statistics import median
from typing import Callable
from unittest import mock

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils import benchmark

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import results  # noqa: E402
from timing import least_stolen  # noqa: E402
from bench_toolchain import FIXED_COST_SHAPE, fixed_cost_steps  # noqa: E402
from results import Column  # noqa: E402
from syncbn.functions.synchronization import checks, distributed  # noqa: E402
import syncbn.modules.batchnorm  # noqa: E402
import syncbn.functions.synchronization.replica_threads  # noqa: E402
from syncbn import nn as NN  # noqa: E402
from syncbn.modules.parallel import ThreadedDataParallel  # noqa: E402
from testkit.local_group import run_local_group  # noqa: E402
from collectives_in_place import BatchNormWithCollectives, collectives_alone  # noqa: E402
from resnet_step import resnet_row, resnet_without_thread_shares  # noqa: E402

SHAPE = (8, 8, 4, 4)
DEEP = 16


def stack(layer: Callable[[int], nn.Module], depth: int) -> nn.Module:
    return nn.Sequential(*[layer(SHAPE[1]) for _ in range(depth)])


class OnACopy(nn.Module):
    """An in-place activated layer on a copy of its input (in place on its predecessor's output,
    it would write over what that one saved), or torch's batch norm and LeakyReLU the same way."""

    def __init__(self, channels: int, ours: bool) -> None:
        super().__init__()
        self.ours = ours
        self.layer = NN.InPlaceABN(channels) if ours else nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer(x * 1.0)
        return y if self.ours else nn.functional.leaky_relu(y, 0.01, inplace=True)


THREADS_ROWS = {
    "": (NN.SyncBatchNorm2d, nn.BatchNorm2d),
    ", InPlaceABN against BatchNorm2d + LeakyReLU, each on a copy": (
        functools.partial(OnACopy, ours=True), functools.partial(OnACopy, ours=False)),
}
"""The layers of the thread rows, ours and torch's, by what the row's label adds."""


def step_of(runner: nn.Module, rows: int) -> benchmark.Timer:
    x = torch.randn(rows, *SHAPE[1:], requires_grad=True)
    return benchmark.Timer("runner(x).sum().backward()", globals=dict(runner=runner, x=x))


def per_layer(deep: float, shallow: float) -> float:
    return (deep - shallow) / (DEEP - 1)


Samples = dict  # a figure's key -> its seconds in each round (or repeat, or block of steps)
Cost = tuple[float, float]  # seconds, and its noise


def interleaved(timers: dict, min_run_time: float, rounds: int) -> Samples:
    """Each timer's median seconds in each of ``rounds`` rounds that take the timers in turn."""
    samples: Samples = {key: [] for key in timers}
    for timer in timers.values():
        timer.timeit(3)  # workers started, caches warm
    for _ in range(rounds):
        for key, timer in timers.items():
            samples[key].append(timer.blocked_autorange(min_run_time=min_run_time).median)
    return samples


def layer_samples(t: Samples, key: Callable[[int], object] = lambda depth: depth) -> list[float]:
    """Per-layer seconds in each round, from the rounds of the deep and the shallow stack."""
    return [per_layer(deep, shallow) for deep, shallow in zip(t[key(DEEP)], t[key(1)])]


def spread(values: list[float]) -> float:
    """A figure's noise: half its range over the repeats."""
    return (max(values) - min(values)) / 2 if len(values) > 1 else 0.0


def cost(plus: list[list[float]], minus: list[list[float]]) -> Cost:
    """The medians of ``plus`` summed less those of ``minus``, with the noise of that sum taken
    repeat by repeat (the lists hold one figure per repeat)."""
    per_repeat = [sum(s[r] for s in plus) - sum(s[r] for s in minus) for r in range(len(plus[0]))]
    return sum(map(median, plus)) - sum(map(median, minus)), spread(per_repeat)


def threads_row(replicas: int, min_run_time: float, rounds: int, layers: tuple = THREADS_ROWS[""]) -> tuple[list[float], list[float]]:
    """Per-layer seconds, round by round, of ours and of torch's unsynced layer (``layers``)
    under R thread replicas."""
    timers = {
        (kind, depth): step_of(ThreadedDataParallel(stack(layer, depth), ["cpu"] * replicas), SHAPE[0])
        for kind, layer in zip(("ours", "torch"), layers)
        for depth in (1, DEEP)
    }
    t = interleaved(timers, min_run_time, rounds)
    return layer_samples(t, lambda depth: ("ours", depth)), layer_samples(t, lambda depth: ("torch", depth))


def time_fixed(fn: Callable[[], object], number: int) -> float:
    """Seconds a call of ``fn``, over ``number`` calls after a first one."""
    fn()
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number


def ddp_model(layer: type, depth: int) -> nn.Module:
    return DistributedDataParallel(stack(layer, depth), forward_sync_buffers=False)


def ranks_row(rank: int, world: int, number: int, repeats: int) -> Samples:
    """Per-layer seconds on this rank in each of ``repeats`` rounds: ours with the checks at the
    layer and deferred, torch's, torch's with the two collectives in place
    (:class:`BatchNormWithCollectives`), and the two collectives alone, taken in turn (every rank
    runs the same sequence: collectives need all ranks)."""
    x = torch.randn(SHAPE, requires_grad=True)
    ours = {depth: ddp_model(NN.SyncBatchNorm2d, depth) for depth in (1, DEEP)}
    theirs = {depth: ddp_model(nn.BatchNorm2d, depth) for depth in (1, DEEP)}
    placed = {depth: ddp_model(BatchNormWithCollectives, depth) for depth in (1, DEEP)}
    both = collectives_alone(SHAPE[1])
    samples: dict = {key: [] for key in ("layer", "step", "torch", "placed", "collectives")}
    for _ in range(repeats):
        for mode in ("layer", "step"):
            checks.DEFER_ON_HOST = mode == "step"
            t = [time_fixed(lambda m=ours[depth]: m(x).sum().backward(), number) for depth in (1, DEEP)]
            checks.check_pending()
            samples[mode].append(per_layer(t[1], t[0]))
        checks.DEFER_ON_HOST = False
        for key, models in (("torch", theirs), ("placed", placed)):
            t = [time_fixed(lambda m=models[depth]: m(x).sum().backward(), number) for depth in (1, DEEP)]
            samples[key].append(per_layer(t[1], t[0]))
        samples["collectives"].append(time_fixed(both, number * DEEP // 4))
    return samples


def slowest(per_rank: list[Samples]) -> Samples:
    """Each figure of the slowest rank in each repeat."""
    return {key: [max(values) for values in zip(*(rank[key] for rank in per_rank))] for key in per_rank[0]}


def free_collectives_row(min_run_time: float, rounds: int) -> Samples:
    """Per-layer seconds, round by round, of ours (checks at the layer, and deferred) and of torch's layer in this
    process posing as a rank of a world of 2 whose collectives cost nothing (the all_gather
    returns this rank's row twice, the all_reduce doubles): our own host cost across processes,
    free of the collectives' latency and of the ranks' skew, which the DDP rows include."""
    group = object()
    patches = [
        mock.patch.object(distributed.dist, "get_world_size", lambda group=None: 2),
        mock.patch.object(distributed, "_all_gather_rows", lambda row, group: torch.stack([row, row])),
        mock.patch.object(distributed.dist, "all_reduce", lambda t, group=None: t.mul_(2)),
        mock.patch.object(syncbn.modules.batchnorm, "active_process_group", lambda process_group, label: group),
    ]
    for patch in patches:
        patch.start()
    try:
        result = {}
        for mode in ("layer", "step"):
            checks.DEFER_ON_HOST = mode == "step"
            timers = {depth: step_of(stack(NN.SyncBatchNorm2d, depth), SHAPE[0]) for depth in (1, DEEP)}
            t = interleaved(timers, min_run_time, rounds)
            checks.check_pending()
            result[mode] = layer_samples(t)
        checks.DEFER_ON_HOST = False
    finally:
        for patch in patches:
            patch.stop()
    t = interleaved({depth: step_of(stack(nn.BatchNorm2d, depth), SHAPE[0]) for depth in (1, DEEP)}, min_run_time, rounds)
    result["torch"] = layer_samples(t)
    return result


def lone_replica_row(min_run_time: float, rounds: int) -> Samples:
    """Seconds, round by round, of forward + backward of nn.BatchNorm2d and of our SyncBatchNorm2d
    as a lone replica (no wrapper, no process group: nothing to meet), taken in turn."""
    channels = FIXED_COST_SHAPE[1]
    steps = fixed_cost_steps(torch=nn.BatchNorm2d(channels), ours=NN.SyncBatchNorm2d(channels))
    return interleaved({name: benchmark.Timer("fn()", globals={"fn": fn}) for name, fn in steps.items()}, min_run_time, rounds)


def cost_text(c: Cost, unit: str = "") -> str:
    """A cost in us as the table and the summary write it: within its noise said so, and never a
    figure below zero (what a cost can be said to be from this many repeats)."""
    value, noise = c[0] * 1e6, c[1] * 1e6
    digits = 1 if max(abs(value), noise) < 100 else 0  # a fixed cost of 10 us needs its tenth
    if abs(value) <= noise:
        return f"within noise (±{noise:.{digits}f} us)"
    text = f"{abs(value):.{digits}f} ± {noise:.{digits}f}"
    return f"none ({text} us less)" if value < 0 else text + unit


def row(path: str, ours: list[float] | None, theirs: list[float] | None, stolen: float | None,
        costs: dict[str, Cost] | None = None, **keys: object) -> dict:
    """A table row: the medians of ``ours`` and ``theirs`` in us, and each of ``costs`` (adds,
    meeting, own) as text, its figures kept beside it for plots; ``keys`` and the two medians'
    ratio kept beside too (not shown: a ratio of figures within noise would read as a cost)."""
    out: dict = {"path": path, "stolen": stolen, **keys}
    for key, samples in (("ours_us", ours), ("torch_us", theirs)):
        out[key] = None if samples is None else round(median(samples) * 1e6, 2)
    if out["ours_us"] and out["torch_us"]:
        out["ratio"] = round(out["ours_us"] / out["torch_us"], 4)
    for key, c in (costs or {}).items():
        out[key], out[key + "_us"], out[key + "_noise_us"] = cost_text(c), round(c[0] * 1e6, 2), round(c[1] * 1e6, 2)
    print(" | ".join(results.cell(out.get(c.key), c.format) for c in COLUMNS), flush=True)
    return out


COLUMNS = [
    Column("path", "path"),
    Column("ours_us", "ours, us", "{:.0f}"),
    Column("torch_us", "torch's unsynced, us", "{:.0f}"),
    Column("adds", "synchronizing adds, us"),
    Column("meeting", "of which the meeting, us"),
    Column("own", "of which our own part, us"),
    Column("stolen", "CPU stolen", "{:.0%}"),
]


def resnet_rows(replicas: int, steps: int, blocks: int, threads: int, min_run_time: float) -> list[dict]:
    """The small ResNet's step under ``replicas`` thread replicas with ``threads`` intra-op threads:
    converted against unsynced, the meetings being what converted costs beyond meeting no one;
    with several threads, torch's step once more with every replica starting a team of all."""
    t, stolen = least_stolen(lambda: resnet_row(replicas, steps, threads, blocks=blocks))
    shares = f", the {replicas} replicas sharing them" if threads > 1 else ""
    rows = [row(f"small ResNet (17 batch norms), a training step, {replicas} thread replicas, {threads} intra-op "
                f"thread{'s' if threads > 1 else ''}{shares}", t["ours"], t["torch"], stolen,
                dict(adds=cost([t["ours"]], [t["torch"]]), meeting=cost([t["ours"]], [t["alone"]]), own=cost([t["alone"]], [t["torch"]])),
                kind="resnet", threads=threads, alone_us=round(median(t["alone"]) * 1e6, 2))]
    if threads > 1:
        unshared = resnet_without_thread_shares(replicas, min_run_time * 4, threads)
        rows.append(row(f"the same, unsynced, every replica starting a team of all {threads} threads", None, [unshared],
                        None, kind="unshared", threads=threads))
    return rows


def process_rows(world: int, number: int, repeats: int) -> list[dict]:
    """DDP over ``world`` Gloo ranks, checks at the layer and deferred."""
    per_rank, stolen = least_stolen(lambda: run_local_group(ranks_row, world, number, repeats, timeout_s=600))
    t = slowest(per_rank)
    alone = round(median(t["collectives"]) * 1e6, 2)
    return [
        row(f"DDP, {world} Gloo ranks, {what}", t[mode], t["torch"], stolen,
            dict(adds=cost([t[mode]], [t["torch"]]), meeting=cost([t["placed"]], [t["torch"]]), own=cost([t[mode]], [t["placed"]])),
            kind="ranks", world=world, checks=mode, collectives_alone_us=alone)
        for mode, what in (("layer", "checks at the layer"), ("step", "checks deferred"))
    ]


def measure(args: argparse.Namespace, default_threads: int) -> list[dict]:
    """Every row, in the table's order (the ResNet's measured first: see the docstring)."""
    replica_counts = (2, 4) if args.quick else (2, 4, 8)
    rounds = args.rounds
    resnet = [r for threads in sorted({1, default_threads}) for r in resnet_rows(4, args.steps, rounds, threads, args.min_run_time)]
    rows = []
    for label, layers in THREADS_ROWS.items():
        for replicas in replica_counts:
            (ours, theirs), stolen = least_stolen(lambda: threads_row(replicas, args.min_run_time, rounds, layers))
            rows.append(row(f"ThreadedDataParallel, {replicas} CPU replicas{label}", ours, theirs, stolen,
                            dict(adds=cost([ours], [theirs])), kind="threads" if not label else "threads-inplace",
                            replicas=replicas))
    for world in (2,) if args.quick else (2, 4):
        rows += process_rows(world, 20 if args.quick else 40, 2 * rounds - 1)
    free, stolen = least_stolen(lambda: free_collectives_row(args.min_run_time, rounds))
    for mode, what in (("layer", "checks at the layer"), ("step", "checks deferred")):
        own = cost([free[mode]], [free["torch"]])
        rows.append(row(f"one process as a rank of 2 whose collectives cost nothing, {what}", free[mode], free["torch"],
                        stolen, dict(adds=own, own=own), kind="free", checks=mode))
    lone, stolen = least_stolen(lambda: lone_replica_row(args.min_run_time, rounds))
    rows.append(row(f"a lone replica (no wrapper, no process group: our fixed cost), {FIXED_COST_SHAPE}", lone["ours"],
                    lone["torch"], stolen, dict(own=cost([lone["ours"]], [lone["torch"]])), kind="lone"))
    return rows + resnet


def summary(rows: list[dict]) -> str:
    """What the table says, in three sentences from its figures."""
    def find(**keys: object) -> dict:
        return next(r for r in rows if all(r.get(k) == v for k, v in keys.items()))

    def text(r: dict, key: str) -> str:
        return r[key] if r[key].endswith(")") else r[key] + " us"  # "within noise (...)" has its unit

    counts = sorted({r["replicas"] for r in rows if r["kind"] == "threads"})
    threads = " / ".join(text(find(kind="threads", replicas=n), "adds") for n in counts)
    inplace = " / ".join(text(find(kind="threads-inplace", replicas=n), "adds") for n in counts)
    ddp, free, resnet = find(kind="ranks", checks="layer"), find(kind="free", checks="layer"), find(kind="resnet", threads=1)
    if resnet["adds_us"] > resnet["adds_noise_us"]:
        step = (f"takes {resnet['ratio']:.3f}x the unsynced step, {text(resnet, 'adds')} more, of which the meetings "
                f"{text(resnet, 'meeting')} and our layers without them {text(resnet, 'own')}")
    else:
        step = f"takes the unsynced step's time, the difference {text(resnet, 'adds')}"
    return (
        f"Per layer under ThreadedDataParallel with {' / '.join(map(str, counts))} replicas, synchronizing adds "
        f"{threads} (InPlaceABN: {inplace}). Across {ddp['world']} Gloo processes a layer "
        f"adds {text(ddp, 'adds')}, of which the two collectives where ours makes them take {text(ddp, 'meeting')}, our "
        f"own part beyond them {text(ddp, 'own')} ({text(free, 'own')} where the collectives cost nothing), and a lone "
        f"replica's fixed cost is {text(find(kind='lone'), 'own')}. A small ResNet's training step under 4 thread "
        f"replicas {step}."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="2 and 4 replicas, 2 ranks, 3 rounds, 150 ResNet steps, 0.3 s a measurement (default: off)")
    parser.add_argument("--rounds", type=int, help="rounds of each row (the Gloo rows: twice as many, less one); "
                        "default 5, 3 with --quick")
    parser.add_argument("--steps", type=int, help="ResNet steps of each contender; default 400, 150 with --quick")
    parser.add_argument("--min-run-time", type=float, help="seconds a measurement; default 0.5, 0.3 with --quick")
    results.add_output_options(parser)
    args = parser.parse_args()
    for key, full, quick in (("rounds", 5, 3), ("steps", 400, 150), ("min_run_time", 0.5, 0.3)):
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    default_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = measure(args, default_threads)
    result = dict(
        title="What synchronizing costs per layer",
        method=f"Per layer = (16 stacked layers - 1 layer) / 15, forward + backward of a {SHAPE} float32 input on one "
               f"intra-op thread, the contenders taken in turn over {args.rounds} rounds (the ResNet's alternating step by "
               f"step), a cost being the difference of medians ± half its range over the rounds.",
        columns=COLUMNS, rows=rows, summary=summary(rows), shape=list(SHAPE), rounds=args.rounds, steps=args.steps,
    )
    results.output(args, "sync_overhead", **result)


if __name__ == "__main__":
    main()
