"""``NN.update_bn`` gives exact population statistics (against float64 references over the
concatenated data, where torch's per-batch average does not), for every kind of batch norm, under
every wrapper, for each form a loader's batches take, with or without a progress bar."""
from __future__ import annotations

import copy
import sys
import types
from collections import namedtuple
from typing import Callable

import pytest
import torch
from torch import Tensor, nn

from syncbn import nn as NN
from syncbn.modules.parallel import ThreadedDataParallel
from syncbn.modules.population import _to
from testkit.update_bn_cases import F64, assert_population, batches, bn_layers, population, two_layer_net


BN_KINDS: dict[str, Callable[[int], nn.Module]] = {
    "torch": nn.BatchNorm2d,
    "ours": NN.SyncBatchNorm2d,
    "torch_sync": nn.SyncBatchNorm,
    "ours_inplace": lambda c: NN.InPlaceABN(c, activation="identity"),
}


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
