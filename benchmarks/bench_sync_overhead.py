"""What synchronizing costs per layer, where kernels cost nothing: the host's price of a meeting.

Per layer = (step with 16 stacked layers - step with 1 layer) / 15, a step being forward +
backward (the input requires grad, as inside a network) of a tiny (8, 8, 4, 4) float32 input:

- threads: ``ThreadedDataParallel(["cpu"] * R)`` over our ``SyncBatchNorm2d`` against
  ``nn.BatchNorm2d`` (unsynced) in the same wrapper, R = 2, 4, 8; ``torch.utils.benchmark``
  ``blocked_autorange``, the contenders taken in turn over rounds, medians; our replicas meet
  natively (one call per layer and direction, the default) and through the autograd Function in
  Python (the in-place activated layers' path), whose replicas exchange Python objects at the same
  native meeting;
- a small ResNet (stem + 8 basic blocks: 17 batch norms, residual adds; batch 16x3x16x16), one
  training step (forward, loss, backward) under 4 thread replicas, converted against unsynced,
  and the converted net whose layers meet no one (each replica normalizing its own chunk through
  the same native call: what our layer costs in the step without the meeting), with one intra-op
  thread and with the process's default (the replicas share those; and torch's
  step once more with every replica starting a team of all of them, as before the share); the
  contenders alternate step by step, medians of single steps (blocks of steps taken in turn
  let a slow spell of the VM fall on one contender: 0.95x and 1.10x in two runs of one day);
  measured first, while ThreadedDataParallel's pool of worker threads holds only theirs (after
  the rows of up to 8 replicas the runners rotate through a dozen pooled threads, which measured
  1.03x where a fresh process measured 1.10x);
- processes: R Gloo ranks on loopback (one intra-op thread each) under DDP, ours against
  ``nn.BatchNorm2d``, and the two collectives of a layer alone (an all_gather of a 14 + 2C row,
  an all_reduce of 2C + 4 values, float64) in the same processes, and in place: torch's layer
  making the same two collectives where ours makes them (forward, backward), which bears the
  ranks' skew between collectives as ours does; every rank runs the same fixed
  number of steps (collectives need all ranks), all contenders taken in turn over rounds (the
  collectives' own time drifts between runs on a VM), the slowest rank's median counts; with the
  checks read at each layer (CPU tensors' default) and deferred (CUDA's default, here
  ``checks.DEFER_ON_HOST``);
- our own part across processes without the collectives: this process posing as a rank of a
  world of 2 whose collectives cost nothing;
- the bare exchange: R threads meeting in ``ReplicaRound.exchange`` with a trivial combine;
- a lone replica's fixed cost: our ``SyncBatchNorm2d`` with no wrapper and no process group
  against ``nn.BatchNorm2d``, forward + backward (input, weight and bias gradients) of a
  (2, 64, 4, 4) float32 input, as ``bench_toolchain.py`` times ``BatchNorm2d``'s.

Each row says what share of the VM's CPU time the hypervisor gave to other guests while it ran
(steal time, ``bench_cpu.StolenShare``), and is measured once more where that exceeded 5%, the
less stolen of the two kept (``bench_cpu.least_stolen``): rows measured through a burst of steal
swung by more than the goals between runs of the same code.

    python benchmarks/bench_sync_overhead.py [--quick] [--no-write]
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import threading
import time
from unittest import mock
from statistics import median
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils import benchmark

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from bench_cpu import cpu_model, interleaved_medians, keyed_markers, least_stolen, publish, stolen_text  # noqa: E402
from bench_toolchain import FIXED_COST_SHAPE, fixed_cost_steps  # noqa: E402
from syncbn.functions.operators import backend  # noqa: E402
from syncbn.functions.synchronization import checks, distributed
from syncbn.functions.synchronization.replicas import ReplicaRound  # noqa: E402
from helpers import BasicBlock  # noqa: E402
import syncbn.modules.batchnorm  # noqa: E402
import syncbn.functions.synchronization.replica_threads  # noqa: E402
from syncbn import nn as NN  # noqa: E402
from syncbn.modules.parallel import ThreadedDataParallel  # noqa: E402
from testkit.local_group import run_local_group  # noqa: E402

SHAPE = (8, 8, 4, 4)
DEEP = 16


def stack(layer: type, depth: int) -> nn.Module:
    return nn.Sequential(*[layer(SHAPE[1]) for _ in range(depth)])


def step_of(runner: nn.Module, rows: int) -> benchmark.Timer:
    x = torch.randn(rows, *SHAPE[1:], requires_grad=True)
    return benchmark.Timer("runner(x).sum().backward()", globals=dict(runner=runner, x=x))


def per_layer(deep: float, shallow: float) -> float:
    return (deep - shallow) / (DEEP - 1)


def interleaved(timers: dict, min_run_time: float, rounds: int) -> dict:
    """Median seconds of each timer, the timers taken in turn over ``rounds``."""
    samples: dict = {key: [] for key in timers}
    for timer in timers.values():
        timer.timeit(3)  # workers started, caches warm
    for _ in range(rounds):
        for key, timer in timers.items():
            samples[key].append(timer.blocked_autorange(min_run_time=min_run_time).median)
    return {key: median(values) for key, values in samples.items()}


def threads_row(replicas: int, min_run_time: float, rounds: int, native: bool) -> tuple[float, float]:
    """Per-layer seconds of ours and of torch's unsynced layer under R thread replicas; ours
    in one native call each, or through the autograd Function in Python."""
    timers = {
        (kind, depth): step_of(ThreadedDataParallel(stack(layer, depth), ["cpu"] * replicas), SHAPE[0])
        for kind, layer in (("ours", NN.SyncBatchNorm2d), ("torch", nn.BatchNorm2d))
        for depth in (1, DEEP)
    }
    with mock.patch.object(syncbn.modules.batchnorm, "native_serves", syncbn.modules.batchnorm.native_serves if native else lambda: False):
        t = interleaved(timers, min_run_time, rounds)
    return per_layer(t["ours", DEEP], t["ours", 1]), per_layer(t["torch", DEEP], t["torch", 1])


def small_resnet(channels: int = 16, blocks: int = 8) -> nn.Module:
    """A stem conv + BN + ReLU, ``blocks`` basic blocks (residual adds), pooled linear head:
    1 + 2 * blocks batch norms."""
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(),
        *[BasicBlock(channels) for _ in range(blocks)],
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10),
    )


def alternating(timers: dict, steps: int) -> dict:
    """Median seconds of one run of each timer, the timers run in turn one run at a time, so that
    every contender meets the same moments of a noisy machine."""
    samples: dict = {key: [] for key in timers}
    for timer in timers.values():
        timer.timeit(3)  # workers started, caches warm
    for _ in range(steps):
        for key, timer in timers.items():
            samples[key].append(timer.timeit(1).median)
    return {key: median(values) for key, values in samples.items()}


def resnet_step(model: nn.Module, replicas: int, threads: int) -> benchmark.Timer:
    """One training step of ``model`` under R thread replicas, the caller having ``threads``
    intra-op threads."""
    x = torch.randn(16, 3, 16, 16)
    runner = ThreadedDataParallel(model, ["cpu"] * replicas)
    return benchmark.Timer("runner(x).square().mean().backward()", globals=dict(runner=runner, x=x), num_threads=threads)


class MeetingNoOne(NN.SyncBatchNorm2d):
    """Our layer whose replicas meet no one: each normalizes its own chunk through the same
    native call as a synchronized replica (no round, no process group). What our layer costs in a
    step without the meeting, so that the ResNet row can tell the two apart."""

    def _meeting(self) -> tuple[None, None]:
        return None, None


def with_layers_of(model: nn.Module, kind: type) -> nn.Module:
    """``model`` with each of its synchronized layers made a ``kind`` (a subclass)."""
    for layer in model.modules():
        if isinstance(layer, NN.SyncBatchNorm2d):
            layer.__class__ = kind
    return model


def meeting_no_one(model: nn.Module) -> nn.Module:
    return with_layers_of(model, MeetingNoOne)


def resnet_row(replicas: int, steps: int, threads: int = 1, variants: dict[str, type] | None = None) -> dict[str, float]:
    """Seconds of one training step of the small ResNet under R thread replicas (medians of
    ``steps`` alternating steps): converted (ours, meeting natively), converted with layers that
    meet no one (:class:`MeetingNoOne`), unsynced, and the converted net with its layers made of
    each of ``variants``' classes."""
    torch.manual_seed(0)
    timers = {
        "ours": resnet_step(NN.convert_sync_batchnorm(small_resnet()), replicas, threads),
        "alone": resnet_step(meeting_no_one(NN.convert_sync_batchnorm(small_resnet())), replicas, threads),
        "torch": resnet_step(small_resnet(), replicas, threads),
    }
    for key, kind in (variants or {}).items():
        timers[key] = resnet_step(with_layers_of(NN.convert_sync_batchnorm(small_resnet()), kind), replicas, threads)
    return alternating(timers, steps)


