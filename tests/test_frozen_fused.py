"""Frozen batch norm and the fused residual/activation, against torch's unfused composition:
``nn.BatchNorm*`` (in eval mode with trainable affine, for frozen layers), ``+ z``, ReLU or
LeakyReLU. Outputs, input and residual gradients, weight and bias gradients and buffers over
several SGD steps in float64, alone, under ThreadedDataParallel with uneven replicas, and in
eval mode; no communication when frozen; freeze_batchnorm, fuse_bn_act and their limits."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from syncbn.functions import frozen_batch_norm, serves_single_device
from helpers import count_exchanges, randomize_affine
from syncbn import nn as NN
from syncbn.modules.parallel import ThreadedDataParallel
from testkit.lockstep import assert_agree, train_side_by_side

TOL = dict(atol=1e-9, rtol=1e-9)
TORCH_BN = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}
OURS = {2: NN.BatchNorm1d, 3: NN.BatchNorm1d, 4: NN.BatchNorm2d, 5: NN.BatchNorm3d}


class Unfused(nn.Module):
    """torch's composition: act(bn(x) + z)."""

    def __init__(self, bn: nn.Module, activation: str | None, negative_slope: float) -> None:
        super().__init__()
        self.bn, self.activation, self.negative_slope = bn, activation, negative_slope

    def forward(self, x, z=None):
        y = self.bn(x)
        if z is not None:
            y = y + z
        if self.activation == "relu":
            return F.relu(y, inplace=True)  # in place, as models often do after batch norm
        if self.activation == "leaky_relu":
            return F.leaky_relu(y, self.negative_slope)
        return y


def make_pair(rank: int, C: int, activation, negative_slope=0.01, frozen=False, affine=True):
    """torch's unfused layer (eval mode when frozen) and ours, with the same state."""
    torch.manual_seed(0)
    ref = Unfused(randomize_affine(TORCH_BN[rank](C, affine=affine)).double(), activation, negative_slope)
    with torch.no_grad():  # running statistics worth freezing
        ref.bn.running_mean.uniform_(-1, 2)
        ref.bn.running_var.uniform_(0.5, 3)
    ours = OURS[rank](C, affine=affine, activation=activation, negative_slope=negative_slope, frozen=frozen).double()
    ours.load_state_dict(ref.bn.state_dict())
    return ref, ours


def train_pair(ref, ours, shape, residual: bool, replicas=1, steps=3, ref_training=True, ours_training=True,
               memory_format=torch.contiguous_format) -> None:
    """``ref`` (an :class:`Unfused`) and our layer side by side; with ``residual``, both take
    ``(x, z)`` and z's gradient is compared too. Our output keeps the input's layout."""
    ref.train(ref_training)
    ours.train(ours_training)
    runner = ThreadedDataParallel(ours, ["cpu"] * replicas) if replicas > 1 else ours

    def batch(step: int) -> list[Tensor]:
        x = (torch.randn(*shape, dtype=torch.float64) * 2 + 0.5).contiguous(memory_format=memory_format)
        return [x, torch.randn(*shape, dtype=torch.float64)] if residual else [x]

    strides = torch.empty(shape).contiguous(memory_format=memory_format).stride()
    for quantities in train_side_by_side(ref, ours, batch, steps, runner=runner, lr=0.05, reference_state=ref.bn):
        assert quantities[0].name == "output" and quantities[0].ours.stride() == strides
        assert_agree(iter([quantities]), **TOL)


ACTIVATIONS = [(None, 0.01), ("relu", 0.01), ("leaky_relu", 0.2)]
SHAPES = [((7, 3, 5, 4), torch.contiguous_format), ((7, 3, 5, 4), torch.channels_last), ((9, 5), torch.contiguous_format),
          ((7, 2, 6), torch.contiguous_format), ((5, 3, 2, 3, 4), torch.channels_last_3d)]


