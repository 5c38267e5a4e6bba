"""Never hang, never lose state: timeouts, failures, recovery, and the replica rounds under the
calls that stock nn.DataParallel makes."""
from __future__ import annotations

import copy
import gc
import io
import threading
import time
from typing import Callable

import pytest
import torch
from torch import nn

from syncbn.functions import ReplicaSyncError
from syncbn.functions.operators import backend
from syncbn.functions.synchronization import replicas
from syncbn.functions.synchronization import distributed
from syncbn.functions.synchronization.replicas import ReplicaCall, ReplicaRound, resolve_timeout
from syncbn.functions.synchronization.synchronizer import Synchronizer
from helpers import another_thread_runs_during, replayed_replicas, run_threads, stock_replicas
from syncbn import nn as NN
from syncbn.modules.parallel import ThreadedDataParallel
from testkit.paths import replicas_spin


class RaiseOn(nn.Module):
    """Raises (or skips the next layer) in the replica whose chunk has ``batch`` samples."""

    def __init__(self, batch: int, error: type[BaseException] = KeyError) -> None:
        super().__init__()
        self.batch, self.error, self.armed = batch, error, True

    def forward(self, x):
        if self.armed and x.size(0) == self.batch:
            raise self.error(f"replica with batch {self.batch} fails")
        return x


class SkipOn(nn.Module):
    """A data-dependent branch: the replica whose chunk has ``batch`` samples skips ``layer``."""

    def __init__(self, layer: nn.Module, batch: int) -> None:
        super().__init__()
        self.layer, self.batch = layer, batch

    def forward(self, x):
        return x if x.size(0) == self.batch else self.layer(x)


def buffers_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}


def assert_buffers_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-12, rtol=1e-12, msg=key)


def test_replica_error_releases_the_others_at_once_and_keeps_state() -> None:
    bn = NN.SyncBatchNorm2d(3, timeout=30).double()
    model = ThreadedDataParallel(nn.Sequential(RaiseOn(1), bn), ["cpu"] * 4)
    before = buffers_of(model.module)
    start = time.monotonic()
    with pytest.raises(KeyError, match="batch 1 fails"):  # the original error, not the abort
        model(torch.randn(10, 3, 2, 2, dtype=torch.float64))  # chunks 3,3,3,1
    assert time.monotonic() - start < 5
    assert_buffers_equal(buffers_of(model.module), before)


def test_step_after_failed_step_is_correct() -> None:
    raiser = RaiseOn(1)
    ours = nn.Sequential(raiser, NN.SyncBatchNorm2d(3, timeout=30)).double()
    ref = nn.BatchNorm2d(3).double()
    model = ThreadedDataParallel(ours, ["cpu"] * 4)
    with pytest.raises(KeyError):
        model(torch.randn(10, 3, 2, 2, dtype=torch.float64))
    raiser.armed = False
    for _ in range(2):
        x = torch.randn(10, 3, 2, 2, dtype=torch.float64)
        torch.testing.assert_close(model(x), ref(x), atol=1e-12, rtol=1e-12)
    assert_buffers_equal(buffers_of(ours[1]), buffers_of(ref))


def test_missing_replica_times_out_with_a_clear_error() -> None:
    bn = NN.SyncBatchNorm2d(3, timeout=0.5)
    model = ThreadedDataParallel(nn.Sequential(SkipOn(bn, batch=1)), ["cpu"] * 4)
    before = buffers_of(model.module)
    start = time.monotonic()
    with pytest.raises(ReplicaSyncError) as info:
        model(torch.randn(10, 3, 2, 2))
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "SyncBatchNorm2d(3) '0.layer'" in message
    assert "forward call 0 of replica round 1" in message
    assert "replicas [0, 1, 2] of 4 arrived, [3] missing" in message
    assert_buffers_equal(buffers_of(model.module), before)
    # the next step, where every replica reaches the layer, works and counts one batch
    model.module[0].batch = -1
    model(torch.randn(10, 3, 2, 2))
    assert int(bn.num_batches_tracked) == 1


