"""The CUDA route, checked without a GPU: which kernel serves each operator on CUDA tensors (the
dispatcher's registrations), what torch's SyncBN ops give through our wrappers (torch's ops
written in plain torch for CPU tensors, ``testkit.torch_cuda_ops``), and that the synchronized
path makes none of the calls that synchronize the host on CUDA (``testkit.host_reads``: CPU
tensors stand in for CUDA ones). Across processes, the same is checked in
tests/test_distributed_deferred.py. What only a GPU confirms is in tests/test_cuda_kernels.py,
tests/test_cuda_layers.py, tests/test_cuda_graphs.py and tests/test_cuda_failures.py.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import syncbn.functions.synchronization.replica_threads as replica_threads
from syncbn.functions import devices
from syncbn.functions.operators import backend
from syncbn.functions.synchronization import checks
from syncbn.functions.operators import reference as ref
from syncbn import nn as NN
from syncbn.modules.parallel import ThreadedDataParallel
from testkit.paths import deferred_checks
from testkit import torch_cuda_ops
from testkit.host_reads import HostReads, allowed

FULL_SIZE_OPS = ("local_stats", "elemt_forward", "backward_reduce", "backward_elemt")
"""The operators that pass over the whole input: one pass each, on torch's CUDA ops by default."""

needs_default_cuda_route = pytest.mark.skipif(
    backend.backend_name(torch.device("cuda")) != "torch-cuda-ops",
    reason="the default CUDA route (torch's ops) is not registered (the reference or our CUDA kernels serve)",
)


SYNCHRONIZED_ROUTE_OPS = (
    *FULL_SIZE_OPS, "backward_affine_act", "merge_stats", "merge_gathered_stats", "update_running_stats",
    "batch_norm_train", "pack_row", "unpack_row",
)
"""Every operator that a synchronized layer (and a lone replica) calls on CUDA tensors."""


def has_cuda_kernel(name: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"syncbn::{name}", "CUDA")


def cuda_kernel_source(name: str) -> str:
    """Where the CUDA kernel of ``syncbn::<name>`` was registered, as the dispatcher says it."""
    for line in torch._C._dispatch_dump(f"syncbn::{name}").splitlines():
        if line.startswith("CUDA:"):
            return line
    return ""


@needs_default_cuda_route
def test_the_synchronized_cuda_route_has_no_python_kernel() -> None:
    # a Python kernel takes the GIL per call, in every replica thread: each operator on the route
    # has a C++ kernel of its own for the CUDA key (not the reference, CompositeExplicitAutograd)
    sources = {name: cuda_kernel_source(name) for name in SYNCHRONIZED_ROUTE_OPS}
    assert all(has_cuda_kernel(name) for name in SYNCHRONIZED_ROUTE_OPS), sources
    assert all("src/torch_cuda_ops.cpp" in line for line in sources.values()), sources


def torch_cuda_kernels():
    if backend.EXTENSION is None:
        pytest.skip("the CPU extension (which holds the default CUDA kernels) is not loaded")
    return backend.EXTENSION.torch_cuda_ops


