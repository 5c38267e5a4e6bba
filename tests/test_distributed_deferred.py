"""Deferred checks across processes (the default for CUDA tensors; testkit.paths.deferred_checks on
the CPU): training stays exact with the global count on the device, a step reads nothing on the host
until it ends, and the native path queues its verdicts from host copies. Their errors are tested
in tests/test_distributed_failures.py. Each behaviour runs on every rank (testkit.process_sets)."""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from syncbn.functions import devices
from syncbn.functions.operators import backend
from syncbn.functions.synchronization import checks
from syncbn.functions.synchronization.synchronizer import Synchronizer
from syncbn import nn as NN
from testkit.ddp_lockstep import conv_bn_2d, linear_bn_1d, train_against_full_batch
from testkit.host_reads import HostReads, allowed
from testkit.paths import deferred_checks
from testkit.process_sets import across_processes, process_sets  # noqa: F401 - the fixture of the tests it makes


@across_processes(2, 3)
def test_deferred_checks_train_exactly(rank: int, world: int) -> None:
    # the global count stays on the device: running statistics (momentum None included), the
    # backward's division and empty ranks, in device ops only
    with deferred_checks():
        train_against_full_batch(conv_bn_2d, [4, 3, 2][:world], (3, 4, 5))
        train_against_full_batch(conv_bn_2d, [5, 0, 3][:world], (3, 3, 3), steps=2)
        train_against_full_batch(linear_bn_1d, [3, 4, 2][:world], (6,), steps=2)
        if world == 2:
            train_against_full_batch(conv_bn_2d, [5, 3], (3, 3, 4), replicas=2, steps=2)
            train_against_full_batch(conv_bn_2d, [4, 0], (3, 2, 2), replicas=2, steps=2)


@across_processes(2)
def test_deferred_checks_read_nothing_on_the_host_until_the_step_ends(rank: int, world: int) -> None:
    # every host read of a synchronized step on CUDA would drain the stream: the layers make
    # none (CPU tensors stand in), but the read of the verdicts' host copies when backward ends
    model = NN.convert_sync_batchnorm(conv_bn_2d().double())
    x = torch.randn(3 + rank, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    ends = []
    reads = HostReads()
    with deferred_checks(), mock.patch.object(devices, "host_values_on", allowed(devices.host_values_on)):
        with mock.patch.object(checks, "_host_values", lambda host: ends.append(1) or allowed(torch.Tensor.tolist)(host)):
            model(x).sum().backward()  # the first step loads what it loads
            ends.clear()
            with reads:
                for _ in range(2):
                    model(x).sum().backward()
    assert reads.seen == [], reads.report()
    assert ends, "the verdicts were never read"


@pytest.mark.skipif(backend.NATIVE_ROUNDS is None, reason="the compiled module is not loaded")
@across_processes(2)
def test_the_native_path_queues_its_deferred_verdicts_from_host_copies(rank: int, world: int) -> None:
    # the native path copies each verdict to host memory itself and makes one Python call per
    # verdict to queue it (no torch op from Python, no judging call where all is well)
    model = NN.convert_sync_batchnorm(conv_bn_2d().double())
    x = torch.randn(3 + rank, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    queued: list[tuple] = []
    defer_read = checks.defer_read
    spies = {name: mock.patch.object(Synchronizer, name, side_effect=AssertionError(name), autospec=True)
             for name in ("judge_gathered", "judge_summed")}
    with deferred_checks(), spies["judge_gathered"], spies["judge_summed"]:
        with mock.patch.object(checks, "defer_read", lambda host, ready, explain, valid=None: queued.append(
                (host, ready, valid)) or defer_read(host, ready, explain, valid)):
            model(x).sum().backward()
        checks.check_pending()
    assert len(queued) == 4, queued  # the two layers' forward verdicts, then their backward's
    for headers, ready, valid in queued[:2]:
        assert ready is None and headers.shape[0] == world and valid.dtype == torch.bool and bool(valid)
    for identities, ready, valid in queued[2:]:
        assert ready is None and valid is None and identities.numel() == 4  # CPU tensors: readable now