def test_timeout_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SYNCBN_TIMEOUT", "0.3")
    model = ThreadedDataParallel(SkipOn(NN.SyncBatchNorm1d(2), batch=1), ["cpu"] * 2)
    start = time.monotonic()
    with pytest.raises(ReplicaSyncError, match="after waiting 0.3s"):
        model(torch.randn(3, 2))  # chunks 2, 1
    assert time.monotonic() - start < 5


def test_bad_timeout_values(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in (0, -1, float("nan"), float("inf"), 1e10):  # beyond 1e9 s the waits' deadlines overflow
        with pytest.raises(ValueError):
            NN.SyncBatchNorm2d(3, timeout=bad)
    monkeypatch.setenv("SYNCBN_TIMEOUT", "inf")
    with pytest.raises(ValueError, match="at most"):
        resolve_timeout(None)


def test_rounds_spin(monkeypatch: pytest.MonkeyPatch) -> None:
    # how long a replica waiting at a native meeting polls before it sleeps: 300 us by default
    monkeypatch.setattr(replicas, "usable_cores", lambda: 2)
    round = ReplicaRound("layer", 1, 5.0)
    members = [nn.Identity() for _ in range(3)]
    for member in members:
        round.add(member)
    assert round.spin_us == replicas.SPIN_US == 300.0
    if backend.NATIVE_ROUNDS is not None:  # the cores that decide who may poll reach the native side
        assert round.native().cores == 2
        assert round.native().spin_us == 300.0
    torch.manual_seed(0)
    x = torch.randn(5, 3, 2, 2, dtype=torch.float64)  # chunks 3, 2
    for value in (0.0, 1000.0):
        round = ReplicaRound("layer", 1, 5.0, spin_us=value)
        if backend.NATIVE_ROUNDS is not None:  # the native side waits with it
            members = [nn.Identity(), nn.Identity()]
            for member in members:
                round.add(member)
            assert round.native().spin_us == value
        replicas_spin(monkeypatch, value)  # the rounds of the layers below
        ours, theirs = NN.SyncBatchNorm2d(3).double(), nn.BatchNorm2d(3).double()
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        y = ThreadedDataParallel(ours, ["cpu"] * 2)(a)
        assert ours._round_tracker._current.spin_us == value
        torch.testing.assert_close(y, theirs(b), rtol=0, atol=1e-12)
        y.square().sum().backward()
        theirs(b).square().sum().backward()
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)


@pytest.mark.skipif(backend.NATIVE_ROUNDS is None, reason="the native meeting checks its spin")
def test_bad_spin_values() -> None:
    for bad in (-1.0, float("nan"), float("inf"), 2e6):
        with pytest.raises(ValueError, match="spin_us"):
            backend.NATIVE_ROUNDS.ReplicaRound(2, 5.0, "layer", 1, bad)


def replica_mark(x: torch.Tensor) -> int:
    """Which replica's chunk ``x`` is, where the caller wrote the index in each chunk's first value."""
    return int(x[0, 0, 0, 0])


class LateReplicas(nn.Module):
    """Every replica but the first sleeps ``seconds`` before going on."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        if replica_mark(x) != 0:
            time.sleep(self.seconds)
        return x


class MeetingCpuTime(nn.Module):
    """``layer``, recording the CPU time its call took on each replica's thread."""

    def __init__(self, layer: nn.Module, seen: dict) -> None:
        super().__init__()
        self.layer, self.seen = layer, seen

    def forward(self, x):
        start = time.thread_time()
        y = self.layer(x)
        self.seen[replica_mark(x)] = time.thread_time() - start
        return y