class OperatorCalls(TorchDispatchMode):
    """The ``syncbn`` operators that reach the dispatcher's kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "syncbn":
            self.names.append(func._opname)
        return func(*args, **(kwargs or {}))


@needs_default_cuda_route
def test_a_synchronized_step_passes_over_the_input_only_through_cuda_kernels(monkeypatch) -> None:
    # every operator of a replica's training step (forward, backward) that touches the full
    # input has a CUDA kernel: the reference only serves per-channel work on CUDA
    runner = ThreadedDataParallel(resnet_block(), ["cpu"] * 2)
    calls = OperatorCalls()
    with in_every_thread(monkeypatch, calls):
        runner(torch.randn(5, 3, 4, 4, requires_grad=True)).sum().backward()
    full_size = {name for name in calls.names if name not in ("merge_stats", "update_running_stats")}
    assert full_size == set(FULL_SIZE_OPS), calls.names
    assert all(has_cuda_kernel(name) for name in full_size)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,memory_format", [((4, 3, 5, 5), torch.contiguous_format), ((4, 3, 5, 5), torch.channels_last), ((6, 5), torch.contiguous_format), ((0, 3, 2, 2), torch.contiguous_format)])
def test_torch_ops_serve_our_operators_as_the_reference_does(dtype, shape, memory_format) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3 + 100).to(dtype).contiguous(memory_format=memory_format)
    dy = torch.randn(shape, generator=gen).to(dtype)
    C, acc = shape[1], ref.accumulation_dtype(dtype)
    weight, bias = torch.rand(C, generator=gen) + 0.5, torch.randn(C, generator=gen)
    ours = torch_cuda_kernels()
    with torch_cuda_ops.emulated():
        mean, m2 = ours.local_stats(x)
        mean_ref, m2_ref = ref.local_stats(x)
        assert mean.dtype == m2.dtype == torch.float64
        # float32 statistics for float32 and half inputs (torch's Welford), float64 for float64
        tol = dict(atol=1e-12, rtol=1e-12) if dtype == torch.float64 else dict(atol=1e-3, rtol=2e-5)
        torch.testing.assert_close(mean, mean_ref, **tol)
        torch.testing.assert_close(m2, m2_ref, **(tol if dtype == torch.float64 else dict(atol=1e-3, rtol=1e-5)))
        count = max(1, x.numel() // C)
        m, invstd = mean_ref.to(acc), torch.rsqrt(m2_ref / count + 1e-5).to(acc)
        close = dict(atol=1e-12, rtol=1e-12) if dtype == torch.float64 else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(ours.elemt_forward(x, m, invstd, weight.to(acc), bias.to(acc), None, None), ref.elemt_forward(x, m, invstd, weight.to(acc), bias.to(acc)), **close)
        sums = ours.backward_reduce(dy, x, m)
        torch.testing.assert_close(sums, ref.backward_reduce(dy, x, m), **close)
        args = (dy, x, m, invstd, weight, *ref.backward_reduce(dy, x, m), count)
        torch.testing.assert_close(ours.backward_elemt(*args), ref.backward_elemt(*args), **close)


def test_local_stats_of_a_constant_channel_from_torchs_invstd() -> None:
    # torch gives invstd 0 (not inf) where var and eps are 0: M2 must be 0, not inf
    x = torch.ones(4, 2, 3)
    x[:, 1] = torch.arange(12.0).view(4, 3)
    ours = torch_cuda_kernels()
    with torch_cuda_ops.emulated():
        mean, m2 = ours.local_stats(x)
    torch.testing.assert_close(m2, ref.local_stats(x)[1])
    assert m2[0] == 0


def test_backward_elemt_beyond_int32_counts_divides_first() -> None:
    # torch's op takes int32 counts: a larger count must not overflow into a wrong gradient
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    mean, invstd = x.mean((0, 2)), torch.rand(3, dtype=torch.float64) + 0.5
    dy = torch.randn_like(x)
    sums = ref.backward_reduce(dy, x, mean)
    big = 2**31 + 5
    ours = torch_cuda_kernels()
    with torch_cuda_ops.emulated():
        dx = ours.backward_elemt(dy, x, mean, invstd, None, *sums, big)
    torch.testing.assert_close(dx, ref.backward_elemt(dy, x, mean, invstd, None, *sums, big), atol=1e-12, rtol=1e-12)


def test_torch_ops_make_no_host_reads_nor_pageable_copies() -> None:
    x = torch.randn(4, 3, 5, 5)
    m, invstd = torch.zeros(3), torch.ones(3)
    ours = torch_cuda_kernels()
    with torch_cuda_ops.emulated(), HostReads() as reads:
        ours.local_stats(x)
        ours.elemt_forward(x, m, invstd, None, None, None, None)
        sums = ours.backward_reduce(x, x, m)
        ours.backward_elemt(x, x, m, invstd, None, *sums, 100)
    assert reads.seen == [], reads.report()


def gathered_rows(counts: list[float], seed: int = 0, agree: bool = True) -> torch.Tensor:
    """All_gather rows of ``len(counts)`` ranks over 3 channels: header (layer, call, flag,
    count), mean, M2; with ``agree`` False, the last rank's call number differs."""
    gen = torch.Generator().manual_seed(seed)
    R = len(counts)
    heads = torch.tensor([[7.0, 0.0 if agree or r < R - 1 else 1.0, 0.0, n] for r, n in enumerate(counts)], dtype=torch.float64)
    means = torch.randn(R, 3, generator=gen, dtype=torch.float64) * 5 + 100
    m2s = torch.rand(R, 3, generator=gen, dtype=torch.float64) * torch.tensor(counts, dtype=torch.float64).unsqueeze(1)
    return torch.cat([heads, torch.where(heads[:, 3:4] > 0, means, 0.0), m2s], 1)


