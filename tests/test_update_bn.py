"""``NN.update_bn``: exact population statistics (against float64 references over the
concatenated data), every kind of batch norm and wrapper, the loaders' batch forms, state
restored (after an error too), and across Gloo ranks with uneven batches: one all_gather, the
same bits on every rank."""
from __future__ import annotations

import copy
import sys
import traceback
import types
from collections import namedtuple
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from syncbn import nn as NN
from syncbn.modules.parallel import ThreadedDataParallel
from syncbn.modules.population import _to
from testkit.collectives import count_collectives
from testkit.local_group import run_local_group
from helpers import randomize_affine

F64 = torch.float64
BN_KINDS: dict[str, Callable[[int], nn.Module]] = {
    "torch": nn.BatchNorm2d,
    "ours": NN.SyncBatchNorm2d,
    "torch_sync": nn.SyncBatchNorm,
    "ours_inplace": lambda c: NN.InPlaceABN(c, activation="identity"),
}


def batches(sizes: list[int], seed: int = 0, channels: int = 3) -> list[Tensor]:
    """float64 ``(n, C, 5, 4)`` batches whose means and scales differ widely from batch to batch,
    so that averaging per-batch variances is far from the population's variance."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, channels, 5, 4, generator=gen, dtype=F64) * (1 + i) + 4.0 * i - 3.0 for i, n in enumerate(sizes)]


def two_layer_net(bn: Callable[[int], nn.Module] = nn.BatchNorm2d, seed: int = 0) -> nn.Sequential:
    """conv -> BN -> ReLU -> conv -> BN, float64."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), bn(4), nn.ReLU(), nn.Conv2d(4, 5, 1), bn(5))
    return randomize_affine(net, seed).to(F64)