@pytest.mark.parametrize("activation,negative_slope", ACTIVATIONS)
@pytest.mark.parametrize("residual", [False, True], ids=["no-z", "z"])
@pytest.mark.parametrize("shape,memory_format", SHAPES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("replicas", [1, 3])
def test_fused_training_matches_unfused(activation, negative_slope, residual, shape, memory_format, replicas) -> None:
    ref, ours = make_pair(len(shape), shape[1], activation, negative_slope)
    train_pair(ref, ours, shape, residual, replicas, memory_format=memory_format)


@pytest.mark.parametrize("activation,negative_slope", ACTIVATIONS)
@pytest.mark.parametrize("residual", [False, True], ids=["no-z", "z"])
@pytest.mark.parametrize("shape,memory_format", SHAPES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("replicas", [1, 3])
def test_frozen_matches_eval_mode_with_trainable_affine(activation, negative_slope, residual, shape, memory_format, replicas) -> None:
    ref, ours = make_pair(len(shape), shape[1], activation, negative_slope, frozen=True)
    train_pair(ref, ours, shape, residual, replicas, ref_training=False, memory_format=memory_format)


@pytest.mark.parametrize("activation,negative_slope", ACTIVATIONS)
@pytest.mark.parametrize("residual", [False, True], ids=["no-z", "z"])
def test_eval_mode_with_activation_matches_unfused(activation, negative_slope, residual) -> None:
    ref, ours = make_pair(4, 3, activation, negative_slope)
    train_pair(ref, ours, (4, 3, 3, 3), residual, ref_training=False, ours_training=False)


@pytest.mark.parametrize("affine", [True, False])
def test_frozen_without_affine_and_with_frozen_parameters(affine) -> None:
    ref, ours = make_pair(4, 3, "relu", frozen=True, affine=affine)
    train_pair(ref, ours, (5, 3, 2, 2), residual=True, ref_training=False)
    ref, ours = make_pair(4, 3, None, frozen=True)
    for p in [*ref.parameters(), *ours.parameters()]:
        p.requires_grad_(False)
    train_pair(ref, ours, (5, 3, 2, 2), residual=False, ref_training=False)


def test_frozen_layer_never_updates_or_communicates(monkeypatch: pytest.MonkeyPatch) -> None:
    ref, ours = make_pair(4, 3, None, frozen=True)
    before = {name: b.clone() for name, b in ours.named_buffers()}
    runner = ThreadedDataParallel(ours, ["cpu"] * 3)
    calls = count_exchanges(monkeypatch)
    runner(torch.randn(7, 3, 4, 4, dtype=torch.float64, requires_grad=True)).sum().backward()
    assert calls == [], f"a frozen layer exchanged {calls}"
    ours.unfreeze()
    runner(torch.randn(7, 3, 4, 4, dtype=torch.float64, requires_grad=True)).sum().backward()
    assert [key for key, _ in calls] == ["forward", "forward", "forward", "backward", "backward", "backward"]
    assert int(ours.num_batches_tracked) == 1 and not torch.equal(ours.running_mean, before["running_mean"])


def test_functional_frozen_batch_norm_gradcheck() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 3, 2, dtype=torch.float64, generator=gen).requires_grad_()
    z = torch.randn(3, 2, 3, 2, dtype=torch.float64, generator=gen).requires_grad_()
    w = torch.rand(2, dtype=torch.float64, generator=gen).add(0.5).requires_grad_()
    b = torch.randn(2, dtype=torch.float64, generator=gen).requires_grad_()
    mean, var = torch.randn(2, dtype=torch.float64), torch.rand(2, dtype=torch.float64) + 0.5
    for slope in [None, 0.0, 0.3]:
        assert torch.autograd.gradcheck(lambda x, w, b, z: frozen_batch_norm(x, mean, var, w, b, 1e-5, z, slope), (x, w, b, z))


def test_frozen_float32_channels_last_matches_eval_mode() -> None:
    ref = randomize_affine(nn.BatchNorm2d(16)).eval()
    ours = NN.BatchNorm2d(16, frozen=True)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(4, 16, 7, 9).contiguous(memory_format=torch.channels_last).requires_grad_()
    y_ref, y_ours = ref(x), ours(x)
    torch.testing.assert_close(y_ours, y_ref)
    assert y_ours.is_contiguous(memory_format=torch.channels_last)
    probe = torch.randn_like(y_ref)
    grads_ref = torch.autograd.grad((y_ref * probe).sum(), [x, ref.weight, ref.bias])
    grads_ours = torch.autograd.grad((y_ours * probe).sum(), [x, ours.weight, ours.bias])
    for got, expected in zip(grads_ours, grads_ref):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fused_half_input_with_float32_parameters(dtype) -> None:
    ref, ours = make_pair(4, 8, "relu")
    ref.float()
    ours.float()
    x = torch.randn(6, 8, 5, 5).to(dtype).requires_grad_()
    z = torch.randn(6, 8, 5, 5).to(dtype).requires_grad_()
    y_ours = ours(x, z)
    assert y_ours.dtype == dtype
    y_ref = F.relu(F.batch_norm(x.float(), None, None, ref.bn.weight, ref.bn.bias, True, 0.1, 1e-5) + z.float())
    torch.testing.assert_close(y_ours.float(), y_ref, atol=2e-2, rtol=1e-2)


# --- the module API ------------------------------------------------------------------------------


def test_freeze_unfreeze_and_state_dict() -> None:
    layer = NN.BatchNorm2d(4)
    keys = set(layer.state_dict())
    assert layer.freeze() is layer and layer.frozen and "frozen=True" in repr(layer)
    assert set(layer.state_dict()) == keys
    assert layer.unfreeze() is layer and not layer.frozen
    assert NN.BatchNorm2d(4, frozen=True).frozen


def test_freeze_batchnorm_converts_and_freezes_every_layer() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.Sequential(NN.BatchNorm2d(4), nn.BatchNorm2d(4)))
    keys = set(model.state_dict())
    weight = model[1].weight
    frozen = NN.freeze_batchnorm(model)
    layers = [m for m in frozen.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(layers) == 3 and all(isinstance(m, NN.SyncBatchNorm) and m.frozen for m in layers)
    assert frozen[1].weight is weight and set(frozen.state_dict()) == keys
    assert isinstance(NN.freeze_batchnorm(nn.BatchNorm1d(3)), NN.BatchNorm1d)


def test_bad_arguments_and_inputs_raise_clearly() -> None:
    with pytest.raises(ValueError, match="activation must be one of"):
        NN.BatchNorm2d(4, activation="gelu")
    with pytest.raises(ValueError, match="needs running statistics"):
        NN.BatchNorm2d(4, frozen=True, track_running_stats=False)
    with pytest.raises(ValueError, match=r"BatchNorm2d\(4\).*needs running statistics"):
        NN.BatchNorm2d(4, track_running_stats=False).freeze()
    layer = NN.BatchNorm2d(4, activation="relu")
    x = torch.randn(2, 4, 3, 3)
    for z, words in [(torch.randn(2, 4, 3, 2), "size"), (torch.randn(2, 4, 3, 3).double(), "float64")]:
        for frozen in [False, True]:
            layer.frozen = frozen
            with pytest.raises(RuntimeError, match=rf"SyncBatchNorm2d\(4\): the residual z must match the input.*{words}"):
                layer(x, z)
    with pytest.raises(TypeError, match="residual z must be a Tensor"):
        layer(x, 1.0)
    # an activation set after construction to one the layer does not know: on every path
    layer.activation = "gelu"
    for frozen, training in [(False, True), (True, True), (False, False)]:
        layer.frozen = frozen
        layer.train(training)
        with pytest.raises(ValueError, match=r"SyncBatchNorm2d\(4\): activation must be one of .* got 'gelu'"):
            layer(x)


def test_backend_serves_frozen_and_fused_through_our_kernels_where_they_serve() -> None:
    layer = NN.BatchNorm2d(3, frozen=True, activation="relu")
    x = torch.randn(2, 3, 4, 4, requires_grad=True)
    y = layer(x)
    ours = serves_single_device(x.device)
    assert (type(y.grad_fn).__name__ == "FrozenBatchNormFunctionBackward") == ours, y.grad_fn
    # plain eval stays torch's own batch norm (bit-exact with nn.BatchNorm2d)
    plain = NN.BatchNorm2d(3).eval()
    assert "FrozenBatchNorm" not in type(plain(x).grad_fn).__name__


# --- convert, revert, fuse -----------------------------------------------------------------------


def conv_bn_relu(inplace: bool = True) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=inplace),
        nn.Conv2d(4, 4, 1, bias=False),
        nn.BatchNorm2d(4),
        nn.LeakyReLU(0.2),
        nn.BatchNorm2d(4),  # followed by nothing: stays as it is
    )


