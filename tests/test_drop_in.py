"""Our layers where code asks for torch's batch norm: ``isinstance(m, nn.BatchNorm2d)`` holds for
ours of the same dimension, and what then treats them as torch's gives torch's result or refuses
naming what it would lose: the idioms of training scripts (every batch norm in eval, no weight decay
on them), our converter (never twice), torch's ``convert_sync_batchnorm``,
``torch.func.replace_all_batch_norm_modules_``, ``torch.ao.quantization.fuse_modules``,
``torch.nn.utils.fusion``, ``torch.fx``'s fusion, and TorchScript (eval: equal to eager; training:
refused, saying what works). Float64 throughout, side by side with torch's layers."""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.fx.experimental.optimization as fx_optimization
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval

from helpers import SmallResNet, randomize_affine
from syncbn import nn as NN

TORCH_CLASS = {NN.SyncBatchNorm1d: nn.BatchNorm1d, NN.SyncBatchNorm2d: nn.BatchNorm2d, NN.SyncBatchNorm3d: nn.BatchNorm3d}
INPUT_SHAPES = {1: (5, 4, 3), 2: (5, 4, 3, 3), 3: (5, 4, 2, 3, 2)}


def pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """A ResNet-style net of torch's layers (affine and running statistics drawn) and its conversion."""
    torch.manual_seed(seed)
    theirs = randomize_affine(SmallResNet()).double()
    for layer in theirs.modules():
        if isinstance(layer, nn.modules.batchnorm._BatchNorm):
            layer.running_mean.uniform_(-1, 1), layer.running_var.uniform_(0.5, 2)
    return theirs, NN.convert_sync_batchnorm(copy.deepcopy(theirs))


def drawn(layer: nn.Module) -> nn.Module:
    """``layer`` in float64 with its weight, bias and running statistics drawn."""
    layer = layer.double()
    with torch.no_grad():
        for name in ("weight", "bias", "running_mean"):
            if getattr(layer, name, None) is not None:
                getattr(layer, name).uniform_(-1, 1)
        if layer.running_var is not None:
            layer.running_var.uniform_(0.5, 2)
    return layer


@pytest.mark.parametrize("ours, theirs", list(TORCH_CLASS.items()))
def test_each_layer_is_an_instance_of_torchs_class_of_its_dimension(ours: type, theirs: type) -> None:
    layer = ours(4)
    assert isinstance(layer, theirs) and isinstance(layer, NN.SyncBatchNorm)
    assert not any(isinstance(layer, other) for other in TORCH_CLASS.values() if other is not theirs)
    assert isinstance(NN.convert_sync_batchnorm(theirs(4)), theirs)
    assert isinstance(NN.freeze_batchnorm(theirs(4)), theirs)


def test_the_layers_of_any_rank_are_no_dimensions_batch_norm() -> None:
    """SyncBatchNorm (any rank, as torch's nn.SyncBatchNorm), ABN and InPlaceABN (any rank, with an
    activation in the layer, as inplace_abn's) are batch norms (_BatchNorm) of no dimension; none is
    torch's nn.SyncBatchNorm, whose class DDP refuses on the CPU."""
    for layer in (NN.SyncBatchNorm(4), NN.ABN(4), NN.InPlaceABN(4)):
        assert isinstance(layer, nn.modules.batchnorm._BatchNorm)
        assert not isinstance(layer, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm))
    assert isinstance(NN.SyncBatchNormAct2d(4), nn.BatchNorm2d)  # as timm's BatchNormAct2d


def test_every_batch_norm_in_eval_by_isinstance_keeps_our_statistics_still() -> None:
    theirs, ours = pair()
    for model in (theirs, ours):
        model.train()
        for layer in model.modules():
            if isinstance(layer, (nn.BatchNorm1d, nn.BatchNorm2d)):
                layer.eval()
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    x = torch.randn(6, 3, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-12, atol=1e-12)
    for key, value in ours.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_no_weight_decay_on_batch_norms_by_isinstance_finds_ours() -> None:
    def decayed(model: nn.Module) -> list[str]:
        skip = {id(p) for m in model.modules() if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)) for p in m.parameters()}
        return [name for name, p in model.named_parameters() if id(p) not in skip]

    theirs, ours = pair()
    assert decayed(ours) == decayed(theirs) == ["stem.weight", "blocks.0.conv1.weight", "blocks.0.conv2.weight",
                                                "blocks.1.conv1.weight", "blocks.1.conv2.weight", "head.weight", "head.bias"]


def test_our_converter_never_converts_a_layer_of_ours_again(recwarn: pytest.WarningsRecorder) -> None:
    _, ours = pair()
    layers = [m for m in ours.modules() if isinstance(m, NN.SyncBatchNorm)]
    again = NN.convert_sync_batchnorm(ours, strict=True)
    assert again is ours and [m for m in again.modules() if isinstance(m, NN.SyncBatchNorm)] == layers
    frozen = NN.freeze_batchnorm(ours, strict=True)
    assert [m for m in frozen.modules() if isinstance(m, NN.SyncBatchNorm)] == layers and all(m.frozen for m in layers)
    fused = NN.BatchNorm2d(4, activation="relu")
    assert NN.convert_sync_batchnorm(fused) is fused and NN.fuse_bn_act(fused) is fused
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


