"""Synchronization across processes: real processes on loopback, Gloo, CPU.

Each behaviour is a test of its own (``@across_processes(worlds)``); the behaviours of a world size
run in ONE set of processes (start-up dominates the cost), and one that crashes its set is run
again alone, so one failure fails one test. A training behaviour compares our layers
(under DDP, or ThreadedDataParallel replicas in each process) with nn.BatchNorm* on the
concatenated global batch, in float64 with tolerance 1e-9, over several SGD steps: outputs,
input gradients, parameter gradients (DDP averages them, so ours * world is compared), running
stats and num_batches_tracked, and that the buffers are bitwise identical on every rank.
Collectives time out after 30 s, so a broken check fails instead of hanging.
"""
from __future__ import annotations

import copy
import traceback
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from syncbn.functions import devices
from syncbn.functions.operators import backend
from syncbn.functions.synchronization import checks
from syncbn.functions.synchronization.synchronizer import Synchronizer
from testkit.collectives import count_collectives
from testkit.host_reads import HostReads, allowed
from testkit.local_group import run_local_group
from testkit.lockstep import assert_agree, train_side_by_side
from testkit.paths import deferred_checks
from helpers import randomize_affine
from syncbn import nn as NN
from syncbn.modules.parallel import ThreadedDataParallel

TOL = dict(atol=1e-9, rtol=1e-9)
CL2, CL3 = torch.channels_last, torch.channels_last_3d


# --- models and the lockstep comparison ----------------------------------------------------------


def conv_bn_2d(**bn_args) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4, **bn_args),
        nn.ReLU(),
        nn.Conv2d(4, 5, 1, bias=False),
        nn.BatchNorm2d(5, momentum=None, **{k: v for k, v in bn_args.items() if k != "momentum"}),
    )


def conv_bn_3d() -> nn.Module:
    return nn.Sequential(nn.Conv3d(2, 3, 3, padding=1, bias=False), nn.BatchNorm3d(3), nn.ReLU(), nn.BatchNorm3d(3, momentum=None))


def linear_bn_1d() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 5, bias=False), nn.BatchNorm1d(5), nn.Unflatten(1, (5, 1)), nn.BatchNorm1d(5, momentum=None))


def bn_1d_ncl() -> nn.Module:
    return nn.Sequential(nn.BatchNorm1d(4), nn.ReLU(), nn.BatchNorm1d(4, momentum=0.5))


