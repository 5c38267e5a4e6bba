"""functions.synchronization.synchronizer.Synchronizer on its own: who takes part in the collectives, the two
exchanges within a process, and what a failure does (release the round; tell the other ranks
only while this process has not joined the forward's collective). The collectives themselves
are stubbed here; tests/test_distributed.py runs them in real processes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import syncbn.functions.synchronization.synchronizer as synchronization
from syncbn.functions import ReplicaSyncError
from syncbn.functions.operators import reference as ref
from syncbn.functions import stats
from syncbn.functions.synchronization.distributed import ProcessGroupSync
from syncbn.functions.synchronization.replicas import ReplicaHandle, ReplicaRound
from syncbn.functions.synchronization.synchronizer import Synchronizer
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
    monkeypatch.setattr(synchronization, "all_gather_stats", lambda local, call, running: stats.merge([local]))
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


def test_the_master_does_every_replicas_part_and_each_gets_its_own() -> None:
    syncs = [Synchronizer.for_call(h, None, ProcessGroupSync(), "layer", 3, CPU) for h in handles(3)]
    seen: list = []

    def work(parts: list) -> list:
        seen.append(list(parts))
        return [part * 10 for part in parts]

    results = run_threads([lambda j=j: syncs[j].on_master("forward", j + 1, work) for j in range(3)])
    assert results == [10, 20, 30]
    assert seen == [[1, 2, 3]]  # once, on the master, in replica order
    alone = Synchronizer.for_call(None, object(), ProcessGroupSync(), "layer", 3, CPU)
    assert alone.on_master("forward", 7, work) == 70  # no other replica: here


def test_the_merge_gives_the_statistics_of_the_whole_batch() -> None:
    x = torch.randn(7, 3, 4, dtype=torch.float64)
    parts = [stats.LocalStats(c.numel() // 3, *ref.local_stats(c), c.dtype, c.shape) for c in (x[:4], x[4:])]
    sync = Synchronizer.for_call(handles(2)[0], None, ProcessGroupSync(), "layer", 3, CPU)
    running = (torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64), torch.tensor(0), 1.0)
    mean, var = sync.merge_stats(parts, running)
    assert sync.count == 28
    torch.testing.assert_close(running[0], x.mean((0, 2)))  # momentum 1: the batch's statistics
    torch.testing.assert_close(running[1], x.var((0, 2)))
    assert running[2].item() == 1
    torch.testing.assert_close(mean, x.mean((0, 2)))
    torch.testing.assert_close(var, x.var((0, 2), correction=0))
    sums = sync.sum_over_ranks(x.sum((0, 2)), x.square().sum((0, 2)))  # no process group: as given
    torch.testing.assert_close(sums[0], x.sum((0, 2)))
    disagreeing = [parts[0], stats.LocalStats(4, parts[1].mean.float(), parts[1].m2.float(), torch.float32, x.shape)]
    with pytest.raises(RuntimeError, match="layer: replicas disagree on their input"):
        sync.merge_stats(disagreeing, running)
    assert running[2].item() == 1  # nothing updated


def test_a_failure_before_the_collective_releases_the_round_and_tells_the_ranks(reported: list) -> None:
    master, other = handles(2)
    sync = Synchronizer.for_call(master, object(), ProcessGroupSync(), "layer", 3, CPU)
    waiting = Synchronizer.for_call(other, None, ProcessGroupSync(), "layer", 3, CPU)
    sync.fail(ValueError("bad input"))
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(ReplicaSyncError, match="replica 0 failed: ValueError: bad input"):
        waiting.on_master("forward", x, lambda parts: parts)
    assert reported == [sync.process_call]
    sync.fail(RuntimeError("again"))  # one failed-flag row per call at most
    assert len(reported) == 1


def test_no_report_once_the_collective_was_joined_nor_for_an_interrupt(reported: list) -> None:
    x = torch.randn(4, 3, dtype=torch.float64)
    joined = Synchronizer.for_call(None, object(), ProcessGroupSync(), "layer", 3, CPU)
    joined.merge_stats([stats.LocalStats(4, *ref.local_stats(x), x.dtype, x.shape)], (None, None, None, 0.1))
    joined.fail(RuntimeError("in backward"))  # the other ranks are in the backward's all_reduce
    interrupted = Synchronizer.for_call(None, object(), ProcessGroupSync(), "layer", 3, CPU)
    interrupted.fail(KeyboardInterrupt())
    assert reported == []
