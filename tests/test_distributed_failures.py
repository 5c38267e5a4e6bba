"""What the ranks must agree on, across processes (Gloo, CPU): a rank at another synchronized call,
in another backward order or dtype, a bad input or a failing replica on one rank, a global count of
one; each raises on every rank, at once and with the checks deferred, and the failed exchange
changes no running statistics. Also a process group without torch.distributed, and the explanation
of malformed gathered counts. Each behaviour runs on every rank (testkit.process_sets)."""
from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import Tensor, nn

from syncbn.functions.synchronization import checks
from syncbn import nn as NN
from syncbn.modules.parallel import ThreadedDataParallel
from testkit.ddp_lockstep import expect_error_on_every_rank
from testkit.paths import deferred_checks
from testkit.process_sets import across_processes, process_sets  # noqa: F401 - the fixture of the tests it makes


@across_processes(2)
def test_global_count_one_raises_on_every_rank(rank: int, world: int) -> None:
    global_count_one(rank, expect_error_on_every_rank)


def call_count_mismatch(rank: int, expect: Callable[..., None]) -> None:
    first, second = NN.SyncBatchNorm1d(4), NN.SyncBatchNorm1d(4)
    first.layer_name, second.layer_name = "first", "second"
    x = torch.randn(3, 4)
    first(x)
    # rank 0 calls `first` twice, the others call `second`
    layer = first if rank == 0 else second
    expect(lambda: layer(x), RuntimeError, "different synchronized calls", f"'{layer.layer_name}'")
    assert int(layer.num_batches_tracked) == (1 if rank == 0 else 0)  # the failed exchange counts nothing


def backward_order_mismatch(rank: int, expect: Callable[..., None]) -> None:
    first, second = NN.SyncBatchNorm1d(4), NN.SyncBatchNorm1d(4)
    first.layer_name, second.layer_name = "first", "second"  # unnamed, they would look alike
    x = torch.randn(3, 4, requires_grad=True)
    y1, y2 = first(x), second(x)
    outputs = [y1, y2] if rank == 0 else [y2, y1]
    expect(lambda: outputs[0].sum().backward(), RuntimeError, "backward of different synchronized calls")


def dtype_mismatch(rank: int, expect: Callable[..., None]) -> None:
    dtype = torch.float64 if rank == 0 else torch.float32
    layer = NN.SyncBatchNorm1d(4, dtype=dtype)
    expect(lambda: layer(torch.randn(3, 4, dtype=dtype)), RuntimeError, "disagree on the input dtype")
    assert int(layer.num_batches_tracked) == 0 and torch.equal(layer.running_mean, torch.zeros(4, dtype=dtype))


def bad_input_on_one_rank(rank: int, expect: Callable[..., None]) -> None:
    layer = NN.SyncBatchNorm2d(4)
    x = torch.randn(2, 3 if rank == 1 else 4, 2, 2)
    if rank == 1:  # its own error, at once; the others learn it from the exchange's verdict
        expect_error_on_every_rank(lambda: layer(x), RuntimeError, "expected 4 channels")
    else:
        expect(lambda: layer(x), RuntimeError, "rank(s) [1]", "failed before this exchange")
    assert int(layer.num_batches_tracked) == 0 and torch.equal(layer.running_mean, torch.zeros(4))


def global_count_one(rank: int, expect: Callable[..., None]) -> None:
    layer = NN.SyncBatchNorm2d(3)
    x = torch.randn(1 if rank == 0 else 0, 3, 1, 1, requires_grad=True)
    expect(lambda: layer(x).sum().backward(), ValueError, "more than 1 value per channel", "ranks")
    # deferred, the backward ran (the error came at its end): with the statistics as gathered
    assert x.grad is None or bool(torch.isfinite(x.grad).all())
    assert torch.equal(layer.running_mean, torch.zeros(3)) and torch.equal(layer.running_var, torch.ones(3))
    assert int(layer.num_batches_tracked) == 0


MISMATCHES = [call_count_mismatch, backward_order_mismatch, dtype_mismatch, bad_input_on_one_rank, global_count_one]
"""What the ranks must agree on; each raises on every rank, at once or deferred."""


@across_processes(2)
def test_call_count_mismatch(rank: int, world: int) -> None:
    call_count_mismatch(rank, expect_error_on_every_rank)


@across_processes(2)
def test_backward_order_mismatch(rank: int, world: int) -> None:
    backward_order_mismatch(rank, expect_error_on_every_rank)