@pytest.mark.skipif(backend.NATIVE_ROUNDS is None, reason="the native meeting decides who polls")
@pytest.mark.parametrize("replicas_count, cores, polls", [(2, 1, False), (2, 2, True), (3, 2, False), (3, 3, True)])
def test_waiters_poll_only_on_spare_cores(monkeypatch: pytest.MonkeyPatch, replicas_count: int, cores: int, polls: bool) -> None:
    # The first replica waits 0.4 s for the others. It may poll long (burning its core's time, here
    # up to a second) only where the replicas still working leave a core spare: with 3 replicas on
    # 2 cores, the 2 still working need both, so it polls 50 us at most and sleeps.
    replicas_spin(monkeypatch, 1e6)
    monkeypatch.setattr(replicas, "usable_cores", lambda: cores)
    seen: dict = {}
    model = nn.Sequential(LateReplicas(0.4), MeetingCpuTime(NN.SyncBatchNorm2d(3), seen)).double()
    x = torch.randn(3 * replicas_count, 3, 2, 2, dtype=torch.float64)
    x[::3, 0, 0, 0] = torch.arange(replicas_count, dtype=torch.float64)  # chunks of 3: the replica's index first
    with torch.no_grad():
        y = ThreadedDataParallel(model, ["cpu"] * replicas_count)(x)
    torch.testing.assert_close(y, nn.BatchNorm2d(3).double()(x), rtol=0, atol=1e-12)
    assert (seen[0] > 0.1) == polls, f"the first replica's meeting took {seen[0]:.3f} s of CPU time"


def test_later_layer_failure_keeps_earlier_update() -> None:
    # as nn.BatchNorm: a layer whose exchange completed keeps its update when a later one fails
    first, second = NN.SyncBatchNorm2d(3, timeout=30), NN.SyncBatchNorm2d(3, timeout=30)
    ours = nn.Sequential(first, RaiseOn(1, ValueError), second).double()
    ref_first = nn.BatchNorm2d(3).double()
    x = torch.randn(10, 3, 2, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="batch 1 fails"):
        ThreadedDataParallel(ours, ["cpu"] * 4)(x)
    ref_first(x)
    assert_buffers_equal(buffers_of(first), buffers_of(ref_first))
    assert_buffers_equal(buffers_of(second), buffers_of(nn.BatchNorm2d(3).double()))


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.fail = x.size(0) == 1
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.fail:
            raise ArithmeticError("backward of the small replica fails")
        return grad


class FailInBackward(nn.Module):
    def forward(self, x):
        return FailingBackward.apply(x)


def test_backward_failure_releases_the_others_and_recovers() -> None:
    bn = NN.SyncBatchNorm2d(3, timeout=30).double()
    model = ThreadedDataParallel(nn.Sequential(bn, FailInBackward()), ["cpu"] * 4)
    x = torch.randn(10, 3, 2, 2, dtype=torch.float64, requires_grad=True)
    start = time.monotonic()
    with pytest.raises(ArithmeticError, match="small replica"):
        model(x).sum().backward()
    assert time.monotonic() - start < 5
    # the next step is normal
    ref = nn.BatchNorm2d(3).double()
    ref.load_state_dict(bn.state_dict())
    x = torch.randn(9, 3, 2, 2, dtype=torch.float64, requires_grad=True)  # chunks 3,3,3
    x_ref = x.detach().clone().requires_grad_()
    model(x).square().sum().backward()
    ref(x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-12, rtol=1e-12)


def test_two_forwards_before_one_backward() -> None:
    ours = NN.SyncBatchNorm1d(4).double()
    ref = nn.BatchNorm1d(4).double()
    model = ThreadedDataParallel(ours, ["cpu"] * 3)
    xs = [torch.randn(n, 4, dtype=torch.float64, requires_grad=True) for n in (7, 5)]
    xs_ref = [x.detach().clone().requires_grad_() for x in xs]
    loss = sum((model(x) ** 3).sum() for x in xs)
    loss_ref = sum((ref(x) ** 3).sum() for x in xs_ref)
    loss.backward()
    loss_ref.backward()
    for x, x_ref in zip(xs, xs_ref):
        torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, atol=1e-10, rtol=1e-10)
    assert_buffers_equal(buffers_of(ours), buffers_of(ref))


# --- the calls that stock nn.DataParallel makes, replayed on the CPU -------------------------


def forward_replicas(model: nn.Module, x: torch.Tensor, count: int, make=stock_replicas) -> list:
    """One DataParallel forward: replicate, run the replicas in threads, drop them."""
    replicas = make(model, count)
    chunks = x.chunk(count)
    jobs = [lambda r=r, c=c: r(c) for r, c in zip(replicas, chunks)]
    del replicas
    with torch.no_grad():
        return run_threads(jobs)


