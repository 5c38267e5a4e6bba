"""Training across processes (real processes on loopback, Gloo, CPU), side by side with
nn.BatchNorm* on the global batch (testkit.ddp_lockstep): 1d, 2d and 3d layers in both layouts
under DDP, uneven, empty and one-sample ranks, the layer's options, eval without running statistics,
DDP's buffer broadcast, the collectives of a step, replicas inside ranks (two levels), frozen,
fused and in-place activated layers, and subgroups. Each behaviour runs on every rank, in one set of
processes per world size (testkit.process_sets)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from syncbn import nn as NN
from syncbn.modules.parallel import ThreadedDataParallel
from testkit.collectives import count_collectives
from testkit.ddp_lockstep import (
    CL2, CL3, ResidualBlock, assert_identical_on_all_ranks, bn_1d_ncl, conv_abn_2d, conv_bn_2d, conv_bn_3d,
    expect_error_on_every_rank, gather_all, global_batch, in_place, linear_bn_1d, rank_slice, train_against_full_batch,
)
from testkit.paths import deferred_checks
from testkit.process_sets import across_processes, process_sets  # noqa: F401 - the fixture of the tests it makes
from helpers import randomize_affine


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