def rank_slice(sizes: Sequence[int], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def global_batch(step: int, sizes: Sequence[int], sample: Sequence[int], memory_format=torch.contiguous_format) -> Tensor:
    """The same global batch on every rank (mean 1, std 3)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(sum(sizes), *sample, generator=gen, dtype=torch.float64) * 3 + 1
    return x.contiguous(memory_format=memory_format)


def gather_all(tensor: Tensor, group=None) -> list[Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def assert_identical_on_all_ranks(model: nn.Module, group=None) -> None:
    for name, buffer in model.named_buffers():
        for rank, other in enumerate(gather_all(buffer, group)):
            assert torch.equal(other, buffer), f"buffer {name} differs on rank {rank}"


def train_against_full_batch(
    make_ref: Callable[[], nn.Module],
    sizes: Sequence[int],
    sample: Sequence[int],
    steps: int = 3,
    memory_format=torch.contiguous_format,
    replicas: int = 1,
    training: bool = True,
    group=None,
    make_ours: Callable[[nn.Module], nn.Module] = NN.convert_sync_batchnorm,
    ref_training: bool | None = None,
    compiled: Callable[[nn.Module], nn.Module] | None = None,
) -> nn.Module:
    """This rank trains on its slice (``sizes[rank]`` samples) of the global batch; the reference
    trains on all of it. With ``replicas`` 1 the model runs under DDP (gradients averaged over
    the group); otherwise under ThreadedDataParallel in each process, with the parameter
    gradients summed over the group by hand. Ours is ``make_ours`` of a copy of the reference
    (made before its training flag is set to ``ref_training``, default ``training``);
    ``compiled(ours)`` (torch.compile) is what DDP wraps where given. Returns our model."""
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    torch.manual_seed(0)
    ref = randomize_affine(make_ref()).double().to(memory_format=memory_format)
    ours = make_ours(copy.deepcopy(ref)).train(training)
    ref.train(training if ref_training is None else ref_training)
    if group is not None:
        for layer in ours.modules():
            if isinstance(layer, NN.SyncBatchNorm):
                layer.process_group = group
    if replicas == 1:  # DDP averages the gradients over the group
        inner = ours if compiled is None else compiled(ours)
        runner: nn.Module = DistributedDataParallel(inner, process_group=group, forward_sync_buffers=False)
        averaged_over, sum_grads = world, None
    else:  # ThreadedDataParallel in each process: the parameter gradients summed by hand

        def sum_grads() -> None:
            for p in ours.parameters():
                dist.all_reduce(p.grad, group=group)

        runner, averaged_over = ThreadedDataParallel(ours, ["cpu"] * replicas), 1

    def batch(step: int) -> list[Tensor]:
        return [global_batch(step, sizes, sample, memory_format)]

    def upstream(step: int, y: Tensor) -> Tensor:
        return torch.randn(y.shape, generator=torch.Generator().manual_seed(step), dtype=torch.float64)

    steps_run = train_side_by_side(
        ref, ours, batch, steps, runner=runner, rows=rank_slice(sizes, rank), upstream=upstream,
        averaged_over=averaged_over, after_backward=sum_grads,
    )
    assert_agree(steps_run, **TOL)
    assert_identical_on_all_ranks(ours, group)
    return ours


def expect_error_on_every_rank(run: Callable[[], object], error: type, *words: str) -> None:
    with pytest.raises(error) as caught:
        run()
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))


# --- running the behaviours in processes -------------------------------------------------------

BEHAVIOURS: dict[int, dict[str, Callable[[int, int], None]]] = {}
"""world size -> {test name: what every rank runs}, in the order they run."""


def across_processes(*worlds: int) -> Callable[[Callable[[int, int], None]], Callable[..., None]]:
    """Make ``behaviour(rank, world)`` a test that runs it on every rank of a local Gloo group
    of each size in ``worlds``: the test named as the behaviour, parametrized over the world."""

    def register(behaviour: Callable[[int, int], None]) -> Callable[..., None]:
        for world in worlds:
            BEHAVIOURS.setdefault(world, {})[behaviour.__name__] = behaviour

        @pytest.mark.parametrize("world", worlds)
        def test(process_sets: "ProcessSets", world: int) -> None:
            process_sets.verify(world, behaviour.__name__)

        test.__name__ = test.__qualname__ = behaviour.__name__
        test.__doc__ = behaviour.__doc__
        return test

    return register


def run_behaviours(rank: int, world: int, names: list[str]) -> dict[str, str | None]:
    """In each process: run the named behaviours in order; the traceback of each that failed
    (None where it passed)."""
    results: dict[str, str | None] = {}
    for name in names:
        try:
            BEHAVIOURS[world][name](rank, world)
            results[name] = None
        except BaseException:  # noqa: BLE001 - reported by the parent's test
            results[name] = traceback.format_exc()
    return results


class ProcessSets:
    """Runs every behaviour of a world size in ONE set of processes (their start-up dominates
    the cost), the first time one of them is tested. Where that set dies (a crash, a timeout),
    each behaviour is run again in a set of its own when it is tested, so that one failure fails
    one test."""

    def __init__(self) -> None:
        self._outcomes: dict[int, list[dict[str, str | None]] | None] = {}

    def verify(self, world: int, name: str) -> None:
        if world not in self._outcomes:
            try:
                self._outcomes[world] = run_local_group(run_behaviours, world, list(BEHAVIOURS[world]), timeout_s=30)
            except Exception:  # noqa: BLE001 - each behaviour is retried on its own below
                self._outcomes[world] = None
        outcome = self._outcomes[world]
        if outcome is None:
            outcome = run_local_group(run_behaviours, world, [name], timeout_s=30)
        failures = [f"rank {rank}:\n{result[name]}" for rank, result in enumerate(outcome) if result[name]]
        assert not failures, "\n".join(failures)


@pytest.fixture(scope="module")
def process_sets() -> ProcessSets:
    return ProcessSets()


# --- the behaviours (each runs on every rank, in this order) -------------------------------------


@across_processes(2, 3)
def test_2d_uneven_ddp(rank: int, world: int) -> None:
    train_against_full_batch(conv_bn_2d, [4, 3, 2][:world], (3, 4, 5))


@across_processes(2)
def test_2d_channels_last(rank: int, world: int) -> None:
    train_against_full_batch(conv_bn_2d, [3, 2, 4][:world], (3, 4, 4), memory_format=CL2)


@across_processes(2, 3)
def test_3d(rank: int, world: int) -> None:
    train_against_full_batch(conv_bn_3d, [2, 3, 1][:world], (2, 3, 2, 3))


@across_processes(2)
def test_3d_channels_last(rank: int, world: int) -> None:
    train_against_full_batch(conv_bn_3d, [2, 1, 3][:world], (2, 3, 2, 2), memory_format=CL3, steps=2)


@across_processes(2, 3)
def test_1d(rank: int, world: int) -> None:
    train_against_full_batch(linear_bn_1d, [3, 4, 2][:world], (6,))
    train_against_full_batch(bn_1d_ncl, [2, 3, 1][:world], (4, 5), steps=2)


@across_processes(2, 3)
def test_empty_rank(rank: int, world: int) -> None:
    train_against_full_batch(conv_bn_2d, [5, 0, 3][:world], (3, 3, 3))


@across_processes(2)
def test_one_sample_per_rank_1x1(rank: int, world: int) -> None:
    train_against_full_batch(conv_bn_2d, [1] * world, (3, 1, 1))


@across_processes(2)
def test_layer_options(rank: int, world: int) -> None:
    train_against_full_batch(lambda: conv_bn_2d(affine=False), [3, 2, 2][:world], (3, 3, 3), steps=2)
    train_against_full_batch(lambda: conv_bn_2d(track_running_stats=False), [3, 2, 2][:world], (3, 3, 3), steps=2)


@across_processes(2)
def test_eval_without_running_stats_is_per_rank(rank: int, world: int) -> None:
    # as nn.SyncBatchNorm: eval never communicates, each rank normalizes its own batch; only
    # rank 0 evaluates here (validation on one rank), and returns without waiting for the others
    torch.manual_seed(0)
    theirs = randomize_affine(nn.BatchNorm2d(3, track_running_stats=False)).double().eval()
    ours = NN.convert_sync_batchnorm(copy.deepcopy(theirs))
    if rank == 0:
        x = torch.randn(6, 3, 4, 4, dtype=torch.float64) + rank
        with count_collectives() as calls:
            y = ours(x)
        torch.testing.assert_close(y, theirs(x), atol=1e-12, rtol=1e-12)
        assert calls == {}, calls
    dist.barrier()


@across_processes(2)
def test_ddp_buffer_broadcast(rank: int, world: int) -> None:
    # DDP's default: buffers broadcast from rank 0 at construction and before each forward, as
    # with torch's layers; ours then step identically on every rank
    torch.manual_seed(0)
    ours = NN.convert_sync_batchnorm(conv_bn_2d().double())
    for layer in ours.modules():
        if isinstance(layer, NN.SyncBatchNorm) and rank > 0:
            layer.running_mean.fill_(float(rank))  # differs until the broadcast
    runner = DistributedDataParallel(ours)
    for step in range(2):
        x = global_batch(step, [3] * world, (3, 3, 3))[rank_slice([3] * world, rank)]
        runner(x).sum().backward()
    assert_identical_on_all_ranks(ours)


@across_processes(2)
def test_global_count_one_raises_on_every_rank(rank: int, world: int) -> None:
    global_count_one(rank, expect_error_on_every_rank)


@across_processes(2, 3)
def test_collectives_per_step(rank: int, world: int) -> None:
    model = NN.convert_sync_batchnorm(conv_bn_2d().double())
    x = torch.randn(3, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    with count_collectives() as counts:
        model(x).sum().backward()
    gathers = counts.get("all_gather_single", []) + counts.get("all_gather_into_tensor", [])
    # rows of 14 header values + mean and M2 (4 and 5 channels); backward: 2C sums + 4
    assert sorted(gathers) == [14 + 2 * 4, 14 + 2 * 5], counts
    assert sorted(counts.get("all_reduce", [])) == [2 * 4 + 4, 2 * 5 + 4], counts
    assert set(counts) <= {"all_gather_single", "all_gather_into_tensor", "all_reduce"}, counts
    model.eval()
    with count_collectives() as counts:
        model(x).sum().backward()
    assert counts == {}, f"eval with running statistics communicated: {counts}"


@across_processes(2)
def test_two_level(rank: int, world: int) -> None:
    # batch 5 on 2 replicas is 3 + 2; 3 on 2 replicas is 2 + 1
    train_against_full_batch(conv_bn_2d, [5, 3], (3, 3, 4), replicas=2)
    train_against_full_batch(bn_1d_ncl, [4, 3], (4, 3), replicas=2, steps=2)
    train_against_full_batch(conv_bn_2d, [1, 3], (3, 2, 2), replicas=2, steps=2)  # 1 replica on rank 0
    train_against_full_batch(conv_bn_2d, [4, 0], (3, 2, 2), replicas=2, steps=2)  # empty process


@across_processes(2)
def test_frozen_never_communicates(rank: int, world: int) -> None:
    # frozen: torch's layers in eval mode with trainable affine, under DDP and two-level
    train_against_full_batch(conv_bn_2d, [4, 3], (3, 4, 5), make_ours=NN.freeze_batchnorm, ref_training=False)
    train_against_full_batch(conv_bn_2d, [3, 2], (3, 3, 4), replicas=2, make_ours=NN.freeze_batchnorm, ref_training=False)
    model = NN.freeze_batchnorm(conv_bn_2d().double())
    x = torch.randn(3, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    with count_collectives() as counts:
        model(x).sum().backward()
        ThreadedDataParallel(model, ["cpu"] * 2)(x).sum().backward()
    assert counts == {}, f"frozen layers communicated: {counts}"


@across_processes(2)
def test_fused_activation(rank: int, world: int) -> None:
    fuse = lambda model: NN.fuse_bn_act(NN.convert_sync_batchnorm(model))  # noqa: E731
    ours = train_against_full_batch(conv_bn_2d, [4, 3], (3, 4, 5), make_ours=fuse)
    assert ours[1].activation == "relu"
    train_against_full_batch(conv_bn_2d, [3, 2], (3, 3, 4), replicas=2, make_ours=fuse, steps=2)
    train_against_full_batch(ResidualBlock, [2, 3], (4, 3, 3), make_ours=ResidualBlock.fused)


def conv_abn_2d() -> nn.Module:
    """Convolutions, batch norms and invertible activations: what convert_inplace_abn makes
    in-place layers of (momentum None in the second)."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.LeakyReLU(0.1),
        nn.Conv2d(4, 5, 1, bias=False), nn.BatchNorm2d(5, momentum=None), nn.ELU(0.7),
    )