@pytest.mark.parametrize("keep_errors", [True, False])
@pytest.mark.parametrize("make", [stock_replicas, replayed_replicas])
def test_rounds_recover_when_no_replica_reached_the_layer(make, keep_errors: bool) -> None:
    if make is replayed_replicas and keep_errors:
        pytest.skip("without torch's replicate(), a new round needs the failed step's replicas gone")
    raiser = RaiseOn(-1)
    ours = nn.Sequential(raiser, NN.SyncBatchNorm2d(3, timeout=2)).double()
    ref = nn.BatchNorm2d(3).double()
    raiser.batch = 3  # every replica of a batch of 12 on 4 devices raises before the layer
    errors = forward_replicas(ours, torch.randn(12, 3, 2, 2, dtype=torch.float64), 4, make)
    assert all(isinstance(e, KeyError) for e in errors)
    if not keep_errors:  # their tracebacks hold the replicas (in reference cycles, hence gc)
        del errors
        gc.collect()
    raiser.armed = False
    for step in range(2):
        x = torch.randn(10, 3, 2, 2, dtype=torch.float64)
        start = time.monotonic()
        outputs = forward_replicas(ours, x, 4, make)
        assert time.monotonic() - start < 2, "replicas joined a stale round"
        assert all(isinstance(o, torch.Tensor) for o in outputs), outputs
        with torch.no_grad():
            torch.testing.assert_close(torch.cat(outputs), ref(x), atol=1e-12, rtol=1e-12)
    assert_buffers_equal(buffers_of(ours[1]), buffers_of(ref))


def test_stock_rounds_fewer_replicas_then_more() -> None:
    # a small last batch makes fewer replicas; the round size follows what replicate() made
    ours = NN.SyncBatchNorm1d(2).double()
    ref = nn.BatchNorm1d(2).double()
    for batch, count in [(8, 4), (2, 2), (9, 3), (1 + 1, 1)]:
        x = torch.randn(batch, 2, dtype=torch.float64)
        outputs = forward_replicas(ours, x, count)
        with torch.no_grad():
            torch.testing.assert_close(torch.cat(outputs), ref(x), atol=1e-12, rtol=1e-12)
    assert_buffers_equal(buffers_of(ours), buffers_of(ref))


def test_stock_replica_with_bad_input_fails_the_others_at_once() -> None:
    bn = NN.SyncBatchNorm2d(3, timeout=30)
    replicas = stock_replicas(bn, 2)
    inputs = [torch.randn(2, 3, 2, 2), torch.randn(2, 4, 2, 2)]
    start = time.monotonic()
    with torch.no_grad():
        results = run_threads([lambda r=r, x=x: r(x) for r, x in zip(replicas, inputs)])
    assert time.monotonic() - start < 5
    assert isinstance(results[1], RuntimeError) and "expected 3 channels" in str(results[1])
    assert isinstance(results[0], ReplicaSyncError) and "replica 1 failed" in str(results[0])
    assert int(bn.num_batches_tracked) == 0


