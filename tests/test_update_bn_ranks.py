"""``NN.update_bn`` across Gloo ranks with uneven batches (one rank with none): the bits of one
process over all batches, bare and under DDP, with one all_gather per call; a subgroup counts its
ranks only; a rank whose loader fails makes every rank raise and changes nothing."""
from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from syncbn import nn as NN
from testkit.collectives import count_collectives
from testkit.local_group import run_local_group
from testkit.update_bn_cases import F64, batches, bn_layers
from helpers import randomize_affine


RANK_BATCHES = {2: [[5, 3, 4], []], 3: [[4, 6], [], [3, 5, 2, 4]]}
"""Batch sizes per rank: uneven, one rank with none."""


def rank_data(world: int, rank: int) -> list[Tensor]:
    """Rank ``rank``'s batches, cut from one sequence of batches that the ranks share in order."""
    sizes = RANK_BATCHES[world]
    everything = batches([n for ranks in sizes for n in ranks], seed=8)
    start = sum(len(s) for s in sizes[:rank])
    return everything[start : start + len(sizes[rank])]


def mixed_kinds_net(torch_sync: bool = True) -> nn.Sequential:
    """Our layer, torch's SyncBatchNorm (which refuses CPU input in training with a group; DDP
    refuses it on the CPU: ``torch_sync=False`` puts torch's BatchNorm2d there, the same math),
    torch's BatchNorm2d and our layer without running statistics, none of which may meet the
    other ranks per batch."""
    torch.manual_seed(0)
    middle = nn.SyncBatchNorm(4) if torch_sync else nn.BatchNorm2d(4)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), NN.SyncBatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1), middle, nn.Conv2d(4, 2, 1), nn.BatchNorm2d(2),
        NN.SyncBatchNorm2d(2, track_running_stats=False),  # syncs in training: must not, and is not recomputed
    )
    return randomize_affine(net).to(F64)


def buffers_of(model: nn.Module) -> list[Tensor]:
    return [b.clone() for layer in bn_layers(model) if layer.track_running_stats
            for b in (layer.running_mean, layer.running_var, layer.num_batches_tracked)]


def run_ranks(rank: int, world: int) -> dict[str, Any]:
    """On every rank: update_bn over this rank's batches, bare and under DDP (collectives
    counted), in a subgroup of ranks 0 and the last, and with a loader that fails on rank 1."""
    out: dict[str, Any] = {}
    data = rank_data(world, rank)
    model = mixed_kinds_net()
    with count_collectives() as counts:
        NN.update_bn(data, model)
    out["bare"], out["counts"] = buffers_of(model), counts
    ddp = DistributedDataParallel(mixed_kinds_net(torch_sync=False), broadcast_buffers=True)
    NN.update_bn(data, ddp)
    out["ddp"], out["ddp_training"] = buffers_of(ddp.module), [m.training for m in ddp.modules()]
    members = [0, world - 1]
    group = dist.new_group(members)
    if rank in members:
        model = mixed_kinds_net()
        NN.update_bn(data, model, process_group=group)
        out["subgroup"] = buffers_of(model)

    def loader():
        yield from data
        if rank == 1:
            raise OSError("rank 1's disk gone")

    model = mixed_kinds_net()
    before = buffers_of(model)
    try:
        NN.update_bn(loader(), model)
        out["failure"] = None
    except Exception as error:  # noqa: BLE001 - reported to the test
        out["failure"] = f"{type(error).__name__}: {error}" if not isinstance(error, AssertionError) else traceback.format_exc()
    out["unchanged_after_failure"] = all(torch.equal(a, b) for a, b in zip(before, buffers_of(model))) if rank == 1 else None
    return out


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    return request.param, run_local_group(run_ranks, request.param, timeout_s=30)


def single_process(data: list[Tensor]) -> list[Tensor]:
    model = mixed_kinds_net()
    NN.update_bn(data, model)
    return buffers_of(model)


def test_ranks_get_the_same_bits_as_one_process_over_all_batches(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    world, outs = ranks
    expected = single_process([x for rank in range(world) for x in rank_data(world, rank)])
    for key in ("bare", "ddp"):
        for out in outs:
            assert all(torch.equal(a, b) for a, b in zip(out[key], outs[0][key])), f"{key}: ranks differ"
        for a, b in zip(outs[0][key], expected):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert all(all(flags) for flags in (out["ddp_training"] for out in outs))


def test_one_all_gather_per_call(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    world, outs = ranks
    channels = 4 + 4 + 2
    row = 3 + 3 * 2 + 2 * channels  # header, then (count, calls, mean, M2) per layer
    for out in outs:
        gathers = {name: sizes for name, sizes in out["counts"].items()}
        assert gathers in ({"all_gather_into_tensor": [row]}, {"all_gather_single": [row]}), gathers


def test_a_subgroup_counts_its_ranks_only(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    world, outs = ranks
    members = [0, world - 1]
    expected = single_process([x for rank in members for x in rank_data(world, rank)])
    assert all(torch.equal(a, b) for a, b in zip(outs[0]["subgroup"], outs[-1]["subgroup"]))
    for a, b in zip(outs[0]["subgroup"], expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_rank_that_fails_makes_every_rank_raise(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    world, outs = ranks
    assert outs[1]["failure"] == "OSError: rank 1's disk gone"
    assert outs[1]["unchanged_after_failure"]
    for rank in {0, world - 1} - {1}:
        expected = "RuntimeError: update_bn: rank(s) [1] of the process group failed during their pass over the data"
        assert outs[rank]["failure"] == expected
