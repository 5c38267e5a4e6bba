"""What ``syncbn.parallel.join`` cannot shadow, it says at once, on every rank: a rank with no batch
and no example input, a model that rejects an empty batch (a ``view(x.size(0), -1)``, a
data-dependent op); ``throw_on_early_termination=True`` raises on every rank as torch's; the
collectives a step adds, none with ``enable=False``; a model that is not DDP is refused. The waits compare with the collectives' timeout they guard."""
from __future__ import annotations

import time
from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from syncbn import nn as NN
from syncbn.parallel import join
from testkit.collectives import count_collectives
from testkit.join_cases import Case, FlattensByView, ScalesByMax, train_in_join
from testkit.process_sets import across_processes, process_sets  # noqa: F401 - the fixture of the tests it makes

GROUP_TIMEOUT_S = 30  # the collectives' timeout of testkit.process_sets' groups


def error_of(case: Case, rank: int, world: int) -> str:
    """The error that training ``case`` inside join raises on this rank, at once."""
    start = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        train_in_join(case, rank, world)
    assert time.monotonic() - start < GROUP_TIMEOUT_S / 3, "raised only at the collectives' timeout"
    return str(caught.value)


@across_processes(2, 3)
def test_join_no_batch_and_no_example(rank: int, world: int) -> None:
    message = error_of(Case(counts=[2, 0, 1][:world]), rank, world)
    assert "syncbn.parallel.join" in message and "rank 1: it had no batch" in message and "example_input=" in message, message
    assert "rank 0" not in message and "rank 2" not in message, message


@across_processes(2)
def test_join_model_rejecting_empty_batch(rank: int, world: int) -> None:
    message = error_of(Case(counts=[2, 1], make_ref=FlattensByView), rank, world)
    assert "syncbn.parallel.join" in message and "rank 0: the model rejects an empty batch" in message, message
    assert "in module 'FlattensByView'" in message and "x.view(x.size(0), -1)" in message and "rank 1:" in message, message
    message = error_of(Case(counts=[1, 2], make_ref=ScalesByMax), rank, world)
    assert "x.abs().max()" in message and "max()" in message and "rank 0:" in message and "rank 1:" in message, message


@across_processes(2)
def test_join_throw_on_early_termination(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(NN.convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))).double())
    start = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        with join(ddp, throw_on_early_termination=True):
            for _ in range(3 - rank):
                ddp(torch.randn(2, 3, 4, 4, dtype=torch.float64)).sum().backward()
    assert time.monotonic() - start < GROUP_TIMEOUT_S / 3, "raised only at the collectives' timeout"
    expected = "Detected at least one rank that exhausted inputs" if rank == 0 else "Rank 1 exhausted all inputs"
    assert expected in str(caught.value), str(caught.value)


@across_processes(2)
def test_join_collectives_per_step(rank: int, world: int) -> None:
    # inside join a step sends two all_reduces more (torch's notice, the step's kind), the first
    # one three (the check); enable=False sends none and leaves no hook
    torch.manual_seed(0)
    ddp = DistributedDataParallel(NN.convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))).double())
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)

    def reduces_per_step(context: object) -> list[int]:
        counts = []
        with context:
            for _ in range(2):
                with count_collectives() as sent:
                    ddp(x).sum().backward()
                counts.append(len(sent.get("all_reduce", [])))
        return counts

    plain = reduces_per_step(nullcontext())
    assert reduces_per_step(join(ddp, enable=False)) == plain
    assert not ddp._forward_pre_hooks and not ddp._forward_hooks
    assert reduces_per_step(join(ddp)) == [plain[0] + 3, plain[1] + 2]
    assert not ddp._forward_pre_hooks and not ddp._forward_hooks


def test_join_refuses_a_model_that_is_not_ddp() -> None:
    with pytest.raises(TypeError, match="syncbn.parallel.join takes a DistributedDataParallel model, got Linear"):
        join(nn.Linear(2, 2))