@pytest.mark.parametrize("where", ["before", "between"], ids=["before-the-layers", "between-layers"])
def test_stock_replica_failing_outside_the_layers_releases_the_others_at_once(where: str) -> None:
    # an error outside our layers (a convolution's OOM): under torch's replicate() the root's
    # always-called hook breaks the failed replica's rounds, so the others, waiting at a meeting
    # of that step, raise at once (not after the 30 s timeout); the next step is exact
    raiser = RaiseOn(batch=1, error=MemoryError)
    layers = [NN.SyncBatchNorm2d(3, timeout=30), nn.ReLU(), NN.SyncBatchNorm2d(3, timeout=30)]
    layers.insert(0 if where == "before" else 2, raiser)
    ours = nn.Sequential(*layers).double()
    ref = nn.Sequential(*[nn.BatchNorm2d(3) if isinstance(m, NN.SyncBatchNorm2d) else copy.deepcopy(m) for m in layers])
    ref = ref.double()
    x = torch.randn(5, 3, 2, 2, dtype=torch.float64)
    start = time.monotonic()
    errors = forward_replicas(ours, x, 3)  # chunks of 2, 2 and 1: replica 2 raises
    assert time.monotonic() - start < 1
    assert isinstance(errors[2], MemoryError)
    for j in (0, 1):
        assert isinstance(errors[j], ReplicaSyncError), errors[j]
        assert "replica 2 failed: MemoryError: replica with batch 1 fails" in str(errors[j])
    raiser.armed = False
    with torch.no_grad():
        if where == "between":  # the first layer's exchange had completed: it counted the failed step
            ref[0](x)
        x = torch.randn(6, 3, 2, 2, dtype=torch.float64)
        expected = ref(x)
    outputs = forward_replicas(ours, x, 3)
    assert all(isinstance(o, torch.Tensor) for o in outputs), outputs
    torch.testing.assert_close(torch.cat(outputs), expected, atol=1e-12, rtol=1e-12)
    assert_buffers_equal(buffers_of(ours), buffers_of(ref))


def test_stock_replica_success_leaves_the_rounds_alone() -> None:
    # the hook fires on errors only: a forward called inside a user's `except` block still syncs
    ours = nn.Sequential(NN.SyncBatchNorm1d(2, timeout=5)).double()
    ref = nn.BatchNorm1d(2).double()
    x = torch.randn(6, 2, dtype=torch.float64)
    try:
        raise KeyError("handled by the caller")
    except KeyError:
        outputs = forward_replicas(ours, x, 2)
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(outputs), ref(x), atol=1e-12, rtol=1e-12)
    assert_buffers_equal(buffers_of(ours[0]), buffers_of(ref))
    # the hook is the replicas' alone; the model still copies, pickles and loads as before
    forward_replicas(ours, x, 2)
    assert not ours._forward_hooks and not ours._forward_hooks_always_called
    buffer = io.BytesIO()
    torch.save(copy.deepcopy(ours), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.state_dict().keys() == ours.state_dict().keys()


@pytest.mark.parametrize("wrapper", ["stock", "threaded"])
def test_a_replicated_model_reverts_to_exactly_torch_own(wrapper: str) -> None:
    # after a step through torch's replicate() (stock nn.DataParallel) or ours, the user's model
    # holds nothing of ours: reverted, it scripts, and its pickle never names our package
    model = nn.Sequential(nn.Conv2d(3, 3, 1), NN.BatchNorm2d(3), nn.ReLU(), NN.BatchNorm2d(3)).double()
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64)
    if wrapper == "stock":
        forward_replicas(model, x, 2)
    else:
        ThreadedDataParallel(model, ["cpu"] * 2)(x).sum().backward()
    reverted = NN.revert_sync_batchnorm(model)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in reverted.modules())
    torch.jit.script(reverted)
    buffer = io.BytesIO()
    torch.save(reverted, buffer)
    assert b"syncbn" not in buffer.getvalue()


def test_replicas_disagreeing_on_dtype() -> None:
    bn = NN.SyncBatchNorm2d(3, timeout=30)  # float32 params accept float32 and bfloat16 input
    replicas = stock_replicas(bn, 2)
    inputs = [torch.randn(2, 3, 2, 2), torch.randn(2, 3, 2, 2).bfloat16()]
    with torch.no_grad():
        results = run_threads([lambda r=r, x=x: r(x) for r, x in zip(replicas, inputs)])
    assert isinstance(results[0], RuntimeError) and "replicas disagree" in str(results[0])
    assert isinstance(results[1], ReplicaSyncError)
    assert int(bn.num_batches_tracked) == 0