def resnet_without_thread_shares(replicas: int, min_run_time: float, threads: int) -> float:
    """Seconds of the unsynced small ResNet's step where every CPU replica starts a team of all
    the caller's ``threads`` (as before ThreadedDataParallel shared them out)."""
    torch.manual_seed(0)
    timer = resnet_step(small_resnet(), replicas, threads)
    every_thread = functools.partial(backend.set_thread_intra_op_threads, threads)  # workers keep their setting: set it
    with mock.patch.object(syncbn.functions.synchronization.replica_threads, "set_thread_intra_op_threads", lambda share: every_thread()):
        timer.timeit(3)
        return timer.blocked_autorange(min_run_time=min_run_time).median


def bare_exchange(replicas: int, exchanges: int = 2000) -> float:
    """Seconds per exchange of R threads in one round, combine summing ints."""
    round = ReplicaRound("bench", 1, 60.0)
    for _ in range(replicas):
        round.add(nn.Identity())
    barrier = threading.Barrier(replicas + 1)

    def replica(index: int) -> None:
        barrier.wait()
        for k in range(exchanges):
            round.exchange(("forward", k), index, index, sum)
        barrier.wait()

    threads = [threading.Thread(target=replica, args=(j,)) for j in range(replicas)]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    barrier.wait()
    elapsed = time.perf_counter() - start
    for thread in threads:
        thread.join()
    return elapsed / exchanges


