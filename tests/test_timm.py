"""timm's batch norm + activation layers converted to ours and back (modules/timm_layers.py), with
the real timm: each layer exactly (tensors, drop, act, state_dict keys, outputs, gradients,
running statistics), timm models converted under thread replicas and DDP against the unconverted
model on the whole batch, and timm's norm_layer factory. Skipped where timm is not installed."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

timm = pytest.importorskip("timm")
norm_act = pytest.importorskip("timm.layers.norm_act")

from syncbn import nn as NN  # noqa: E402
from syncbn.parallel import ThreadedDataParallel  # noqa: E402
from testkit.local_group import run_local_group  # noqa: E402
from testkit.lockstep import Perturbed, assert_within_spread, rounding_spread, train_side_by_side  # noqa: E402

F64 = torch.float64
TOL = dict(atol=1e-10, rtol=1e-10)
# Whole models in float64: batch norms over 5 samples (1x1 at the end of EfficientNet) amplify
# rounding, so that a 1e-15 relative change of the input moves timm's own input gradient by up to
# 5e-7 in two steps. Each quantity of ours must stay within SPREAD_FACTOR times what that change
# moves it by in timm's model (testkit.lockstep.rounding_spread), measured on the same batches.
SPREAD_FACTOR, SPREAD_FLOOR = 20.0, 1e-12
ACTIVATIONS = {
    "relu": dict(act_layer=nn.ReLU),  # fused
    "leaky_relu": dict(act_layer=nn.LeakyReLU, act_kwargs={"negative_slope": 0.2}),  # fused
    "silu": dict(act_layer=nn.SiLU),  # applied after
    "none": dict(apply_act=False),
    "dropout_relu": dict(act_layer=nn.ReLU, drop_layer=functools.partial(nn.Dropout, 0.0)),  # not fused: a drop first
}
# architectures of BatchNormAct2d (efficientnet, regnet, mobilenetv3) and of plain BatchNorm2d (resnet)
MODELS = ["efficientnet_b0", "regnetx_002", "mobilenetv3_small_050", "resnet18"]


def timm_layer(kind: str, act: str, channels: int = 4) -> nn.Module:
    torch.manual_seed(0)
    if kind == "frozen":
        layer = norm_act.FrozenBatchNormAct2d(channels, **ACTIVATIONS[act])
    else:
        layer = norm_act.BatchNormAct2d(channels, **ACTIVATIONS[act])
        if kind == "sync":
            layer = norm_act.convert_sync_batchnorm(nn.Sequential(layer))[0]
    for tensor in [layer.weight, layer.bias, layer.running_mean]:
        tensor.data.copy_(torch.randn(channels))
    layer.running_var.data.copy_(torch.rand(channels) + 0.5)
    return layer.to(F64)


def step(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(torch.linspace(-1, 1, y.numel(), dtype=F64).reshape(y.shape))
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    return (y.detach(), x.grad, *grads)


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("kind", ["plain", "sync", "frozen"])
def test_a_timm_layer_converts_exactly_and_reverts(kind, act) -> None:
    layer = timm_layer(kind, act)
    reference = copy.deepcopy(layer)
    tensors = dict(layer.state_dict(keep_vars=True))
    ours = NN.convert_sync_batchnorm(layer, strict=True)
    assert type(ours) is NN.SyncBatchNormAct2d and ours.frozen == (kind == "frozen")
    assert ours.drop is layer.drop and ours.act is layer.act
    assert ours.activation == ({"relu": "relu", "leaky_relu": "leaky_relu"}.get(act))
    assert list(ours.state_dict()) == list(reference.state_dict())
    assert all(ours.state_dict(keep_vars=True)[key] is tensor for key, tensor in tensors.items())
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in reference.named_parameters()]
    assert [n for n, _ in ours.named_buffers()] == [n for n, _ in reference.named_buffers()]
    for training in (True, True, False):
        ours.train(training), reference.train(training)
        x = torch.randn(5, 4, 3, 3, dtype=F64) * 2 + 1
        for got, want in zip(step(ours, x), step(reference, x), strict=True):
            torch.testing.assert_close(got, want, **TOL)
        for (name, got), want in zip(ours.state_dict().items(), reference.state_dict().values()):
            torch.testing.assert_close(got, want, **TOL, msg=name)
    back = NN.revert_sync_batchnorm(ours)
    assert type(back) is type(reference) and back.drop is layer.drop and back.act is layer.act
    assert all(back.state_dict(keep_vars=True)[key] is tensor for key, tensor in tensors.items())


def test_a_state_dict_loads_across_timm_and_ours() -> None:
    for kind in ("plain", "frozen"):
        theirs, ours = timm_layer(kind, "relu"), NN.convert_sync_batchnorm(timm_layer(kind, "silu"))
        ours.load_state_dict(theirs.state_dict(), strict=True)
        theirs.load_state_dict(ours.state_dict(), strict=True)


def test_freezing_a_timm_model_then_reverting_says_what_timm_cannot_express() -> None:
    frozen = NN.freeze_batchnorm(nn.Sequential(timm_layer("plain", "relu")), strict=True)
    assert type(frozen[0]) is NN.SyncBatchNormAct2d and frozen[0].frozen
    with pytest.raises(ValueError, match=r"SyncBatchNormAct2d\(4\) '0' is frozen, which timm's BatchNormAct2d cannot"):
        NN.revert_sync_batchnorm(frozen)


def our_norm_act(num_features: int, **kwargs) -> NN.SyncBatchNormAct2d:
    """timm's norm_layer as a function (timm resolves a class by its name, a function as it is)."""
    return NN.SyncBatchNormAct2d(num_features, act_layer=nn.SiLU, **kwargs)