@pytest.mark.parametrize("last", [0, 1, 2])
def test_a_failing_merge_is_the_masters_error_whoever_arrives_last(last: int) -> None:
    # natively the replica that arrives last runs the master's merge on its own thread: its error
    # (replicas disagreeing on the dtype) still reaches the master's caller as it is, and the
    # others, the merging replica included, raise ReplicaSyncError naming replica 0
    bn = NN.SyncBatchNorm2d(3, timeout=30)
    replicas = stock_replicas(bn, 3)
    inputs = [torch.randn(2, 3, 2, 2), torch.randn(2, 3, 2, 2).bfloat16(), torch.randn(2, 3, 2, 2)]

    def job(index: int) -> Callable[[], object]:
        def run() -> object:
            if index == last:
                time.sleep(0.3)  # the others are waiting by then
            return replicas[index](inputs[index])

        return run

    with torch.no_grad():
        results = run_threads([job(i) for i in range(3)])
    assert isinstance(results[0], RuntimeError) and not isinstance(results[0], ReplicaSyncError), results[0]
    assert "replicas disagree" in str(results[0])
    for other in results[1:]:
        assert isinstance(other, ReplicaSyncError) and "replica 0 failed" in str(other), other
    assert int(bn.num_batches_tracked) == 0


def test_one_value_per_channel_over_all_replicas() -> None:
    bn = NN.SyncBatchNorm2d(3, timeout=30)
    replicas = stock_replicas(bn, 2)
    inputs = [torch.randn(1, 3, 1, 1), torch.randn(0, 3, 1, 1)]
    with torch.no_grad():
        results = run_threads([lambda r=r, x=x: r(x) for r, x in zip(replicas, inputs)])
    message = "more than 1 value per channel when training, got input size (1, 3, 1, 1), (0, 3, 1, 1) over 2 replicas"
    assert isinstance(results[0], ValueError) and message in str(results[0]), results[0]
    assert isinstance(results[1], ReplicaSyncError) and f"replica 0 failed: ValueError: {bn._label()}" in str(results[1])
    assert int(bn.num_batches_tracked) == 0
    # one value on each of two replicas is a batch of two: fine
    results = forward_replicas(bn, torch.randn(2, 3, 1, 1), 2)
    assert all(isinstance(r, torch.Tensor) for r in results)


def test_empty_replica_batch_joins_the_exchange() -> None:
    bn = NN.SyncBatchNorm1d(3).double()
    ref = nn.BatchNorm1d(3).double()
    replicas = stock_replicas(bn, 3)
    x = torch.randn(6, 3, dtype=torch.float64)
    inputs = [x[:4], x[4:4], x[4:]]
    with torch.no_grad():
        results = run_threads([lambda r=r, x=x: r(x) for r, x in zip(replicas, inputs)])
        torch.testing.assert_close(torch.cat(results), ref(x), atol=1e-12, rtol=1e-12)
    assert_buffers_equal(buffers_of(bn), buffers_of(ref))


def test_without_the_compiled_module_replicas_refuse_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # one meeting, native: without the compiled module every replica raises an error that says how
    # to build it, at once and before any state changes; one device and ranks still work
    monkeypatch.setattr(backend, "NATIVE_ROUNDS", None)
    bn = NN.SyncBatchNorm2d(3, timeout=30).double()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"SyncBatchNorm2d\(3\): synchronizing replicas in one process needs the compiled extension.*make_ext.sh"):
        ThreadedDataParallel(bn, ["cpu"] * 2)(torch.randn(4, 3, 2, 2, dtype=torch.float64))
    assert time.monotonic() - start < 5
    assert int(bn.num_batches_tracked) == 0
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64)
    torch.testing.assert_close(bn(x), nn.BatchNorm2d(3).double()(x), atol=1e-12, rtol=1e-12)


def round_calls(size: int, timeout: float, number: int = 0) -> list[Synchronizer]:
    """One call (``number``) of each of ``size`` replicas of one round, as their layer makes it."""
    round = ReplicaRound("layer", 1, timeout=timeout)
    for _ in range(size):
        round.add(nn.Identity())
    return [Synchronizer(ReplicaCall(round, index, number), None, "layer", 3, torch.device("cpu")) for index in range(size)]


def batch_norm_of(sync: Synchronizer, x: torch.Tensor) -> torch.Tensor:
    return sync.batch_norm(x, None, None, (None, None, None, 0.1), 1e-5, None, None)


