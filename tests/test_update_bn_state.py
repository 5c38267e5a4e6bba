"""What ``NN.update_bn`` leaves alone and gives back: training flags, momenta, buffers and hooks
(after an error in the loader too), the state of untracked, frozen and unreached layers; an empty
loader, a model without batch norm, and the errors of an uninitialized lazy layer and of a process
group without torch.distributed."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from syncbn import nn as NN
from testkit.update_bn_cases import F64, assert_population, batches, bn_layers, two_layer_net


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