def running_stats(dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.linspace(-1, 1, 3, dtype=dtype), torch.linspace(0.5, 2, 3, dtype=dtype), torch.tensor(2)


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize(
    "counts,agree", [([3.0, 0.0, 4.0], True), ([0.0, 0.0], True), ([1.0, 0.0], True), ([3.0, 4.0], False)],
    ids=["uneven", "all-empty", "one-value", "disagree"],
)
def test_default_cuda_merges_are_the_references(momentum, counts, agree) -> None:
    # the ATen merges that serve CUDA, on CPU tensors, against the reference: the same values,
    # running statistics updated (or left, num_batches_tracked included) exactly alike
    ours = torch_cuda_kernels()
    rows = gathered_rows(counts, agree=agree)
    theirs_running, ours_running = running_stats(), running_stats()
    expected = ref.merge_gathered_stats(rows, 4, 2, 2, *theirs_running, momentum)
    got = ours.merge_gathered_stats(rows, 4, 2, 2, *ours_running, momentum)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, equal_nan=True)
    for a, b in zip(ours_running, theirs_running):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    if sum(counts) > 0:
        torch.testing.assert_close(
            ours.merge_stats(rows[:, 3], rows[:, 4:7], rows[:, 7:]),
            ref.merge_stats(rows[:, 3], rows[:, 4:7], rows[:, 7:]), atol=1e-12, rtol=1e-12,
        )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("slope", [None, 0.0, 0.1], ids=["no-act", "relu", "leaky"])
def test_default_cuda_fused_forms_are_the_references(dtype, memory_format, slope) -> None:
    ours = torch_cuda_kernels()
    gen = torch.Generator().manual_seed(1)
    x, z, dy = (torch.randn(4, 3, 5, 5, generator=gen).to(dtype).contiguous(memory_format=memory_format) for _ in range(3))
    acc = ref.accumulation_dtype(dtype)
    m, invstd = torch.randn(3, generator=gen).to(acc), (torch.rand(3, generator=gen) + 0.5).to(acc)
    w, b = torch.rand(3, generator=gen) + 0.5, torch.randn(3, generator=gen)
    y = ours.elemt_forward(x, m, invstd, w, b, z, slope)
    torch.testing.assert_close(y, ref.elemt_forward(x, m, invstd, w, b, z, slope), atol=0, rtol=0)
    assert y.is_contiguous(memory_format=memory_format)
    for asked in [(True, True, True), (False, True, True), (True, False, False)]:
        got = ours.backward_affine_act(dy, x, m, invstd, w, b, z, slope, *asked)
        expected = ref.backward_affine_act(dy, x, m, invstd, w, b, z, slope, *asked)
        for a, e in zip(got, expected):
            torch.testing.assert_close(a, e, atol=1e-12, rtol=1e-12)
            assert a.shape == e.shape and a.dtype == e.dtype and a.stride() == e.stride()


def test_default_cuda_kernels_make_no_host_reads() -> None:
    # the per-channel operators and fused forms that serve CUDA by default: what a synchronized
    # step, a lone replica with momentum None and a fused layer call, on CPU tensors standing in
    ours = torch_cuda_kernels()
    x, z = torch.randn(4, 3, 5, 5), torch.randn(4, 3, 5, 5)
    m, invstd, w = torch.zeros(3), torch.ones(3), torch.rand(3) + 0.5
    rows = gathered_rows([3.0, 0.0, 4.0])
    running = [running_stats() for _ in range(2)]
    with HostReads() as reads:
        ours.merge_stats(rows[:, 3], rows[:, 4:7], rows[:, 7:])
        for momentum in (0.1, None):
            ours.merge_gathered_stats(rows, 4, 2, 2, *running.pop(), momentum)  # the ranks' rows, deferred checks
        ours.elemt_forward(x, m, invstd, w, None, z, 0.1)
        ours.backward_affine_act(z, x, m, invstd, w, None, z, 0.0, True, True, True)
    assert reads.seen == [], reads.report()


@contextmanager
def in_every_thread(monkeypatch: pytest.MonkeyPatch, mode) -> Iterator[None]:
    """``mode`` (a torch function or dispatch mode) active on this thread and in every replica
    thread of ThreadedDataParallel."""
    entered = replica_threads.ThreadState.on

    @contextmanager
    def on(state, device):
        with entered(state, device), mode:
            yield

    monkeypatch.setattr(replica_threads.ThreadState, "on", on)
    with mode:
        yield


@contextmanager
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[HostReads]:
    """Host reads recorded in every thread; the pinned copies of ``devices.host_values_on`` are
    let through."""
    monkeypatch.setattr(devices, "host_values_on", allowed(devices.host_values_on))
    with HostReads() as reads:
        yield reads


def resnet_block() -> nn.Module:
    return NN.convert_sync_batchnorm(
        nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1, bias=False),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Conv2d(4, 4, 1, bias=False),
            nn.BatchNorm2d(4, momentum=None),
        )
    )


@pytest.mark.parametrize("replicas", [2, 3])
def test_a_threaded_step_reads_nothing_on_the_host(monkeypatch, replicas) -> None:
    # what stock DataParallel's replicas run too: the round exchange, merges, fences, the
    # running-statistics update (momentum None included), the backward sums
    runner = ThreadedDataParallel(resnet_block(), ["cpu"] * replicas)
    x = torch.randn(7, 3, 6, 6, requires_grad=True)
    runner(x).sum().backward()  # first step: workers started, kernels loaded
    with host_reads(monkeypatch) as reads:
        for _ in range(2):
            runner(x).sum().backward()
    assert reads.seen == [], reads.report()