def test_a_round_meets_again_at_the_same_call_with_nothing_left_behind() -> None:
    needs_native_rounds()
    x = torch.randn(6, 3, dtype=torch.float64)
    expected = nn.functional.batch_norm(x, None, None, training=True)
    syncs = round_calls(3, 5)
    for _ in range(2):  # the same key again meets afresh: the first meeting left nothing behind
        ys = run_threads([lambda j=j: batch_norm_of(syncs[j], x[2 * j : 2 * j + 2]) for j in range(3)])
        torch.testing.assert_close(torch.cat(ys), expected, atol=1e-12, rtol=1e-12)


def test_abort_releases_a_waiting_master_and_a_waiting_replica_at_once() -> None:
    # the master waits for the parts and replica 1 for the result (two queues of the round):
    # an abort from outside, as ThreadedDataParallel makes when replica 2 fails, wakes both
    needs_native_rounds()
    syncs = round_calls(3, 30)
    round = syncs[0].replica_call.round  # type: ignore[union-attr]

    def abort_later():
        time.sleep(0.3)
        round.abort(KeyError("replica 2 fails"), 2)

    start = time.monotonic()
    x = torch.randn(2, 3, dtype=torch.float64)
    results = run_threads([lambda j=j: batch_norm_of(syncs[j], x) for j in range(2)] + [abort_later])
    assert time.monotonic() - start < 5
    for result in results[:2]:
        assert isinstance(result, ReplicaSyncError) and "replica 2 failed: KeyError" in str(result), result


def test_a_slow_master_merge_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    # replica 1 arrives at once, the master late, and its merge (here its collective) takes a
    # while: both get the result (the deadline of a replica that has everyone's part is extended once)
    needs_native_rounds()

    def slow_gather(row, call):
        time.sleep(0.3)
        return row.unsqueeze(0)

    monkeypatch.setattr(distributed, "all_gather_rows", slow_gather)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda group=None: 1)
    syncs = round_calls(2, 0.5)
    syncs[0].process_call = distributed.ProcessGroupSync().next_call(object(), "layer")
    x = torch.randn(4, 3, dtype=torch.float64)

    def master():
        time.sleep(0.4)
        return batch_norm_of(syncs[0], x[:2])

    results = run_threads([master, lambda: batch_norm_of(syncs[1], x[2:])])
    expected = nn.functional.batch_norm(x, None, None, training=True)
    torch.testing.assert_close(torch.cat(results), expected, atol=1e-12, rtol=1e-12)


def test_a_replica_waiting_at_a_meeting_holds_no_gil() -> None:
    if backend.NATIVE_ROUNDS is None:
        pytest.skip("the compiled module is not loaded: replicas cannot meet")
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64, requires_grad=True)

    def meet(late_by: float) -> list[bool]:
        """Whether another thread runs while replica 0 waits for replica 1, which comes
        ``late_by`` seconds later, forward and backward (judged without timing)."""
        replicas = stock_replicas(NN.SyncBatchNorm2d(3, timeout=30).double(), 2)
        outputs: list = [None, None]

        def late(step) -> None:
            time.sleep(late_by)
            step()

        def forward(j: int) -> None:
            outputs[j] = replicas[j](x)

        def backward(j: int) -> None:
            torch.autograd.grad(outputs[j].sum(), x)

        seen = []
        for step in (forward, backward):
            other = threading.Thread(target=late, args=(lambda: step(1),))
            other.start()
            seen.append(another_thread_runs_during(lambda: step(0)))
            other.join()
        return seen

    assert meet(0.2) == [True, True]
    assert not another_thread_runs_during(lambda: sum(range(3_000_000)))  # a C call that holds the GIL


def test_failure_inside_the_layer_backward_releases_the_others() -> None:
    bn = NN.SyncBatchNorm1d(2, timeout=30).double()
    replicas = stock_replicas(bn, 2)
    chunks = [torch.randn(n, 2, dtype=torch.float64, requires_grad=True) for n in (2, 1)]
    inputs = [chunk * 1 for chunk in chunks]
    outputs = run_threads([lambda r=r, x=x: r(x) for r, x in zip(replicas, inputs)])
    inputs[1].add_(1)  # replica 1's saved input changed: its backward raises before it meets the others
    start = time.monotonic()
    results = run_threads([lambda o=o, c=c: torch.autograd.grad(o.square().sum(), c) for o, c in zip(outputs, chunks)])
    assert time.monotonic() - start < 5
    assert isinstance(results[1], RuntimeError) and "modified by an inplace operation" in str(results[1])
    assert isinstance(results[0], ReplicaSyncError) and "replica 1 failed: RuntimeError" in str(results[0])