def test_state_dicts_load_both_ways_with_torchs_keys() -> None:
    theirs, ours = pair()
    assert list(ours.state_dict()) == list(theirs.state_dict())
    fresh_theirs, fresh_ours = pair(seed=1)
    fresh_theirs.load_state_dict(ours.state_dict()), fresh_ours.load_state_dict(theirs.state_dict())
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    for model in (theirs, ours, fresh_theirs, fresh_ours):
        model.eval()
    torch.testing.assert_close(fresh_ours(x), theirs(x), rtol=0, atol=0)
    torch.testing.assert_close(fresh_theirs(x), ours(x), rtol=0, atol=0)


def test_torchs_convert_sync_batchnorm_gives_torchs_layer_with_the_same_state() -> None:
    theirs, ours = pair()
    converted = torch.nn.SyncBatchNorm.convert_sync_batchnorm(ours)
    layers = [m for m in converted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert layers and all(type(m) is nn.SyncBatchNorm for m in layers)
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(converted.eval()(x), theirs.eval()(x), rtol=0, atol=0)


@pytest.mark.parametrize("make, lost", [
    (lambda: NN.BatchNorm2d(4, activation="relu"), "has the activation 'relu'"),
    (lambda: NN.BatchNorm1d(4, frozen=True), "is frozen"),
    (lambda: NN.ABN(4), "has the activation 'leaky_relu'"),
    (lambda: NN.InPlaceABN(4, activation="identity"), "has the activation 'identity'"),
    (lambda: NN.SyncBatchNormAct2d(4, act_layer=nn.SiLU), "applies Identity and SiLU"),
])
def test_torchs_convert_sync_batchnorm_refuses_a_layer_of_ours_that_computes_more(make, lost: str) -> None:
    layer = make()
    with pytest.raises(TypeError, match=f"{type(layer).__name__}\\(4\\) {lost}, which torch's nn.SyncBatchNorm.convert_sync_batchnorm would drop"):
        torch.nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(layer))


def test_qconfig_is_an_ordinary_attribute_elsewhere() -> None:
    layer = NN.BatchNorm2d(4, activation="relu")
    assert not hasattr(layer, "qconfig") and getattr(layer, "qconfig", None) is None
    layer.qconfig = "set"
    assert layer.qconfig == "set" and copy.deepcopy(layer).qconfig == "set"
    del layer.qconfig
    assert not hasattr(layer, "qconfig")


def test_func_replace_all_batch_norm_modules_makes_ours_what_it_makes_torchs() -> None:
    theirs, ours = pair()
    for model in (theirs, ours):
        torch.func.replace_all_batch_norm_modules_(model)
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    for mode in (True, False):
        torch.testing.assert_close(ours.train(mode)(x), theirs.train(mode)(x), rtol=1e-12, atol=1e-12)
    assert all(m.running_mean is None for m in ours.modules() if isinstance(m, NN.SyncBatchNorm))
    frozen = torch.func.replace_all_batch_norm_modules_(nn.Sequential(NN.BatchNorm2d(4, frozen=True).double()))
    with pytest.raises(ValueError, match=r"SyncBatchNorm2d\(4\): frozen without running statistics"):
        frozen(x[:, :1].expand(4, 4, 8, 8))


def test_quantizations_fuse_modules_refuses_ours_by_class_and_takes_them_reverted() -> None:
    model = nn.Sequential(nn.Conv2d(4, 4, 3), NN.BatchNorm2d(4), nn.ReLU()).double().eval()
    with pytest.raises(AssertionError, match="SyncBatchNorm2d"):
        torch.ao.quantization.fuse_modules(copy.deepcopy(model), [["0", "1", "2"]])
    fused = torch.ao.quantization.fuse_modules(NN.revert_sync_batchnorm(copy.deepcopy(model)), [["0", "1", "2"]])
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    torch.testing.assert_close(fused(x), model(x), rtol=1e-12, atol=1e-12)


def test_torchs_conv_bn_folding_on_ours_equals_the_unfolded_model() -> None:
    theirs, ours = pair()
    ours.eval(), theirs.eval()
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    folded = fuse_conv_bn_eval(ours.stem, ours.bn)
    torch.testing.assert_close(folded(x), ours.bn(ours.stem(x)), rtol=1e-12, atol=1e-12)
    optimized = fx_optimization.fuse(copy.deepcopy(ours))  # by exact class: ours are left as they are
    torch.testing.assert_close(optimized(x), theirs(x), rtol=1e-12, atol=1e-12)