def time_fixed(fn, number: int, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - start) / number)
    return median(samples)


def ddp_model(layer: type, depth: int) -> nn.Module:
    return DistributedDataParallel(stack(layer, depth), forward_sync_buffers=False)


def layer_rows(channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero rows of the sizes that a layer of ``channels`` sends: the forward's statistics row
    (header, mean, M2) and the backward's sums row (identities, sum_dy, sum_dy_xmu), float64."""
    return (
        torch.zeros(distributed.HEADER_SIZE + 2 * channels, dtype=torch.float64),
        torch.zeros(distributed.IDENTITY_SIZE + 2 * channels, dtype=torch.float64),
    )


def collectives_alone() -> Callable[[], None]:
    """One layer's two collectives: the all_gather of its statistics row and the all_reduce of
    its backward sums."""
    row, sums = layer_rows(SHAPE[1])

    def both() -> None:
        distributed._all_gather_rows(row, None)  # as our layer gathers (all_gather_single where torch has it)
        dist.all_reduce(sums)

    return both


class _CollectivesInPlace(torch.autograd.Function):
    """The identity, making a layer's two collectives where ours makes them: the all_gather of a
    statistics row in the forward, the all_reduce of the sums row in the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        row, ctx.sums = layer_rows(x.shape[1])
        distributed._all_gather_rows(row, None)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        dist.all_reduce(ctx.sums)
        return grad


class BatchNormWithCollectives(nn.BatchNorm2d):
    """torch's unsynced layer making our layer's two collectives at the same points of the step:
    the collectives as they cost in place, with the ranks' skew between them, without our work."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(_CollectivesInPlace.apply(x))


def ranks_row(rank: int, world: int, number: int, repeats: int) -> dict:
    """Per-layer seconds on this rank: ours with the checks at the layer and deferred, torch's,
    torch's with the two collectives in place (:class:`BatchNormWithCollectives`), and the two
    collectives alone, taken in turn over ``repeats`` rounds (every rank runs the same sequence:
    collectives need all ranks), medians."""
    x = torch.randn(SHAPE, requires_grad=True)
    ours = {depth: ddp_model(NN.SyncBatchNorm2d, depth) for depth in (1, DEEP)}
    theirs = {depth: ddp_model(nn.BatchNorm2d, depth) for depth in (1, DEEP)}
    placed = {depth: ddp_model(BatchNormWithCollectives, depth) for depth in (1, DEEP)}
    both = collectives_alone()
    samples: dict = {key: [] for key in ("layer", "step", "torch", "placed", "collectives")}
    for _ in range(repeats):
        for mode in ("layer", "step"):
            checks.DEFER_ON_HOST = mode == "step"
            t = [time_fixed(lambda m=ours[depth]: m(x).sum().backward(), number, 1) for depth in (1, DEEP)]
            checks.check_pending()
            samples[mode].append(per_layer(t[1], t[0]))
        checks.DEFER_ON_HOST = False
        for key, models in (("torch", theirs), ("placed", placed)):
            t = [time_fixed(lambda m=models[depth]: m(x).sum().backward(), number, 1) for depth in (1, DEEP)]
            samples[key].append(per_layer(t[1], t[0]))
        samples["collectives"].append(time_fixed(both, number * DEEP // 4, 1))
    return {key: median(values) for key, values in samples.items()}


def free_collectives_row(min_run_time: float, rounds: int) -> dict[str, float]:
    """Per-layer seconds of ours (checks at the layer, and deferred) and of torch's layer in this
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
            result[mode] = per_layer(t[DEEP], t[1])
        checks.DEFER_ON_HOST = False
    finally:
        for patch in patches:
            patch.stop()
    t = interleaved({depth: step_of(stack(nn.BatchNorm2d, depth), SHAPE[0]) for depth in (1, DEEP)}, min_run_time, rounds)
    result["torch"] = per_layer(t[DEEP], t[1])
    return result


def lone_replica_row(min_run_time: float, rounds: int) -> dict[str, float]:
    """Seconds of forward + backward of nn.BatchNorm2d and of our SyncBatchNorm2d as a lone
    replica (no wrapper, no process group: nothing to meet), taken in turn."""
    channels = FIXED_COST_SHAPE[1]
    steps = fixed_cost_steps(torch=nn.BatchNorm2d(channels), ours=NN.SyncBatchNorm2d(channels))
    return {name: ms * 1e-3 for name, ms in interleaved_medians(steps, min_run_time * rounds, rounds).items()}


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 and 4 replicas, 2 ranks, shorter measurements")
    parser.add_argument("--no-write", action="store_true", help="print, do not touch RESULTS.md")
    args = parser.parse_args()
    default_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    replica_counts = (2, 4) if args.quick else (2, 4, 8)
    worlds = (2,) if args.quick else (2, 4)
    min_run_time, rounds = (0.3, 3) if args.quick else (0.5, 5)
    capability = torch.backends.cpu.get_cpu_capability()
    begin, end = keyed_markers("bench_sync_overhead", capability.lower())  # AVX2 and AVX-512 machines differ
    lines = [
        begin,
        "## What synchronizing costs per layer (bench_sync_overhead.py)",
        "",
        f"Machine: {os.cpu_count()}-core {cpu_model()} ({capability}) VM, no GPU; torch "
        f"{torch.__version__}; {time.strftime('%Y-%m-%d')}. Per layer = (16 layers - 1 layer) / 15, forward + "
        f"backward of a {SHAPE} float32 input (requires grad), microseconds; one intra-op thread. CPU stolen: the "
        f"share of the VM's CPU time that the hypervisor gave to other guests while the row ran (/proc/stat); a row is "
        f"measured once more where it exceeded 5%, and the less stolen of the two kept.",
        "",
        "| path | our layer | torch's unsynced layer, same wrapper | synchronizing adds | CPU stolen |",
        "|---|---|---|---|---|",
    ]
    # first, while the pool of ThreadedDataParallel's workers holds only the threads these two
    # runners use: after the rows below (up to 8 replicas) the runners take turns at a dozen
    # pooled threads, which measured 1.03x where a fresh process measured 1.10x
    resnet_lines: list[str] = []
    steps = 150 if args.quick else 400
    t, stolen = least_stolen(lambda: resnet_row(4, steps))
    resnet_lines += [
        "",
        f"A small ResNet (17 batch norms, residual adds; batch 16x3x16x16), one training step under 4 thread "
        f"replicas, medians of {steps} steps each, the three alternating step by step: converted "
        f"{t['ours'] * 1e3:.1f} ms, {t['ours'] / t['torch']:.3f}x; converted with layers that meet no one (each "
        f"replica normalizing its own chunk through the same native call) {t['alone'] * 1e3:.1f} ms, "
        f"{t['alone'] / t['torch']:.3f}x; unsynced {t['torch'] * 1e3:.1f} ms; CPU stolen {stolen_text(stolen)}.",
    ]
    print(resnet_lines[-1], flush=True)
    if default_threads > 1:
        t, stolen = least_stolen(lambda: resnet_row(4, steps, default_threads))
        unshared = resnet_without_thread_shares(4, min_run_time * 4, default_threads)
        resnet_lines += [
            "",
            f"The same with the process's default {default_threads} intra-op threads (the 4 CPU replicas share them, "
            f"{max(1, default_threads // 4)} each): converted {t['ours'] * 1e3:.1f} ms, {t['ours'] / t['torch']:.3f}x; "
            f"meeting no one {t['alone'] * 1e3:.1f} ms, {t['alone'] / t['torch']:.3f}x; unsynced "
            f"{t['torch'] * 1e3:.1f} ms; unsynced with every replica starting a team of all {default_threads} threads "
            f"(before the share): {unshared * 1e3:.1f} ms; CPU stolen {stolen_text(stolen)} (the alternating steps).",
        ]
        print(resnet_lines[-1], flush=True)
    for replicas in replica_counts:
        for native, how in ((True, "native call"), (False, "autograd Function")):
            (ours, theirs), stolen = least_stolen(lambda: threads_row(replicas, min_run_time, rounds, native))
            lines.append(
                f"| ThreadedDataParallel, {replicas} CPU replicas, {how} | {us(ours)} | {us(theirs)} | {us(ours - theirs)} "
                f"| {stolen_text(stolen)} |"
            )
            print(lines[-1], flush=True)
    for world in worlds:
        results, stolen = least_stolen(
            lambda: run_local_group(ranks_row, world, 20 if args.quick else 40, 5 if args.quick else 9, timeout_s=600)
        )
        slowest = {key: max(r[key] for r in results) for key in results[0]}
        for mode, what in (("layer", "checks at the layer"), ("step", "checks deferred")):
            own = slowest[mode] - slowest["torch"] - slowest["collectives"]
            in_place = slowest["placed"] - slowest["torch"]
            lines.append(
                f"| DDP, {world} Gloo ranks, {what} | {us(slowest[mode])} | {us(slowest['torch'])} | "
                f"{us(slowest[mode] - slowest['torch'])}, of which the two collectives alone {us(slowest['collectives'])}: "
                f"our own part {us(own)}; the collectives in place (torch's layer making them) {us(in_place)}: "
                f"our own part beyond them {us(slowest[mode] - slowest['placed'])} | {stolen_text(stolen)} |"
            )
            print(lines[-1], flush=True)
    free, stolen = least_stolen(lambda: free_collectives_row(min_run_time, rounds))
    for mode, what in (("layer", "checks at the layer"), ("step", "checks deferred")):
        lines.append(
            f"| one process as a rank of 2 whose collectives cost nothing, {what} | {us(free[mode])} | {us(free['torch'])} | "
            f"{us(free[mode] - free['torch'])}: our own part | {stolen_text(stolen)} |"
        )
        print(lines[-1], flush=True)
    lone, stolen = least_stolen(lambda: lone_replica_row(min_run_time, rounds))
    lines.append(
        f"| a lone replica (no wrapper, no process group), forward + backward of {FIXED_COST_SHAPE} | {us(lone['ours'])} | "
        f"{us(lone['torch'])} (`nn.BatchNorm2d` alone) | {lone['ours'] * 1e6 - lone['torch'] * 1e6:+.1f}: our fixed cost "
        f"| {stolen_text(stolen)} |"
    )
    print(lines[-1], flush=True)
    lines += resnet_lines
    lines += ["", "The bare exchange of Python objects (`ReplicaRound.exchange`, R threads, a combine that sums ints), per exchange:", ""]
    exchanges, stolen = least_stolen(lambda: {r: bare_exchange(r) for r in replica_counts})
    lines.append(" ".join(f"{r} threads: {us(t)} us;" for r, t in exchanges.items()).rstrip(";") + f" (CPU stolen {stolen_text(stolen)})")
    lines.append(end)
    section = "\n".join(lines)
    publish(section, not args.no_write, begin, end)


if __name__ == "__main__":
    main()