@across_processes(2)
def test_dtype_mismatch(rank: int, world: int) -> None:
    dtype_mismatch(rank, expect_error_on_every_rank)


@across_processes(2)
def test_bad_input_on_one_rank(rank: int, world: int) -> None:
    bad_input_on_one_rank(rank, expect_error_on_every_rank)


class FailsOnOneRow(nn.Module):
    """Raises for a chunk of one row, before the batch norm that follows it."""

    def forward(self, x: Tensor) -> Tensor:
        if x.size(0) == 1:
            raise ValueError("a chunk of one row")
        return x


@across_processes(2)
def test_replica_failure_before_the_exchange_reaches_every_rank(rank: int, world: int) -> None:
    # rank 1's chunks are 2 and 1 rows: its second replica fails before the layer; its master
    # replica, released from the round, tells rank 0 rather than leave it to the timeout
    model = ThreadedDataParallel(nn.Sequential(FailsOnOneRow(), NN.SyncBatchNorm1d(3)), ["cpu"] * 2)
    x = torch.randn(4 if rank == 0 else 3, 3)
    if rank == 1:
        expect_error_on_every_rank(lambda: model(x), ValueError, "a chunk of one row")
    else:
        expect_error_on_every_rank(lambda: model(x), RuntimeError, "rank(s) [1]", "failed before this exchange")


def expect_deferred_error(run: Callable[[], object], error: type, *words: str) -> None:
    """``run`` and a read of the pending checks raise ``error`` with ``words`` on every rank,
    saying that the check was deferred (at the end of ``run``'s backward, or when read)."""
    with pytest.raises(error) as caught:
        run()
        checks.check_pending()
    for word in (*words, "deferred check"):
        assert word in str(caught.value), (word, str(caught.value))


@across_processes(2)
def test_deferred_errors_on_every_rank(rank: int, world: int) -> None:
    # the same mismatches as at once, raised later; meanwhile a failed exchange changes no
    # running statistics, as at once (its count is NaN on the device)
    with deferred_checks():
        for mismatch in MISMATCHES:
            mismatch(rank, expect_deferred_error)


@pytest.mark.parametrize("group", ["gloo", 0, object()])
def test_a_process_group_that_is_not_a_group_is_refused_at_construction(group: object) -> None:
    with pytest.raises(TypeError, match=r"SyncBatchNorm2d\(3\): process_group must be a torch.distributed process group"):
        NN.SyncBatchNorm2d(3, process_group=group)
    with pytest.raises(TypeError, match="convert_sync_batchnorm: process_group must be"):
        NN.convert_sync_batchnorm(torch.nn.BatchNorm2d(3), process_group=group)


def test_process_group_without_torch_distributed_raises() -> None:
    layer = NN.SyncBatchNorm1d(3)
    layer.process_group = object()  # set past the constructor's check: refused at the first synchronized call
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        layer(torch.randn(4, 3))
    layer.eval()
    assert layer(torch.randn(4, 3)).shape == (4, 3)  # eval with running stats never syncs


@pytest.mark.parametrize("count", [float("nan"), 2.5, -5.0])
def test_malformed_gathered_counts_are_explained_as_the_device_judged_them(count: float) -> None:
    """Where merge_gathered_stats finds the rows invalid, the explanation read on the host names
    why, for every reason the device has: here a count no honest rank sends."""
    from syncbn.functions.synchronization import distributed

    call = distributed.ProcessGroupCall(object(), "SyncBatchNorm2d(2) 'bn'", layer_id=12345, number=0)
    header = distributed.stats_header(call.layer_id, call.number, torch.float32, False, torch.Size([1, 2, 2, 2]), 4)
    row = torch.ops.syncbn.pack_row(header, torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64))
    rows = torch.stack([row] * 2)
    rows[1, distributed.HEADER_SIZE - 1] = count
    *_, valid = torch.ops.syncbn.merge_gathered_stats(rows, distributed.HEADER_SIZE, distributed.DTYPE + 1, distributed.FAILED, None, None, None, None)
    error = distributed._explain_forward(call, rows[:, : distributed.HEADER_SIZE].tolist())
    assert not bool(valid)
    assert isinstance(error, RuntimeError) and "'bn'" in str(error) and "counts are malformed" in str(error)
    assert distributed._explain_forward(call, rows[:1, : distributed.HEADER_SIZE].tolist()) is None