def test_when_checks_are_read(monkeypatch) -> None:
    # at once where reading waits for no device; deferred on CUDA; the debug mode reads at once
    monkeypatch.delenv(checks.CHECKS_ENV, raising=False)
    assert checks.reads_at_once(torch.device("cpu")) and not checks.reads_at_once(torch.device("cuda", 0))
    monkeypatch.setenv(checks.CHECKS_ENV, "layer")
    assert checks.reads_at_once(torch.device("cuda", 0)) and checks.reads_at_once(torch.device("cpu"))
    monkeypatch.delenv(checks.CHECKS_ENV)
    with deferred_checks():
        assert not checks.reads_at_once(torch.device("cpu"))
    assert checks.reads_at_once(torch.device("cpu"))
    for bad in ("step", "sometimes"):
        monkeypatch.setenv(checks.CHECKS_ENV, bad)
        with pytest.raises(ValueError, match="SYNCBN_CHECKS must be 'layer'"):
            checks.reads_at_once(torch.device("cpu"))


def test_a_deferred_failure_is_read_at_the_end_of_the_backward(monkeypatch) -> None:
    monkeypatch.setattr(checks, "DEFER_ON_HOST", True)

    def explain(values):
        return RuntimeError("ranks disagree") if values[0] else None

    class Checked(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            checks.verify(torch.ones(1), explain)  # a forward verdict that fails
            return x * 2

        @staticmethod
        def backward(ctx, g):
            checks.verify(torch.zeros(1), explain)  # a backward one that passes
            return g * 2

    x = torch.randn(3, requires_grad=True)
    y = Checked.apply(x)  # nothing raised at the layer
    with pytest.raises(RuntimeError, match="ranks disagree.*deferred check"):
        y.sum().backward()
    checks.check_pending()  # the failure was reported once, and nothing is left
    Checked.apply(x)
    with pytest.raises(RuntimeError, match="ranks disagree"):
        checks.check_pending()


class NotYetRun:
    """An event the device has not reached yet (``query`` False) until it is waited for."""

    def __init__(self) -> None:
        self.waited = False

    def query(self) -> bool:
        return self.waited

    def synchronize(self) -> None:
        self.waited = True


def test_the_end_of_a_backward_waits_for_the_forwards_verdicts_behind_older_ones(monkeypatch) -> None:
    # on one stream a previous backward's verdict that the GPU has not reached yet comes first:
    # the read must wait past it to the forward's, not stop there
    monkeypatch.setattr(checks, "_pending", checks.deque())
    fails = lambda values: RuntimeError("the forward's verdict") if values[0] else None  # noqa: E731
    older, forward, later = NotYetRun(), NotYetRun(), NotYetRun()
    checks._pending.extend(
        [
            checks._Deferred(torch.zeros(1), older, fails, backward=True),
            checks._Deferred(torch.ones(1), forward, fails, backward=False),
            checks._Deferred(torch.zeros(1), later, fails, backward=True),
        ]
    )

    class Layer(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            checks.read_when_backward_ends()
            return g

    with pytest.raises(RuntimeError, match="the forward's verdict"):
        Layer.apply(torch.randn(2, requires_grad=True)).sum().backward()
    assert older.waited and forward.waited and not later.waited  # the backward's own: not waited for


def test_a_verdict_judged_on_the_device_is_read_only_where_it_fails(monkeypatch) -> None:
    # read at once, a passing exchange reads its one flag, never the rows' headers
    monkeypatch.setenv(checks.CHECKS_ENV, "layer")
    made: list[bool] = []

    def verdict() -> torch.Tensor:
        made.append(True)
        return torch.tensor([[1.0, 2.0]])

    explain = lambda values: RuntimeError(f"ranks disagree: {values}")  # noqa: E731
    assert checks.verify_judged(torch.tensor(True), verdict, explain) and made == []
    with pytest.raises(RuntimeError, match=r"ranks disagree: \[\[1.0, 2.0\]\]"):
        checks.verify_judged(torch.tensor(False), verdict, explain)
    # deferred, the flag is read at the end of the step (check_pending here), and the verdict
    # explained only where the flag fails
    monkeypatch.delenv(checks.CHECKS_ENV)
    monkeypatch.setattr(checks, "DEFER_ON_HOST", True)
    assert not checks.verify_judged(torch.tensor(True), verdict, explain)
    checks.check_pending()
    assert not checks.verify_judged(torch.tensor(False), verdict, explain)
    with pytest.raises(RuntimeError, match=r"ranks disagree: \[\[1.0, 2.0\]\].*deferred check"):
        checks.check_pending()