def test_timms_norm_layer_takes_a_function_that_builds_ours() -> None:
    torch.manual_seed(0)
    theirs = timm.create_model("efficientnet_b0", num_classes=5).to(F64)
    ours = timm.create_model("efficientnet_b0", num_classes=5, norm_layer=our_norm_act).to(F64)
    kinds = {type(m) for m in ours.modules()}
    assert NN.SyncBatchNormAct2d in kinds and norm_act.BatchNormAct2d not in kinds
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(3, 3, 32, 32, dtype=F64)
    for training in (True, False):
        theirs.train(training), ours.train(training)
        torch.testing.assert_close(ours(x), theirs(x), **TOL)


def timm_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, num_classes=5, drop_rate=0.0, drop_path_rate=0.0).to(F64)


def batches_and_spread(name: str) -> tuple[list[torch.Tensor], dict]:
    """Two batches of 5 (the global generator left where the compared run starts, so its upstream
    gradients are those of the spread's run) and timm's model's sensitivity to rounding on them."""
    theirs, twin = timm_model(name), timm_model(name)
    torch.manual_seed(1)
    batches = [torch.randn(5, 3, 32, 32, dtype=F64) for _ in range(2)]
    spread = rounding_spread(train_side_by_side(theirs, twin, lambda step: [batches[step]], len(batches),
                                                runner=Perturbed(twin), lr=0.05))
    torch.manual_seed(1)
    return [torch.randn(5, 3, 32, 32, dtype=F64) for _ in range(2)], spread


@pytest.mark.parametrize("name", MODELS)
def test_a_converted_timm_model_under_thread_replicas_equals_timms_on_the_whole_batch(name) -> None:
    theirs = timm_model(name)
    converted = NN.convert_sync_batchnorm(copy.deepcopy(theirs), strict=True)
    assert not any(isinstance(m, (norm_act.BatchNormAct2d, nn.BatchNorm2d)) and not isinstance(m, NN.SyncBatchNorm)
                   for m in converted.modules())
    batches, spread = batches_and_spread(name)  # 3 + 2 rows a replica
    steps = train_side_by_side(theirs, converted, lambda step: [batches[step]], len(batches),
                               runner=ThreadedDataParallel(converted, ["cpu"] * 2), lr=0.05)
    assert_within_spread(steps, spread, SPREAD_FACTOR, SPREAD_FLOOR)
    back = NN.revert_sync_batchnorm(converted)
    assert [type(m) for m in back.modules()] == [type(m) for m in theirs.modules()]


def ddp_rank(rank: int, world_size: int, name: str) -> None:
    """This rank's rows of each batch (uneven: 3 and 2) through DDP, against timm's model on the
    whole batch (testkit.lockstep: outputs, input and parameter gradients, buffers, SGD steps)."""
    theirs = timm_model(name)
    ours = NN.convert_sync_batchnorm(copy.deepcopy(theirs), strict=True)
    batches, spread = batches_and_spread(name)
    steps = train_side_by_side(theirs, ours, lambda step: [batches[step]], len(batches), runner=DistributedDataParallel(ours),
                               rows=[slice(0, 3), slice(3, 5)][rank], lr=0.05, averaged_over=world_size)
    assert_within_spread(steps, spread, SPREAD_FACTOR, SPREAD_FLOOR)


@pytest.mark.parametrize("name", ["efficientnet_b0"])
def test_a_converted_timm_model_under_ddp_equals_timms_on_the_whole_batch(name) -> None:
    run_local_group(ddp_rank, 2, name, timeout_s=60)