def in_place(model: nn.Module) -> nn.Module:
    done = NN.convert_inplace_abn(model)
    assert done.converted == ["1", "4"], done
    return done.module


@across_processes(2, 3)
def test_inplace_abn(rank: int, world: int) -> None:
    ours = train_against_full_batch(conv_abn_2d, [4, 3, 2][:world], (3, 4, 5), make_ours=in_place)
    assert isinstance(ours[1], NN.InPlaceABN) and int(ours[4].num_batches_tracked) == 3
    train_against_full_batch(conv_abn_2d, [5, 0, 3][:world], (3, 3, 3), make_ours=in_place, steps=2)  # an empty rank
    train_against_full_batch(conv_abn_2d, [3, 2, 4][:world], (3, 4, 4), make_ours=in_place, steps=2, memory_format=CL2)
    if world == 2:  # two levels: replicas inside the ranks, one process's replicas on an empty batch
        train_against_full_batch(conv_abn_2d, [5, 3], (3, 3, 4), replicas=2, make_ours=in_place, steps=2)
        train_against_full_batch(conv_abn_2d, [4, 0], (3, 2, 2), replicas=2, make_ours=in_place, steps=2)
        with deferred_checks():
            train_against_full_batch(conv_abn_2d, [4, 3], (3, 4, 5), make_ours=in_place, steps=2)
        frozen = lambda model: NN.freeze_batchnorm(in_place(model))  # noqa: E731
        model = train_against_full_batch(conv_abn_2d, [3, 2], (3, 3, 4), make_ours=frozen, ref_training=False, steps=2)
        with count_collectives() as counts:
            model(torch.randn(4, 3, 3, 3, dtype=torch.float64)).sum().backward()
        assert counts == {}, f"frozen in-place layers communicated: {counts}"