class Block(nn.Module):
    """A residual block in torchvision's style: one ReLU module called twice, a functional relu."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.bn3 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out)) + x  # bn2's output goes to an add: not fused
        return F.relu(self.bn3(self.relu(out)))


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = conv_bn_relu()
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.body(x)
        return self.bn(y).relu() if y.sum() > 0 else y  # control flow on a value


def assert_same_training(ref: nn.Module, ours: nn.Module, shape, steps: int = 3) -> None:
    def batch(step: int) -> list[Tensor]:
        return [torch.randn(*shape, dtype=torch.float64)]

    assert_agree(train_side_by_side(ref, ours, batch, steps, lr=0.05), **TOL)


def fused_layers(model: nn.Module) -> list[tuple[str, str | None]]:
    return [(name, m.activation) for name, m in model.named_modules() if isinstance(m, NN.SyncBatchNorm)]


def test_fuse_sequential_pairs_in_place_with_inplace_relu() -> None:
    ref = randomize_affine(conv_bn_relu()).double()
    model = copy.deepcopy(ref)
    fused = NN.fuse_bn_act(model)
    assert fused is model
    assert fused_layers(fused) == [("1", "relu"), ("4", "leaky_relu")]
    assert fused[4].negative_slope == 0.2 and isinstance(fused[2], nn.Identity) and isinstance(fused[6], nn.BatchNorm2d)
    assert set(fused.state_dict()) == set(ref.state_dict())
    assert_same_training(ref, fused, (5, 3, 4, 4))


def test_fuse_traced_pairs_and_leave_the_rest() -> None:
    ref = randomize_affine(Block()).double()
    fused = NN.fuse_bn_act(copy.deepcopy(ref))
    assert isinstance(fused, torch.fx.GraphModule)
    assert fused_layers(fused) == [("bn1", "relu"), ("bn3", "relu")]
    assert type(fused.bn2) is nn.BatchNorm2d
    assert set(fused.state_dict()) == set(ref.state_dict())
    assert_same_training(ref, fused, (3, 4, 5, 5))


def test_fuse_leaves_shared_and_untraceable_models_alone() -> None:
    bn = nn.BatchNorm2d(4)
    shared = nn.Sequential(nn.Sequential(bn, nn.ReLU()), nn.Sequential(bn, nn.Identity()))
    assert fused_layers(NN.fuse_bn_act(shared)) == []  # fusing one use would change the other
    model = Untraceable().double()
    fused = NN.fuse_bn_act(model)
    assert fused is model and fused_layers(fused) == [("body.1", "relu"), ("body.4", "leaky_relu")]
    assert type(fused.bn) is nn.BatchNorm2d
    assert NN.fuse_bn_act(nn.ReLU()).__class__ is nn.ReLU


def test_convert_keeps_layers_plain_and_revert_refuses_what_torch_cannot_express() -> None:
    converted = NN.convert_sync_batchnorm(conv_bn_relu())
    assert all(activation is None for _, activation in fused_layers(converted))
    assert isinstance(converted[2], nn.ReLU)
    fused = NN.fuse_bn_act(conv_bn_relu())
    with pytest.raises(ValueError, match="fused activation 'relu'"):
        NN.revert_sync_batchnorm(fused)
    with pytest.raises(ValueError, match="is frozen"):
        NN.revert_sync_batchnorm(NN.freeze_batchnorm(conv_bn_relu()))


@pytest.mark.parametrize("fuse", ["fuse_bn_act", "convert_inplace_abn"])
def test_a_batch_norm_with_its_own_activation_is_not_fused_again(fuse) -> None:
    # timm's layout: act (here SiLU, applied after the batch norm) comes before the next ReLU
    model = nn.Sequential(NN.SyncBatchNormAct2d(4, act_layer=nn.SiLU), nn.ReLU()).double()
    x = torch.randn(5, 4, 3, 3, dtype=torch.float64)
    expected = model(x)
    layer = model[0]
    result = getattr(NN, fuse)(model)
    fused = result if fuse == "fuse_bn_act" else result.module
    assert fused[0] is layer and type(fused[1]) is nn.ReLU and isinstance(layer.act, nn.SiLU)
    torch.testing.assert_close(fused(x), expected, atol=1e-14, rtol=1e-14)