def test_replicas_in_order_open_a_round_at_index_0_while_the_last_rounds_replicas_live() -> None:
    # ThreadedDataParallel's replication says each replica's index (REPLICATING): replica 0 opens
    # a new round even where the last step's replicas are still alive (a traceback can keep them),
    # which the membership rule alone would let them join; the index is cleared afterwards
    from syncbn.functions.synchronization.replicas import REPLICATING, replicas_in_order

    bn = NN.SyncBatchNorm2d(3)
    kept = replicas_in_order(bn, 2)  # alive, and their round never sealed
    again = replicas_in_order(bn, 3)
    handles = [r.__dict__["_sync_replica"] for r in kept + again]
    assert [h.index for h in handles] == [0, 1, 0, 1, 2]
    assert handles[0].round is handles[1].round and handles[2].round is not handles[0].round
    assert handles[2].round.size == 3 and handles[0].round.size == 2
    assert REPLICATING.index is None

    class Raises(nn.Module):
        def _replicate_for_data_parallel(self):
            raise RuntimeError("no replica")

    with pytest.raises(RuntimeError, match="no replica"):
        replicas_in_order(Raises(), 2)
    assert REPLICATING.index is None


def needs_native_rounds() -> None:
    if backend.NATIVE_ROUNDS is None:
        pytest.skip("the compiled module is not loaded: replicas cannot meet")


class Checkpointed(nn.Module):
    """A linear layer and a batch norm, recomputed in backward (non-reentrant checkpointing)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False).sin()


@pytest.mark.parametrize("early_stop", [True, False])
def test_non_reentrant_checkpointing_recomputes_through_the_layer(early_stop: bool) -> None:
    # the recomputation runs in backward with autograd on, meets the other replicas again, updates
    # the running statistics once (as torch's layer without checkpointing; torch's own under
    # checkpoint counts the step twice), and checkpoint's early stop (an exception raised while
    # the layer saves) is no failure
    needs_native_rounds()
    torch.manual_seed(0)
    ref = Checkpointed().double()
    ours = NN.convert_sync_batchnorm(copy.deepcopy(ref))
    runner = ThreadedDataParallel(ours, ["cpu"] * 2)
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        for _ in range(2):
            x = torch.randn(6, 4, dtype=torch.float64)
            xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
            yr, yo = ref.block(xr).sin(), runner(xo)  # the reference without checkpointing
            yr.square().sum().backward()
            yo.square().sum().backward()
            torch.testing.assert_close(yo, yr, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(xo.grad, xr.grad, rtol=1e-10, atol=1e-10)
    for p, q in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-10)
    for b, c in zip(ref.buffers(), ours.buffers()):
        torch.testing.assert_close(c, b, rtol=1e-10, atol=1e-10)


def test_forward_mode_ad_through_a_synchronized_layer_raises() -> None:
    needs_native_rounds()
    replicas = stock_replicas(NN.SyncBatchNorm1d(3, timeout=30).double(), 2)

    def replica(j: int):
        x = torch.autograd.forward_ad.make_dual(torch.randn(4, 3, dtype=torch.float64), torch.ones(4, 3, dtype=torch.float64))
        return replicas[j](x)

    start = time.monotonic()
    with torch.autograd.forward_ad.dual_level():  # one level for the process (levels are global)
        results = run_threads([lambda j=j: replica(j) for j in range(2)])
    assert time.monotonic() - start < 5  # never a silent tangent, never a hang
    assert all(isinstance(r, (NotImplementedError, ReplicaSyncError)) for r in results), results
    assert any(isinstance(r, NotImplementedError) for r in results)
