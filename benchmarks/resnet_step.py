"""The small ResNet's training step under thread replicas (``bench_sync_overhead.py``,
``bench_barrier_floor.py``; ``bench_compile_ranks.py`` takes the network): converted to ours,
with layers that meet no one, and unsynced, the contenders taken in turn step by step."""
from __future__ import annotations

import functools
from statistics import median
from unittest import mock

import torch
from torch import nn
from torch.utils import benchmark

import syncbn.functions.synchronization.replica_threads
from helpers import BasicBlock
from syncbn import nn as NN
from syncbn.functions.operators import backend
from syncbn.modules.parallel import ThreadedDataParallel

Samples = dict  # a figure's key -> its seconds in each block of steps


def small_resnet(channels: int = 16, blocks: int = 8) -> nn.Module:
    """A stem conv + BN + ReLU, ``blocks`` basic blocks (residual adds), pooled linear head:
    1 + 2 * blocks batch norms."""
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(),
        *[BasicBlock(channels) for _ in range(blocks)],
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10),
    )


def alternating(timers: dict, steps: int, blocks: int = 1) -> Samples:
    """Each timer's median seconds of one run in each of ``blocks`` blocks of ``steps`` runs in
    all, the timers run in turn one run at a time, so that every contender meets the same moments
    of a noisy machine."""
    samples: dict = {key: [] for key in timers}
    for timer in timers.values():
        timer.timeit(3)  # workers started, caches warm
    for _ in range(steps):
        for key, timer in timers.items():
            samples[key].append(timer.timeit(1).median)
    size = max(1, steps // blocks)
    return {key: [median(v[b * size:(b + 1) * size]) for b in range(min(blocks, steps))] for key, v in samples.items()}


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


def resnet_row(replicas: int, steps: int, threads: int = 1, variants: dict[str, type] | None = None,
               blocks: int = 1) -> Samples:
    """Seconds of one training step of the small ResNet under R thread replicas (medians of
    ``steps`` alternating steps in each of ``blocks`` blocks): converted (ours, meeting natively),
    converted with layers that meet no one (:class:`MeetingNoOne`), unsynced, and the converted
    net with its layers made of each of ``variants``' classes."""
    torch.manual_seed(0)
    timers = {
        "ours": resnet_step(NN.convert_sync_batchnorm(small_resnet()), replicas, threads),
        "alone": resnet_step(with_layers_of(NN.convert_sync_batchnorm(small_resnet()), MeetingNoOne), replicas, threads),
        "torch": resnet_step(small_resnet(), replicas, threads),
    }
    for key, kind in (variants or {}).items():
        timers[key] = resnet_step(with_layers_of(NN.convert_sync_batchnorm(small_resnet()), kind), replicas, threads)
    return alternating(timers, steps, blocks)


def resnet_without_thread_shares(replicas: int, min_run_time: float, threads: int) -> float:
    """Seconds of the unsynced small ResNet's step where every CPU replica starts a team of all
    the caller's ``threads`` (as before ThreadedDataParallel shared them out)."""
    torch.manual_seed(0)
    timer = resnet_step(small_resnet(), replicas, threads)
    every_thread = functools.partial(backend.set_thread_intra_op_threads, threads)  # workers keep their setting: set it
    with mock.patch.object(syncbn.functions.synchronization.replica_threads, "set_thread_intra_op_threads", lambda share: every_thread()):
        timer.timeit(3)
        return timer.blocked_autorange(min_run_time=min_run_time).median
