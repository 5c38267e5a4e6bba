"""The replicas' native meeting: two forwards before one backward, refused at once without the
compiled module, a round met again at the same call with nothing left behind, waiters released at
once by an abort, a slow master merge waited for, no GIL held while waiting, replicas in order
opening their own round, a recomputation under non-reentrant checkpointing meeting again, and
forward-mode AD refused."""
from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from torch import nn

from syncbn.functions import ReplicaSyncError
from syncbn.functions.operators import backend
from syncbn.functions.synchronization import distributed
from syncbn.functions.synchronization.replicas import ReplicaCall, ReplicaRound
from syncbn.functions.synchronization.synchronizer import Synchronizer
from helpers import another_thread_runs_during, assert_buffers_equal, buffers_of, run_threads, stock_replicas
from syncbn import nn as NN
from syncbn.modules.parallel import ThreadedDataParallel


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


def test_without_the_compiled_module_replicas_refuse_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # one meeting, native: without the compiled module every replica raises an error that says how
    # to build it, at once and before any state changes; one device and ranks still work
    monkeypatch.setattr(backend, "NATIVE_ROUNDS", None)
    bn = NN.SyncBatchNorm2d(3, timeout=30).double()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"SyncBatchNorm2d\(3\): synchronizing replicas in one process needs the compiled extension.*make_ext.sh"):
        ThreadedDataParallel(bn, ["cpu"] * 2)(torch.randn(4, 3, 2, 2, dtype=torch.float64))
    assert time.monotonic() - start < 30 / 2  # at once: well within the 30 s timeout it guards
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
    assert time.monotonic() - start < 30 / 2  # at once: well within the 30 s timeout it guards
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
    assert time.monotonic() - start < 30 / 2  # at once: well within the 30 s timeout it guards
    assert all(isinstance(r, (NotImplementedError, ReplicaSyncError)) for r in results), results
    assert any(isinstance(r, NotImplementedError) for r in results)
