"""functions.synchronization.Synchronizer on its own: who takes part in the collectives, the two
exchanges within a process, and what a failure does (release the round; tell the other ranks
only while this process has not joined the forward's collective). The collectives themselves
are stubbed here; tests/test_distributed.py runs them in real processes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import functions.synchronization as synchronization
from functions import ReplicaSyncError
from functions import reference as ref
from functions import stats
from functions.distributed import ProcessGroupSync
from functions.replicas import ReplicaHandle, ReplicaRound
from functions.synchronization import Synchronizer
from helpers import run_threads

CPU = torch.device("cpu")


def handles(count: int, timeout: float = 10.0) -> list[ReplicaHandle]:
    round = ReplicaRound("layer", 1, timeout)
    for _ in range(count):
        round.add(nn.Identity())
    return [ReplicaHandle(round, index) for index in range(count)]


@pytest.fixture
def reported(monkeypatch: pytest.MonkeyPatch) -> list:
    """The failed-flag rows this process would send; the all_gather answers as a world of one."""
    sent: list = []
    monkeypatch.setattr(synchronization, "report_failure", lambda call, channels, device: sent.append(call))
    monkeypatch.setattr(synchronization, "all_gather_stats", lambda local, call: (local.count, *stats.merge([local])))
    return sent


def test_only_the_master_replica_of_a_process_takes_part_in_the_collectives() -> None:
    processes = ProcessGroupSync()
    master, other = handles(2)
    group = object()
    assert Synchronizer.for_call(master, group, processes, "layer", 3, CPU).process_call is not None
    assert Synchronizer.for_call(other, group, processes, "layer", 3, CPU).process_call is None
    alone = Synchronizer.for_call(None, group, processes, "layer", 3, CPU)
    assert alone.process_call is not None and alone.replica_call is None and alone.is_master
    assert Synchronizer.for_call(master, None, processes, "layer", 3, CPU).process_call is None


def test_replicas_get_the_statistics_and_sums_of_the_whole_batch() -> None:
    x = torch.randn(7, 3, 4, dtype=torch.float64)
    chunks = [x[:4], x[4:]]
    syncs = [Synchronizer.for_call(h, None, ProcessGroupSync(), "layer", 3, CPU) for h in handles(2)]

    def replica(j: int):
        stats = syncs[j].global_stats(chunks[j], *ref.local_stats(chunks[j]), 1e-5)
        sums = syncs[j].global_grad_sums(chunks[j].sum((0, 2)), chunks[j].square().sum((0, 2)))
        return stats, sums

    results = run_threads([lambda j=j: replica(j) for j in range(2)])
    for j, ((count, mean, var, mean_acc, invstd), (sum_dy, sum_dy_xmu)) in enumerate(results):
        assert count == 28
        if j == 0:  # the master, which updates the running statistics, gets them in float64
            torch.testing.assert_close(mean, x.mean((0, 2)))
            torch.testing.assert_close(var, x.var((0, 2), correction=0))
        else:
            assert mean is None and var is None
        # what every replica normalizes with, computed once by the master
        torch.testing.assert_close(mean_acc, x.mean((0, 2)))
        torch.testing.assert_close(invstd, torch.rsqrt(x.var((0, 2), correction=0) + 1e-5))
        torch.testing.assert_close(sum_dy, x.sum((0, 2)))
        torch.testing.assert_close(sum_dy_xmu, x.square().sum((0, 2)))
    assert results[0][0][3] is results[1][0][3]  # one device: the same tensors, not copies
    assert [s.is_master for s in syncs] == [True, False] and all(s.count == 28 for s in syncs)


def test_a_failure_before_the_collective_releases_the_round_and_tells_the_ranks(reported: list) -> None:
    master, other = handles(2)
    sync = Synchronizer.for_call(master, object(), ProcessGroupSync(), "layer", 3, CPU)
    waiting = Synchronizer.for_call(other, None, ProcessGroupSync(), "layer", 3, CPU)
    sync.fail(ValueError("bad input"))
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(ReplicaSyncError, match="replica 0 failed: ValueError: bad input"):
        waiting.global_stats(x, *ref.local_stats(x), 1e-5)
    assert reported == [sync.process_call]
    sync.fail(RuntimeError("again"))  # one failed-flag row per call at most
    assert len(reported) == 1


def test_no_report_once_the_collective_was_joined_nor_for_an_interrupt(reported: list) -> None:
    x = torch.randn(4, 3, dtype=torch.float64)
    joined = Synchronizer.for_call(None, object(), ProcessGroupSync(), "layer", 3, CPU)
    joined.global_stats(x, *ref.local_stats(x), 1e-5)
    joined.fail(RuntimeError("in backward"))  # the other ranks are in the backward's all_reduce
    interrupted = Synchronizer.for_call(None, object(), ProcessGroupSync(), "layer", 3, CPU)
    interrupted.fail(KeyboardInterrupt())
    assert reported == []