def reference_inputs(net: nn.Module, data: list[Tensor]) -> list[Tensor]:
    """Each batch norm's input over ``data``, concatenated, per torch's update_bn semantics: a
    float64 copy in training mode, each layer normalizing with its batch's statistics (in one
    process, ours are torch's there)."""
    plain = copy.deepcopy(net).train()  # one process: each kind is nn.BatchNorm* in training
    layers = [m for m in plain.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    seen: list[list[Tensor]] = [[] for _ in layers]
    for layer, inputs in zip(layers, seen):
        layer.register_forward_pre_hook(lambda module, args, inputs=inputs: inputs.append(args[0].detach().clone()))
    with torch.no_grad():
        for x in data:
            plain(x)
    return [torch.cat(inputs) for inputs in seen]


def population(x: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and unbiased variance per channel of ``(N, C, *)``."""
    dims = [0, *range(2, x.dim())]
    return x.mean(dims), x.var(dims, unbiased=True)


def bn_layers(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def assert_population(model: nn.Module, inputs: list[Tensor], calls: int, tol: float = 1e-12) -> None:
    for layer, x in zip(bn_layers(model), inputs):
        mean, var = population(x)
        torch.testing.assert_close(layer.running_mean, mean, atol=tol, rtol=tol)
        torch.testing.assert_close(layer.running_var, var, atol=tol, rtol=tol)
        assert int(layer.num_batches_tracked) == calls


# --- exactness ----------------------------------------------------------------------------------


def test_one_layer_is_exact_where_torchs_average_is_not() -> None:
    data = batches([4, 7, 2, 5])
    ours, torchs = nn.BatchNorm2d(3).to(F64), nn.BatchNorm2d(3).to(F64)
    NN.update_bn(data, ours)
    torch.optim.swa_utils.update_bn(data, torchs)
    assert_population(ours, [torch.cat(data)], calls=4)
    mean, var = population(torch.cat(data))
    # torch averages the batches' means (unweighted) and variances: far off for such batches
    assert (torchs.running_var - var).abs().min() > 1.0
    assert (torchs.running_mean - mean).abs().min() > 1e-2


@pytest.mark.parametrize("kind", list(BN_KINDS))
def test_two_layers_match_torchs_semantics_exactly(kind: str) -> None:
    net = two_layer_net(BN_KINDS[kind])
    data = batches([4, 7, 2, 5], seed=1)
    inputs = reference_inputs(net, data)
    NN.update_bn(data, net)
    assert_population(net, inputs, calls=4)
    torchs = two_layer_net(BN_KINDS[kind])
    torch.optim.swa_utils.update_bn(data, torchs)  # the per-batch average: visibly elsewhere
    assert not torch.allclose(bn_layers(torchs)[0].running_var, bn_layers(net)[0].running_var, rtol=1e-3)


def test_float32_layers_get_the_float64_population_rounded_once() -> None:
    data = [x.float() + 1e4 for x in batches([6, 3, 8])]  # means near 1e4, std 1 to 3
    layer = NN.BatchNorm2d(3)
    NN.update_bn(data, layer)
    mean, var = population(torch.cat(data).double())
    ulp = torch.finfo(torch.float32).eps * 1e4
    torch.testing.assert_close(layer.running_mean, mean.float(), rtol=0, atol=ulp)
    torch.testing.assert_close(layer.running_var.double(), var, rtol=1e-6, atol=0)


# --- wrappers, batch forms, progress --------------------------------------------------------------


@pytest.mark.parametrize("wrap", ["data_parallel", "threaded", "threaded_nested", "nested_wrappers"])
def test_wrapped_models_give_the_bare_models_bits(wrap: str) -> None:
    data = batches([6, 5, 7], seed=2)
    bare, net = two_layer_net(NN.SyncBatchNorm2d), two_layer_net(NN.SyncBatchNorm2d)
    wrapped = {
        "data_parallel": lambda: nn.DataParallel(net),
        "threaded": lambda: ThreadedDataParallel(net, ["cpu"] * 3),
        "threaded_nested": lambda: ThreadedDataParallel(nn.DataParallel(net), ["cpu"] * 2),
        "nested_wrappers": lambda: nn.DataParallel(ThreadedDataParallel(net, ["cpu"] * 2)),
    }[wrap]()
    NN.update_bn(data, bare)
    NN.update_bn(data, wrapped)
    for ours, expected in zip(bn_layers(net), bn_layers(bare)):
        assert torch.equal(ours.running_mean, expected.running_mean)
        assert torch.equal(ours.running_var, expected.running_var)
    assert wrapped.training and all(m.training for m in net.modules())


def test_a_wrapper_inside_the_model_merges_its_replicas_parts() -> None:
    # ThreadedDataParallel deeper in the model: its replicas' slices, merged under a lock
    data = batches([9, 7, 8], seed=3)
    model = nn.Sequential(nn.Identity(), ThreadedDataParallel(nn.Sequential(NN.BatchNorm2d(3)), ["cpu"] * 3)).to(F64)
    NN.update_bn(data, model)
    assert_population(model, [torch.cat(data)], calls=9)  # 3 replicas per batch


Pair = namedtuple("Pair", "inputs target")


class DictNet(nn.Module):
    """Takes a dict batch, as a loader of dicts gives it."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(3)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        return self.bn(batch["image"])


@pytest.mark.parametrize("form", ["tensor", "tuple", "list", "named_tuple", "dict"])
def test_batch_forms(form: str) -> None:
    data = batches([5, 3, 6], seed=4)
    labels = [torch.zeros(len(x)) for x in data]
    loader = {
        "tensor": data,
        "tuple": list(zip(data, labels)),
        "list": [[x, y] for x, y in zip(data, labels)],
        "named_tuple": [Pair(x, y) for x, y in zip(data, labels)],
        "dict": [{"image": x, "label": y} for x, y in zip(data, labels)],
    }[form]
    model = DictNet().to(F64) if form == "dict" else nn.BatchNorm2d(3).to(F64)
    NN.update_bn(loader, model, device="cpu")
    assert_population(model, [torch.cat(data)], calls=3)


def test_device_moves_tensors_in_containers() -> None:
    x = torch.ones(2, dtype=F64)
    moved = _to({"a": [x, (x, 1)], "b": Pair(x, "y")}, torch.device("meta"))
    assert moved["a"][0].is_meta and moved["a"][1][0].is_meta and moved["a"][1][1] == 1
    assert isinstance(moved["b"], Pair) and moved["b"].inputs.is_meta and moved["b"].target == "y"


def test_progress_bar_is_tqdms_where_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    data, wrapped = batches([3, 4]), []
    fake = types.ModuleType("tqdm")
    fake.tqdm = lambda loader, desc: wrapped.append(desc) or iter(loader)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tqdm", fake)
    NN.update_bn(data, nn.BatchNorm2d(3).to(F64), progress=True)
    assert wrapped == ["update_bn"]
    monkeypatch.setitem(sys.modules, "tqdm", None)  # not installed: no bar, same work
    layer = nn.BatchNorm2d(3).to(F64)
    NN.update_bn(data, layer, progress=True)
    assert_population(layer, [torch.cat(data)], calls=2)


# --- what is left alone, and restored -----------------------------------------------------------


def state_of(model: nn.Module) -> dict[str, Any]:
    """Everything update_bn must give back: flags, momenta, hooks, buffers (objects and values)."""
    return {
        "training": [m.training for m in model.modules()],
        "momentum": [m.momentum for m in bn_layers(model)],
        "tracks": [m.track_running_stats for m in bn_layers(model)],
        "hooks": [len(m._forward_pre_hooks) for m in model.modules()],
        "buffers": [(name, id(b), b.clone()) for name, b in model.named_buffers()],
    }


def assert_same_state(before: dict[str, Any], after: dict[str, Any], values: bool = True) -> None:
    for key in ("training", "momentum", "tracks", "hooks"):
        assert before[key] == after[key], key
    assert [(n, i) for n, i, _ in before["buffers"]] == [(n, i) for n, i, _ in after["buffers"]]
    if values:
        assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(before["buffers"], after["buffers"]))


def mixed_model() -> nn.Sequential:
    model = two_layer_net(NN.SyncBatchNorm2d)
    model[1].momentum, model[4].momentum = None, 0.3
    model.eval()
    model[2].train()  # a mixed set of flags comes back as it was
    return model


def test_flags_momentum_buffers_and_hooks_come_back() -> None:
    model = mixed_model()
    before = state_of(model)
    NN.update_bn(batches([3, 4], seed=5), model)
    assert_same_state(before, state_of(model), values=False)


def test_an_error_in_the_loader_changes_nothing() -> None:
    def failing_loader():
        yield from batches([3, 4], seed=6)
        raise OSError("disk gone")

    model = mixed_model()
    before = state_of(model)
    with pytest.raises(OSError, match="disk gone"):
        NN.update_bn(failing_loader(), model)
    assert_same_state(before, state_of(model))


def test_untracked_frozen_and_unreached_layers_keep_their_state() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.untracked = nn.BatchNorm2d(3, track_running_stats=False)
            self.frozen = NN.BatchNorm2d(3).freeze()
            self.used = NN.BatchNorm2d(3)
            self.unreached = NN.BatchNorm2d(3)  # an auxiliary head, say

        def forward(self, x: Tensor) -> Tensor:
            return self.used(self.frozen(self.untracked(x)))

    model = Net().to(F64)
    with torch.no_grad():
        for layer in (model.frozen, model.unreached):
            layer.running_mean.fill_(0.5), layer.running_var.fill_(2.0), layer.num_batches_tracked.fill_(7)
    data = batches([4, 5], seed=7)
    frozen, unreached = copy.deepcopy(model.frozen.state_dict()), copy.deepcopy(model.unreached.state_dict())
    NN.update_bn(data, model)
    for layer, expected in ((model.frozen, frozen), (model.unreached, unreached)):
        assert all(torch.equal(layer.state_dict()[k], v) for k, v in expected.items())
    assert model.untracked.running_mean is None and model.frozen.frozen
    # the frozen layer normalized with its running statistics, the untracked one with each batch's
    normalized = torch.cat([nn.functional.batch_norm(x, None, None, training=True) for x in data])
    assert_population(model.used, [(normalized - 0.5) / (2.0 + model.frozen.eps) ** 0.5], calls=2)


def test_an_empty_loader_changes_nothing() -> None:
    model = mixed_model()
    before = state_of(model)
    NN.update_bn([], model)
    assert_same_state(before, state_of(model))


def test_a_model_without_batch_norm_is_left_alone() -> None:
    model = nn.Linear(3, 2)
    NN.update_bn([torch.randn(2, 3)], model)  # as torch's: nothing to do, no pass


def test_an_uninitialized_lazy_layer_raises() -> None:
    with pytest.raises(ValueError, match="run the model once first"):
        NN.update_bn(batches([3]), nn.LazyBatchNorm2d())


def test_a_process_group_without_torch_distributed_raises() -> None:
    with pytest.raises(RuntimeError, match="update_bn: process_group is set but torch.distributed is not initialized"):
        NN.update_bn(batches([3]), nn.BatchNorm2d(3).to(F64), process_group=object())


# --- across ranks -----------------------------------------------------------------------------

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
