"""convert_sync_batchnorm and freeze_batchnorm leave no batch norm behind silently: every
``_BatchNorm`` they cannot make ours exactly is named (path and class) in one warning per call,
or with ``strict=True`` in a TypeError raised before the model changes."""
from __future__ import annotations

import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.ao.nn import quantized as nnq

from syncbn import nn as NN


class MyBN(nn.BatchNorm2d):
    """A user's batch norm with a behaviour of its own: a ReLU after normalizing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).clamp_min(0)


class MySyncBN(nn.SyncBatchNorm):
    """A subclass of torch's own synchronized layer: not one of ours either."""


class MyBNWithChild(MyBN):
    """A left-behind layer that holds batch norms of its own."""

    def __init__(self, num_features: int) -> None:
        super().__init__(num_features)
        self.extra = MyBN(num_features)
        self.plain = nn.BatchNorm2d(num_features)


def qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def model_with_my_bn() -> nn.Sequential:
    block = nn.Sequential(nn.Conv2d(3, 3, 1), MyBN(3), nn.ReLU())
    return nn.Sequential(OrderedDict(stem=nn.BatchNorm2d(3), block=block, head=nn.BatchNorm1d(3)))


def converting(function, module: nn.Module, **kwargs) -> tuple[nn.Module, list[str]]:
    """The result of ``function(module)`` and the messages of the warnings it gave (each checked
    to point at this file, the caller)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = function(module, **kwargs)
    assert all(w.filename == __file__ and issubclass(w.category, UserWarning) for w in caught), caught
    return result, [str(w.message) for w in caught]


def test_a_users_subclass_is_named_in_one_warning_and_the_rest_converted() -> None:
    model = model_with_my_bn()
    mine = model.block[1]
    converted, messages = converting(NN.convert_sync_batchnorm, model)
    assert len(messages) == 1, messages
    assert f"block.1: {qualified(MyBN)}" in messages[0]
    assert "not synchronized by syncbn" in messages[0] and "strict=True" in messages[0]
    assert "stem" not in messages[0] and "head" not in messages[0]
    assert type(converted.stem) is NN.SyncBatchNorm2d and type(converted.head) is NN.SyncBatchNorm1d
    assert converted.block[1] is mine  # left as it is, its behaviour kept
    assert (converted.block[1](torch.randn(4, 3, 2, 2)) >= 0).all()


def test_strict_raises_before_anything_changes() -> None:
    model = model_with_my_bn()
    before = [(name, layer, type(layer)) for name, layer in model.named_modules()]
    with pytest.raises(TypeError, match=r"would leave 1 .*block\.1: .*MyBN.*nothing was converted"):
        NN.convert_sync_batchnorm(model, strict=True, process_group=object())
    assert [(name, layer, type(layer)) for name, layer in model.named_modules()] == before
    with pytest.raises(TypeError, match="freeze_batchnorm"):
        NN.freeze_batchnorm(model, strict=True)
    assert [(name, layer, type(layer)) for name, layer in model.named_modules()] == before


def initialized_lazy() -> nn.Module:
    layer = nn.LazyBatchNorm2d()
    layer(torch.randn(2, 3, 2, 2))
    return layer


def test_only_convertible_layers_give_no_warning() -> None:
    lazy = initialized_lazy()
    assert type(lazy) is nn.BatchNorm2d  # a lazy layer becomes its plain class on first forward
    model = nn.Sequential(
        nn.BatchNorm1d(3), nn.BatchNorm2d(3), nn.BatchNorm3d(3), nn.SyncBatchNorm(3), lazy,
        NN.SyncBatchNorm2d(3), NN.InPlaceABN(3), nn.InstanceNorm2d(3), nn.GroupNorm(1, 3), nn.LayerNorm(3),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        converted = NN.convert_sync_batchnorm(model, strict=True)
        NN.freeze_batchnorm(NN.revert_sync_batchnorm(NN.convert_sync_batchnorm(model_with_torch_layers_only())))
    assert type(converted[4]) is NN.SyncBatchNorm2d and converted[4].weight is lazy.weight
    assert type(converted[7]) is nn.InstanceNorm2d  # a _NormBase, not a batch norm: not ours to judge


def model_with_torch_layers_only() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.ReLU())


OTHER_KINDS = {
    "subclass": lambda: MyBN(3), "sync-subclass": lambda: MySyncBN(3), "quantized": lambda: nnq.BatchNorm2d(3),
}


@pytest.mark.parametrize("kind", OTHER_KINDS)
def test_every_other_kind_of_batch_norm_is_reported(kind: str) -> None:
    layer = OTHER_KINDS[kind]()
    converted, messages = converting(NN.convert_sync_batchnorm, nn.Sequential(nn.Identity(), layer))
    assert converted[1] is layer and type(layer) is not NN.SyncBatchNorm
    assert len(messages) == 1 and f"1: {qualified(type(layer))}" in messages[0], messages


def test_a_lone_left_layer_is_the_module_itself() -> None:
    layer = MyBN(3)
    converted, messages = converting(NN.convert_sync_batchnorm, layer)
    assert converted is layer
    assert len(messages) == 1 and f"(the module itself): {qualified(MyBN)}" in messages[0], messages


def test_a_layer_held_twice_is_reported_once_with_both_paths() -> None:
    shared = MyBN(3)
    model = nn.Sequential(shared, nn.BatchNorm2d(3), shared)
    converted, messages = converting(NN.convert_sync_batchnorm, model)
    assert len(messages) == 1 and messages[0].count(qualified(MyBN)) == 1, messages
    assert f"0, 2: {qualified(MyBN)}" in messages[0] and "1 batch norm layer(s)" in messages[0]
    assert converted[0] is shared and converted[2] is shared and type(converted[1]) is NN.SyncBatchNorm2d


def test_layers_inside_a_left_layer_are_reported_with_their_paths() -> None:
    model = nn.Sequential(nn.Conv2d(3, 3, 1), MyBNWithChild(3))
    converted, messages = converting(NN.convert_sync_batchnorm, model)
    assert len(messages) == 1, messages
    assert f"1: {qualified(MyBNWithChild)}; 1.extra: {qualified(MyBN)}" in messages[0]
    assert "2 batch norm layer(s)" in messages[0] and "1.plain" not in messages[0]
    assert type(converted[1].plain) is NN.SyncBatchNorm2d  # a plain layer inside one left behind converts


def test_an_uninitialized_lazy_batch_norm_is_reported_and_converts_after_a_forward() -> None:
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.LazyBatchNorm2d())
    converted, messages = converting(NN.convert_sync_batchnorm, model)
    assert type(converted[1]) is nn.LazyBatchNorm2d
    assert len(messages) == 1, messages
    assert f"1: {qualified(nn.LazyBatchNorm2d)} (uninitialized: run one forward pass first)" in messages[0]
    with pytest.raises(TypeError, match="uninitialized"):
        NN.convert_sync_batchnorm(model, strict=True)
    model(torch.randn(2, 3, 2, 2))
    converted, messages = converting(NN.convert_sync_batchnorm, model)
    assert not messages and type(converted[1]) is NN.SyncBatchNorm2d and converted[1].num_features == 3


def test_freeze_says_what_it_leaves_unfrozen() -> None:
    frozen, messages = converting(NN.freeze_batchnorm, model_with_my_bn())
    assert len(messages) == 1, messages
    assert "freeze_batchnorm leaves 1" in messages[0] and "neither frozen nor synchronized" in messages[0]
    assert f"block.1: {qualified(MyBN)}" in messages[0]
    assert frozen.stem.frozen and frozen.head.frozen and type(frozen.block[1]) is MyBN


def test_revert_says_nothing_of_layers_it_does_not_know() -> None:
    model, _ = converting(NN.convert_sync_batchnorm, model_with_my_bn())
    reverted, messages = converting(NN.revert_sync_batchnorm, model)
    assert not messages and type(reverted.stem) is nn.BatchNorm2d and type(reverted.block[1]) is MyBN


@pytest.mark.parametrize("kind", ["subclass", "lazy", "quantized"])
def test_torchs_converter_drops_what_ours_keeps(kind: str) -> None:
    make = {**OTHER_KINDS, "lazy": nn.LazyBatchNorm2d}[kind]
    theirs = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Identity(), make()))
    assert type(theirs[1]) is nn.SyncBatchNorm  # the layer's own class and behaviour are gone
    layer = make()
    ours, messages = converting(NN.convert_sync_batchnorm, nn.Sequential(nn.Identity(), layer))
    assert ours[1] is layer and len(messages) == 1
