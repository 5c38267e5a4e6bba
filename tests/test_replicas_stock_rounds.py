"""The replica rounds under the calls that stock nn.DataParallel makes (torch's replicate(), or a
replay of its calls, run in threads on the CPU): rounds recover after a step in which no replica
reached the layer, and follow the number of replicas; where one replica has a bad input, fails
outside the layers, disagrees on the dtype or fails the merge, the others fail at once; one value
per channel counts over all replicas, an empty replica joins the exchange, and the user's model
keeps nothing of ours."""
from __future__ import annotations

import copy
import gc
import io
import time
from typing import Callable

import pytest
import torch
from torch import nn

from syncbn.functions import ReplicaSyncError
from helpers import RaiseOn, assert_buffers_equal, buffers_of, replayed_replicas, run_threads, stock_replicas
from syncbn import nn as NN
from syncbn.modules.parallel import ThreadedDataParallel


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
    assert time.monotonic() - start < 30 / 2  # at once: well within the 30 s timeout it guards
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
    assert time.monotonic() - start < 30 / 2  # at once: well within the 30 s timeout it guards
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