class ResidualBlock(nn.Module):
    """relu(bn(conv(x)) + x), unfused; :meth:`fused` gives our layer the add and the relu."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)

    def forward(self, x: Tensor) -> Tensor:
        if isinstance(self.bn, NN.SyncBatchNorm) and self.bn.activation == "relu":
            return self.bn(self.conv(x), x)
        return torch.relu(self.bn(self.conv(x)) + x)

    @staticmethod
    def fused(model: "ResidualBlock") -> nn.Module:
        model = NN.convert_sync_batchnorm(model)
        model.bn.activation = "relu"
        return model


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


@across_processes(4)
def test_subgroups(rank: int, world: int) -> None:
    group = NN.consecutive_rank_groups(2)
    # ranks 0, 1 and ranks 2, 3 each sync over their own global batch (another split)
    ours = train_against_full_batch(conv_bn_2d, [3, 2] if rank < 2 else [2, 4], (3, 3, 3), group=group)
    means = gather_all(ours[1].running_mean)
    assert torch.equal(means[0], means[1]) and torch.equal(means[2], means[3])
    assert not torch.allclose(means[0], means[2]), "the two groups synced with each other"
    first_two = dist.new_group([0, 1])  # every rank creates it; ranks 2 and 3 are not members
    layer = NN.SyncBatchNorm1d(3, process_group=first_two)
    if rank >= 2:
        expect_error_on_every_rank(lambda: layer(torch.randn(4, 3)), RuntimeError, "not a member")
    with pytest.raises(ValueError, match="must divide the world size 4"):
        NN.consecutive_rank_groups(3)


# --- torch.compile across ranks: the exchange as functional collectives in the graph -------------


class GraphRecorder:
    """A torch.compile backend (AOTAutograd, then the graphs run as traced) that keeps the text
    of every forward and backward graph it compiles."""

    def __init__(self) -> None:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        self.forward: list[str] = []
        self.backward: list[str] = []

        def keep(into: list[str]):
            def compiler(gm: torch.fx.GraphModule, example_inputs) -> Callable:
                into.append(str(gm.graph))
                return make_boxed_func(gm.forward)

            return compiler

        self.backend = aot_autograd(fw_compiler=keep(self.forward), bw_compiler=keep(self.backward))


def compile_fullgraph(backend: object = "aot_eager") -> Callable[[nn.Module], nn.Module]:
    return lambda model: torch.compile(model, fullgraph=True, dynamic=False, backend=backend)


@contextmanager
def no_recompiles() -> Iterator[None]:
    """A fresh compile cache, and an error where anything compiles a second time."""
    import torch._dynamo

    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield
    torch._dynamo.reset()


@across_processes(2, 3)
def test_compiled_fullgraph_equals_eager(rank: int, world: int) -> None:
    # DDP(torch.compile(model, fullgraph=True)): the whole model one graph, collectives inside
    recorder = GraphRecorder()
    with no_recompiles():
        train_against_full_batch(conv_bn_2d, [4, 3, 2][:world], (3, 4, 5), compiled=compile_fullgraph(recorder.backend))
    assert len(recorder.forward) == 1 and len(recorder.backward) == 1, (len(recorder.forward), len(recorder.backward))
    assert recorder.forward[0].count("_c10d_functional.all_gather_into_tensor.default") == 2  # one per layer
    assert recorder.backward[0].count("_c10d_functional.all_reduce.default") == 2
    with no_recompiles():  # an empty rank, 1d layers, channels_last
        train_against_full_batch(conv_bn_2d, [5, 0, 3][:world], (3, 3, 3), steps=2, compiled=compile_fullgraph())
    with no_recompiles():
        train_against_full_batch(linear_bn_1d, [3, 4, 2][:world], (6,), steps=2, compiled=compile_fullgraph())
    with no_recompiles():
        train_against_full_batch(conv_bn_2d, [3, 2, 4][:world], (3, 4, 4), steps=2, memory_format=CL2, compiled=compile_fullgraph())


@across_processes(2)
def test_compiled_with_inductor(rank: int, world: int) -> None:
    with no_recompiles():
        train_against_full_batch(conv_bn_2d, [4, 3], (3, 4, 5), compiled=compile_fullgraph("inductor"))


@across_processes(2)
def test_compiled_frozen_fused_and_options(rank: int, world: int) -> None:
    fuse = lambda model: NN.fuse_bn_act(NN.convert_sync_batchnorm(model))  # noqa: E731
    with no_recompiles():
        train_against_full_batch(conv_bn_2d, [4, 3], (3, 4, 5), make_ours=fuse, steps=2, compiled=compile_fullgraph())
    with no_recompiles():
        train_against_full_batch(ResidualBlock, [2, 3], (4, 3, 3), make_ours=ResidualBlock.fused, steps=2, compiled=compile_fullgraph())
    with no_recompiles():
        train_against_full_batch(
            conv_bn_2d, [4, 3], (3, 4, 5), make_ours=NN.freeze_batchnorm, ref_training=False, steps=2, compiled=compile_fullgraph()
        )
    with no_recompiles():
        train_against_full_batch(lambda: conv_bn_2d(affine=False), [3, 2], (3, 3, 3), steps=2, compiled=compile_fullgraph())


@across_processes(2)
def test_compiled_inplace_abn(rank: int, world: int) -> None:
    # the in-place layers meet in the graph too (TracedInPlaceABNFunction), an empty rank included
    with no_recompiles():
        train_against_full_batch(conv_abn_2d, [4, 3], (3, 4, 5), make_ours=in_place, compiled=compile_fullgraph())
    with no_recompiles():
        train_against_full_batch(conv_abn_2d, [5, 0], (3, 3, 3), make_ours=in_place, steps=2, compiled=compile_fullgraph())


@across_processes(2)
def test_compiled_ranks_judge_the_eager_rows(rank: int, world: int) -> None:
    # the traced path sends the eager path's row (functions.synchronization.distributed.stats_header): a rank at
    # another layer, or with another dtype, fails the device's check and updates nothing
    from syncbn.functions.synchronization import distributed, traced_ranks

    x = torch.randn(3, 4, dtype=torch.float64)
    row = traced_ranks._rank_row(x, "layer")
    header = distributed.stats_header(distributed.layer_key("layer"), 0, x.dtype, False, x.shape, 3)
    assert row[: distributed.HEADER_SIZE].tolist() == [float(v) for v in header]
    first, second = NN.SyncBatchNorm1d(4).double(), NN.SyncBatchNorm1d(4).double()
    first.layer_name, second.layer_name = "first", "second"
    layer = torch.compile(first if rank == 0 else second, fullgraph=True, backend="eager")
    with pytest.raises(RuntimeError, match="the ranks disagree on the layer or its dtype"):
        layer(x)
    assert int(first.num_batches_tracked) == int(second.num_batches_tracked) == 0
    torch._dynamo.reset()


@across_processes(4)
def test_compiled_subgroups(rank: int, world: int) -> None:
    group = NN.consecutive_rank_groups(2)
    with no_recompiles():
        ours = train_against_full_batch(conv_bn_2d, [3, 2] if rank < 2 else [2, 4], (3, 3, 3), group=group, steps=2, compiled=compile_fullgraph())
    means = gather_all(ours[1].running_mean)
    assert torch.equal(means[0], means[1]) and torch.equal(means[2], means[3]) and not torch.allclose(means[0], means[2])


class HeadedResidualNet(nn.Module):
    """Conv, BN, ReLU, a residual block, and a BatchNorm1d head: a model of the user's own (the
    compiler starts frames in it, not in torch.nn's containers)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU())
        self.block = ResidualBlock()
        self.head = nn.BatchNorm1d(4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(self.stem(x)).mean((2, 3)))


