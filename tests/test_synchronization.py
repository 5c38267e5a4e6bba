"""functions.synchronization.synchronizer.Synchronizer on its own: who takes part in the collectives, the
replicas' native calls within a process, and what a failure does (release the round; tell the
other ranks only while this process has not joined the forward's collective). The collectives
themselves are stubbed here; tests/test_distributed_*.py run them in real processes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import syncbn.functions.synchronization.synchronizer as synchronization
from syncbn.functions import ReplicaSyncError
from syncbn.functions.synchronization import distributed
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
    """The failed-flag rows this process would send; the collectives answer as a world of one."""
    sent: list = []
    monkeypatch.setattr(synchronization, "report_failure", lambda call, channels, device: sent.append(call))
    monkeypatch.setattr(distributed, "all_gather_rows", lambda row, call: row.unsqueeze(0))
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda group=None: 1)
    return sent


def running_stats(channels: int) -> tuple:
    """(running_mean, running_var, num_batches_tracked, momentum 1: the batch's statistics)."""
    return torch.zeros(channels, dtype=torch.float64), torch.ones(channels, dtype=torch.float64), torch.tensor(0), 1.0


def test_only_the_master_replica_of_a_process_takes_part_in_the_collectives() -> None:
    processes = ProcessGroupSync()
    master, other = handles(2)
    group = object()
    assert Synchronizer.for_call(master, group, processes, "layer", 3, CPU).process_call is not None
    assert Synchronizer.for_call(other, group, processes, "layer", 3, CPU).process_call is None
    alone = Synchronizer.for_call(None, group, processes, "layer", 3, CPU)
    assert alone.process_call is not None and alone.replica_call is None
    assert Synchronizer.for_call(master, None, processes, "layer", 3, CPU).process_call is None


def test_each_replica_normalizes_with_the_whole_batch_and_the_master_updates_once() -> None:
    x = torch.randn(7, 3, 4, dtype=torch.float64)
    syncs = [Synchronizer.for_call(h, None, ProcessGroupSync(), "layer", 3, CPU) for h in handles(2)]
    running = running_stats(3)
    ys = run_threads([
        lambda j=j, part=part: syncs[j].batch_norm(part, None, None, running, 1e-5, None, None)
        for j, part in enumerate((x[:4], x[4:]))
    ])
    expected = torch.nn.functional.batch_norm(x, None, None, training=True, eps=1e-5)
    torch.testing.assert_close(torch.cat(ys), expected, atol=1e-12, rtol=1e-12)
    assert [sync.count for sync in syncs] == [28, 28]
    torch.testing.assert_close(running[0], x.mean((0, 2)))  # momentum 1: the batch's statistics
    torch.testing.assert_close(running[1], x.var((0, 2)))
    assert running[2].item() == 1
    mean, invstd = syncs[1].normalization  # type: ignore[misc]
    torch.testing.assert_close(mean, x.mean((0, 2)))
    torch.testing.assert_close(invstd, (x.var((0, 2), correction=0) + 1e-5).rsqrt())


def test_replicas_that_disagree_raise_and_update_nothing() -> None:
    x = torch.randn(7, 3, 4, dtype=torch.float64)
    syncs = [Synchronizer.for_call(h, None, ProcessGroupSync(), "layer", 3, CPU) for h in handles(2)]
    running = running_stats(3)
    parts = (x[:4], x[4:].float())

    def call(j: int) -> BaseException | None:
        try:
            syncs[j].batch_norm(parts[j], None, None, running, 1e-5, None, None)
        except Exception as error:  # noqa: BLE001
            return error
        return None

    errors = run_threads([lambda j=j: call(j) for j in range(2)])
    assert any(isinstance(e, RuntimeError) and "layer: replicas disagree on their input" in str(e) for e in errors), errors
    assert running[2].item() == 0  # nothing updated


def test_a_failure_before_the_collective_releases_the_round_and_tells_the_ranks(reported: list) -> None:
    master, other = handles(2)
    sync = Synchronizer.for_call(master, object(), ProcessGroupSync(), "layer", 3, CPU)
    waiting = Synchronizer.for_call(other, None, ProcessGroupSync(), "layer", 3, CPU)
    sync.fail(ValueError("bad input"))
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(ReplicaSyncError, match="replica 0 failed: ValueError: bad input"):
        waiting.batch_norm(x, None, None, running_stats(3), 1e-5, None, None)
    assert reported == [sync.process_call]
    sync.fail(RuntimeError("again"))  # one failed-flag row per call at most
    assert len(reported) == 1


def test_no_report_once_the_collective_was_joined_nor_for_an_interrupt(reported: list) -> None:
    x = torch.randn(4, 3, dtype=torch.float64)
    joined = Synchronizer.for_call(None, object(), ProcessGroupSync(), "layer", 3, CPU)
    joined.batch_norm(x, None, None, (None, None, None, 0.1), 1e-5, None, None)
    joined.fail(RuntimeError("in backward"))  # the other ranks are in the backward's all_reduce
    interrupted = Synchronizer.for_call(None, object(), ProcessGroupSync(), "layer", 3, CPU)
    interrupted.fail(KeyboardInterrupt())
    assert reported == []
