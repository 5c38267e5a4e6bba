"""Shared test helpers: models, replicas made as torch makes them, the lockstep trainer of the
ThreadedDataParallel tests (on testkit.lockstep), and what the replica tests (tests/test_replicas_*.py)
share: a module that fails in one replica, and the layers' buffers compared."""
from __future__ import annotations

import copy
import sys
import threading
import unittest.mock
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from syncbn.functions.synchronization.replica_threads import no_automatic_collection
from syncbn.functions.synchronization.synchronizer import Synchronizer
from syncbn import nn as NN
from syncbn.modules.parallel import ThreadedDataParallel
from testkit.lockstep import assert_agree, randomize_affine, state_quantities, train_side_by_side


def assert_same_state(ref: nn.Module, ours: nn.Module, atol: float | None = None, rtol: float | None = None) -> None:
    """Parameter grads and buffers (running stats, num_batches_tracked) of the two models agree
    (tolerances None: torch.testing.assert_close's defaults for the dtype)."""
    assert_agree(iter([list(state_quantities(0, ref, ours, 1))]), atol, rtol)


class BasicBlock(nn.Module):
    """A ResNet basic block: conv-BN-ReLU-conv-BN, residual add, ReLU."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: Tensor) -> Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + x)


class SmallResNet(nn.Module):
    """A ResNet-style net of torch's batch norms: conv stem with BN, two basic blocks with
    residual adds, global average pool, linear head with a BN1d (its momentum as given)."""

    def __init__(self, channels: int = 8, classes: int = 4, head_momentum: float | None = None) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.blocks = nn.Sequential(BasicBlock(channels), BasicBlock(channels))
        self.head = nn.Linear(channels, classes)
        self.bn_head = nn.BatchNorm1d(classes, momentum=head_momentum)

    def forward(self, x: Tensor) -> Tensor:
        x = self.blocks(torch.relu(self.bn(self.stem(x))))
        return self.bn_head(self.head(x.mean((2, 3))))


def train_in_lockstep(
    make_ref: Callable[[], nn.Module],
    shape: Sequence[int],
    replicas: int,
    steps: int = 3,
    dtype: torch.dtype = torch.float64,
    memory_format: torch.memory_format = torch.contiguous_format,
    atol: float = 1e-9,
    rtol: float = 1e-9,
    training: bool = True,
    seed: int = 0,
) -> None:
    """Train ``make_ref()`` on the full batch and its converted twin under ThreadedDataParallel
    with ``replicas`` CPU replicas (or alone when 1), with SGD, and compare outputs, input
    gradients, parameter gradients and buffers after every step."""
    torch.manual_seed(seed)
    ref = randomize_affine(make_ref(), seed).to(dtype=dtype, memory_format=memory_format)
    ours = NN.convert_sync_batchnorm(copy.deepcopy(ref))
    ref.train(training)
    ours.train(training)
    runner = ThreadedDataParallel(ours, ["cpu"] * replicas) if replicas > 1 else ours

    def batch(step: int) -> list[Tensor]:
        return [(torch.randn(*shape, dtype=dtype) * 3 + 1).to(memory_format=memory_format)]

    assert_agree(train_side_by_side(ref, ours, batch, steps, runner=runner), atol, rtol)


def run_threads(jobs: Sequence[Callable[[], object]]) -> list[object]:
    """Run jobs in threads as nn.DataParallel's parallel_apply does; returns results or errors."""
    results: list[object] = [None] * len(jobs)

    def work(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except BaseException as error:  # noqa: BLE001 - the test inspects it
            results[i] = error

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    with no_automatic_collection():  # as ThreadedDataParallel's: torch's get_rng_state deadlocks otherwise
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a replica thread hung"
    return results


def _cpu_broadcast(tensors: list[Tensor], devices: Sequence[int], detach: bool = False) -> list[list[Tensor]]:
    """What torch's broadcast gives replicate(), on one CPU: device 0 holds the originals
    (parameters as differentiable aliases), the others copies of the buffers."""
    if detach:
        return [[t if j == 0 else t.detach().clone() for t in tensors] for j in range(len(devices))]
    return [[t.view_as(t) for t in tensors] for _ in devices]


def stock_replicas(module: nn.Module, count: int) -> list[nn.Module]:
    """Replicas made by torch's own replicate() (as stock nn.DataParallel makes them), with its
    GPU broadcast swapped for CPU aliases and copies so that it runs here."""
    replicate_module = sys.modules["torch.nn.parallel.replicate"]
    with unittest.mock.patch.object(replicate_module, "_broadcast_coalesced_reshape", _cpu_broadcast):
        return torch.nn.parallel.replicate(module, [0] * count)


def replayed_replicas(module: nn.Module, count: int) -> list[nn.Module]:
    """Replicas made by replaying replicate()'s calls of ``_replicate_for_data_parallel()`` (one
    per replica, in device order, for every module) from code that is not torch's replicate():
    the signal a third-party replicate gives."""
    modules = list(module.modules())
    index = {m: i for i, m in enumerate(modules)}
    copies = [[m._replicate_for_data_parallel() for _ in range(count)] for m in modules]
    for i, original in enumerate(modules):
        for j, replica in enumerate(copies[i]):
            for key, child in original._modules.items():
                replica._modules[key] = copies[index[child]][j]
            for key, param in original._parameters.items():
                setattr(replica, key, param.view_as(param))  # a non-leaf alias, as Broadcast gives
            for key, buf in original._buffers.items():
                replica._buffers[key] = buf if (j == 0 or buf is None) else buf.clone()
    return [copies[0][j] for j in range(count)]


def split_batch(x: Tensor, count: int) -> list[Tensor]:
    return list(x.chunk(count))


def another_thread_runs_during(call: Callable[[], object]) -> bool:
    """Whether another Python thread runs while ``call()`` runs on this thread, judged without
    timing, so that no load on the machine changes the answer: with a switch interval far longer
    than the test, a thread that holds the GIL is never asked to hand it over, so a thread woken
    just before ``call()`` runs before it returns only where ``call`` releases the GIL (``call``
    must last long enough for the woken thread to be scheduled: a few milliseconds)."""
    state: dict[str, bool | None] = {"running": False, "seen": None}
    woken = threading.Event()

    def watch() -> None:
        woken.wait()  # waits without the GIL
        state["seen"] = state["running"]

    watcher = threading.Thread(target=watch)
    watcher.start()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        state["running"] = True
        woken.set()
        call()
        state["running"] = False
    finally:
        sys.setswitchinterval(interval)
        watcher.join()
    return bool(state["seen"])


def count_exchanges(monkeypatch) -> list[tuple[str, int]]:
    """The (direction, call) of every replica meeting from now on: each native call's forward
    (a call with statistics given meets no one) and its backward node's runs (seen through a
    pre-hook on the node)."""
    calls: list[tuple[str, int]] = []
    run = Synchronizer._run

    def counting(self, *args, **tail):
        number = self.replica_call.number
        if self.given is None:
            calls.append(("forward", number))
        y = run(self, *args, **tail)
        if y.grad_fn is not None:
            y.grad_fn.register_prehook(lambda grads: calls.append(("backward", number)))
        return y

    monkeypatch.setattr(Synchronizer, "_run", counting)
    return calls


class RaiseOn(nn.Module):
    """Raises (or skips the next layer) in the replica whose chunk has ``batch`` samples."""

    def __init__(self, batch: int, error: type[BaseException] = KeyError) -> None:
        super().__init__()
        self.batch, self.error, self.armed = batch, error, True

    def forward(self, x):
        if self.armed and x.size(0) == self.batch:
            raise self.error(f"replica with batch {self.batch} fails")
        return x


def buffers_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}


def assert_buffers_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-12, rtol=1e-12, msg=key)