def graph_breaks(model: nn.Module, x: Tensor, steps: int = 2) -> int:
    """Graph breaks of ``steps`` training steps of ``torch.compile(model)``."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    for _ in range(steps):
        compiled(x).sum().backward()
    breaks = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    return breaks


@across_processes(2)
def test_compiled_ddp_adds_no_graph_break(rank: int, world: int) -> None:
    # torch.compile(DDP(model)): DDP's own breaks, and none of ours beyond them
    torch.manual_seed(0)
    theirs = HeadedResidualNet().double()
    ours = NN.convert_sync_batchnorm(copy.deepcopy(theirs))
    x = torch.randn(3 + rank, 3, 4, 4, dtype=torch.float64)
    torch_breaks = graph_breaks(DistributedDataParallel(theirs), x)
    assert torch_breaks > 0  # DDP's own
    assert graph_breaks(DistributedDataParallel(ours), x) == torch_breaks


@across_processes(2)
def test_compiled_replicas_inside_ranks_break_the_graph(rank: int, world: int) -> None:
    # two levels: replicas of one process meet eagerly, so there the layer is a graph break
    # (fullgraph refuses, at trace time: nothing waits for the other replica)
    import torch._dynamo

    from helpers import stock_replicas

    torch._dynamo.reset()
    replica = stock_replicas(NN.convert_sync_batchnorm(conv_bn_2d().double()), 2)[0]
    with pytest.raises(torch._dynamo.exc.Unsupported, match="disable"):
        torch.compile(replica, fullgraph=True, backend="aot_eager")(torch.randn(2, 3, 3, 3, dtype=torch.float64))
    torch._dynamo.reset()


# --- deferred checks (the default for CUDA tensors; testkit.paths.deferred_checks on the CPU) --------


def expect_deferred_error(run: Callable[[], object], error: type, *words: str) -> None:
    """``run`` and a read of the pending checks raise ``error`` with ``words`` on every rank,
    saying that the check was deferred (at the end of ``run``'s backward, or when read)."""
    with pytest.raises(error) as caught:
        run()
        checks.check_pending()
    for word in (*words, "deferred check"):
        assert word in str(caught.value), (word, str(caught.value))


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


@across_processes(2)
def test_deferred_errors_on_every_rank(rank: int, world: int) -> None:
    # the same mismatches as at once, raised later; meanwhile a failed exchange changes no
    # running statistics, as at once (its count is NaN on the device)
    with deferred_checks():
        for mismatch in MISMATCHES:
            mismatch(rank, expect_deferred_error)


def test_process_group_without_torch_distributed_raises() -> None:
    layer = NN.SyncBatchNorm1d(3, process_group=object())
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


def _ranks_without_the_compiled_module(rank: int, world: int) -> list:
    # ranks alone meet in the traced path's functional collectives, eagerly
    backend.NATIVE_ROUNDS = None  # this process only
    torch.manual_seed(0)
    full = torch.randn(7, 3, 4, 4, dtype=torch.float64)
    ours = NN.SyncBatchNorm2d(3).double()
    x = (full[:3] if rank == 0 else full[3:]).clone().requires_grad_()
    y = ours(x)
    (y * torch.arange(y.numel(), dtype=torch.float64).view_as(y)).sum().backward()
    return [y.detach(), x.grad, ours.running_mean, ours.running_var]


def test_ranks_without_the_compiled_module_meet_in_functional_collectives() -> None:
    torch.manual_seed(0)
    full = torch.randn(7, 3, 4, 4, dtype=torch.float64)
    ref = nn.BatchNorm2d(3).double()
    xr = full.clone().requires_grad_()
    y0 = ref(xr)
    yr = torch.cat([y0[:3], y0[3:]])
    weights = torch.cat([torch.arange(3 * 48, dtype=torch.float64).view(3, 3, 4, 4),
                         torch.arange(4 * 48, dtype=torch.float64).view(4, 3, 4, 4)])
    (yr * weights).sum().backward()
    results = run_local_group(_ranks_without_the_compiled_module, 2)
    torch.testing.assert_close(torch.cat([results[0][0], results[1][0]]), y0.detach(), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(torch.cat([results[0][1], results[1][1]]), xr.grad, atol=1e-10, rtol=1e-10)
    for rank in range(2):
        torch.testing.assert_close(results[rank][2], ref.running_mean, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(results[rank][3], ref.running_var, atol=1e-12, rtol=1e-12)