KINDS = {
    "1d": (lambda: NN.BatchNorm1d(4), (5, 4, 3)),
    "2d": (lambda: NN.BatchNorm2d(4), (5, 4, 3, 3)),
    "3d": (lambda: NN.BatchNorm3d(4), (5, 4, 2, 3, 2)),
    "any rank": (lambda: NN.SyncBatchNorm(4), (5, 4, 3)),
    "relu + residual": (lambda: NN.BatchNorm2d(4, activation="relu"), (5, 4, 3, 3)),
    "leaky_relu": (lambda: NN.BatchNorm2d(4, activation="leaky_relu", negative_slope=0.2), (5, 4, 3, 3)),
    "no running stats": (lambda: NN.BatchNorm2d(4, track_running_stats=False), (5, 4, 3, 3)),
    "no affine": (lambda: NN.BatchNorm2d(4, affine=False), (5, 4, 3, 3)),
    "ABN elu": (lambda: NN.ABN(4, activation="elu", activation_param=0.5), (5, 4, 3, 3)),
    "ABN relu": (lambda: NN.ABN(4, activation="relu"), (5, 4, 3)),
    "InPlaceABN leaky_relu": (lambda: NN.InPlaceABN(4, activation_param=0.3), (5, 4, 3, 3)),
    "InPlaceABN elu": (lambda: NN.InPlaceABN(4, activation="elu"), (5, 4, 3, 3)),
    "InPlaceABN identity, no affine": (lambda: NN.InPlaceABN(4, affine=False, activation="identity"), (5, 4, 3)),
    "timm act fused": (lambda: NN.SyncBatchNormAct2d(4), (5, 4, 3, 3)),
    "timm act not fused": (lambda: NN.SyncBatchNormAct2d(4, act_layer=nn.SiLU), (5, 4, 3, 3)),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_script_in_eval_equals_eager(kind: str) -> None:
    make, shape = KINDS[kind]
    torch.manual_seed(0)
    layer = drawn(make()).eval()
    scripted = torch.jit.script(layer)
    x = torch.randn(shape, dtype=torch.float64)
    z = torch.randn(shape, dtype=torch.float64) if kind == "relu + residual" else None
    args = (x,) if z is None else (x, z)
    expected = layer(*(a.clone() for a in args))
    # to float64 rounding: eager may take our kernels (compiled or reference), the script torch's batch norm
    torch.testing.assert_close(scripted(*(a.clone() for a in args)), expected, rtol=1e-12, atol=1e-12)
    if isinstance(layer, NN.InPlaceABN):
        given = x.clone()
        assert scripted(given) is given  # in place, as the eager layer


def test_script_of_a_resnet_with_fused_and_frozen_layers_saves_loads_and_equals_eager() -> None:
    theirs, ours = pair()
    for block in ours.blocks:
        block.bn1.activation = "relu"  # fused; the block's own ReLU after it changes nothing
    ours.bn_head.freeze()
    ours.eval()
    ours.bn_head.train()  # a frozen layer in training scripts too: its statistics are fixed
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(ours), buffer)
    loaded = torch.jit.load(io.BytesIO(buffer.getvalue()))
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(loaded(x), ours(x), rtol=0, atol=0)
    torch.testing.assert_close(loaded(x), theirs.eval()(x), rtol=1e-12, atol=1e-12)
    assert all(type(m) is not nn.BatchNorm2d for m in ours.modules())  # scripting left our model as it was


def test_script_of_a_training_layer_is_refused_saying_what_works() -> None:
    _, ours = pair()
    with pytest.raises(RuntimeError, match=r"SyncBatchNorm2d\(8\) 'bn': torch.jit.script of a batch norm in training mode.*"
                                           r"model.eval\(\).*torch.compile"):
        torch.jit.script(ours.train())
    scripted = torch.jit.script(ours.eval())
    scripted.train()
    with pytest.raises(torch.jit.Error, match="runs in eval mode"):
        scripted(torch.randn(2, 3, 8, 8, dtype=torch.float64))


def test_script_checks_the_input_rank_as_torchs_layer() -> None:
    scripted = torch.jit.script(NN.BatchNorm2d(4).eval())
    with pytest.raises(torch.jit.Error, match=r"expected an input of \(4,\) dimensions, got 3"):
        scripted(torch.randn(2, 4, 3))


def test_script_takes_a_mask_where_statistics_are_fixed_and_refuses_it_for_batch_statistics() -> None:
    x, mask = torch.randn(2, 4, 3, 3, dtype=torch.float64), torch.rand(2, 3, 3) > 0.3
    layer = drawn(NN.BatchNorm2d(4)).eval()
    torch.testing.assert_close(torch.jit.script(layer)(x, None, mask), layer(x, mask=mask), rtol=0, atol=0)
    batch_stats = torch.jit.script(NN.BatchNorm2d(4, track_running_stats=False).double().eval())
    with pytest.raises(torch.jit.Error, match="mask= with batch statistics"):
        batch_stats(x, None, mask)
