"""Every behaviour of nn.BatchNorm* and nn.SyncBatchNorm that a user can observe, with ours side by
side (the table in docs/behaviour.md lists them). Where ours differs
on purpose, the test says so."""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from syncbn.functions.operators import lone_replica
from helpers import assert_same_state, randomize_affine
from syncbn import nn as NN


@pytest.fixture(autouse=True, params=["ours", "torch"])
def lone_route(request: pytest.FixtureRequest) -> str:
    """Every behaviour holds through both routes of a lone replica (functions/operators/lone_replica.py)."""
    with lone_replica.forced(request.param):
        yield request.param


def pair(cls=nn.BatchNorm2d, *args, **kwargs) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    theirs = randomize_affine(cls(*args, **kwargs))
    return theirs, NN.convert_sync_batchnorm(copy.deepcopy(theirs))


def raises_alike(theirs, ours, x: torch.Tensor, their_error: type, our_error: type, our_words: str) -> None:
    with pytest.raises(their_error):
        theirs(x)
    with pytest.raises(our_error, match=our_words):
        ours(x)


# ---- argument and input validation --------------------------------------------------------


def test_bad_input_raises_as_torch_does_and_names_the_layer() -> None:
    theirs, ours = pair(nn.BatchNorm2d, 3)
    ours.layer_name = "backbone.bn1"
    raises_alike(theirs, ours, torch.randn(2, 3, 4), ValueError, ValueError, r"backbone.bn1.*expected 4D input \(got 3D")
    raises_alike(theirs, ours, torch.randn(2, 4, 2, 2), RuntimeError, RuntimeError, "backbone.bn1.*expected 3 channels")
    raises_alike(theirs, ours, torch.ones(2, 3, 2, 2, dtype=torch.int64), NotImplementedError, RuntimeError, "floating point")
    raises_alike(theirs, ours, torch.randn(1, 3, 1, 1), ValueError, ValueError, "more than 1 value per channel")
    theirs.eval(), ours.eval()  # one value per channel is fine with running statistics
    torch.testing.assert_close(ours(torch.ones(1, 3, 1, 1)), theirs(torch.ones(1, 3, 1, 1)))


def test_eps_is_checked_where_batch_statistics_are_used() -> None:
    theirs, ours = pair(nn.BatchNorm2d, 3, eps=0.0)
    x = torch.randn(4, 3, 2, 2)
    raises_alike(theirs, ours, x, ValueError, ValueError, "eps must be positive during training")
    theirs.eval(), ours.eval()
    torch.testing.assert_close(ours(x), theirs(x))


# ---- the statistics ---------------------------------------------------------------------------


def test_momentum_none_is_the_cumulative_average() -> None:
    theirs, ours = pair(nn.BatchNorm2d, 3, momentum=None)
    theirs.double(), ours.double()
    for step in range(4):
        x = torch.randn(5, 3, 2, 2, dtype=torch.float64) * (step + 1) + step
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-12, rtol=1e-12)
    assert_same_state(theirs, ours, atol=1e-12, rtol=1e-12)


def test_an_empty_batch_only_counts() -> None:
    theirs, ours = pair(nn.BatchNorm2d, 3)
    x = torch.randn(0, 3, 2, 2)
    assert ours(x).shape == theirs(x).shape == x.shape
    assert_same_state(theirs, ours)
    assert int(ours.num_batches_tracked) == 1


@pytest.mark.parametrize("track_running_stats", [True, False])
def test_eval_with_and_without_running_statistics(track_running_stats: bool) -> None:
    theirs, ours = pair(nn.BatchNorm2d, 3, track_running_stats=track_running_stats)
    theirs.double(), ours.double()
    warm = torch.randn(6, 3, 2, 2, dtype=torch.float64) + 1  # some running statistics
    for model in (theirs, ours):
        model(warm)
        model.eval()
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-12, rtol=1e-12)
    assert_same_state(theirs, ours, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_input_with_float32_parameters(dtype: torch.dtype) -> None:
    theirs, ours = pair(nn.BatchNorm2d, 3)  # float32 parameters and buffers, as under autocast
    x = (torch.randn(8, 3, 4, 4) * 3 + 2).to(dtype)
    y_theirs, y_ours = theirs(x.clone().requires_grad_()), ours(x.clone().requires_grad_())
    assert y_ours.dtype == y_theirs.dtype == dtype
    torch.testing.assert_close(y_ours, y_theirs, atol=2e-2, rtol=2e-2)
    assert_same_state(theirs, ours, atol=1e-5, rtol=1e-5)


def test_parameters_that_do_not_require_grad() -> None:
    theirs, ours = pair(nn.BatchNorm2d, 3)
    for model in (theirs, ours):
        model.double().weight.requires_grad_(False)
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64)
    grads = []
    for model in (theirs, ours):
        xs = x.clone().requires_grad_()
        model(xs).pow(2).sum().backward()
        assert model.weight.grad is None and model.bias.grad is not None
        grads.append((xs.grad, model.bias.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-12)


# ---- state --------------------------------------------------------------------------------------


def test_checkpoints_of_old_torch_versions_load() -> None:
    # version 1 checkpoints have no num_batches_tracked: _BatchNorm._load_from_state_dict fills it
    # in (strict loading does not fail) with the layer's own count
    theirs, ours = pair(nn.BatchNorm2d, 3)
    old = theirs.state_dict()
    del old["num_batches_tracked"]
    old._metadata = {"": {"version": 1}}
    for model in (theirs, ours):
        model.num_batches_tracked.fill_(7)
        model.load_state_dict(old)
    assert int(ours.num_batches_tracked) == int(theirs.num_batches_tracked) == 7
    assert_same_state(theirs, ours)
    assert ours._version == theirs._version


def test_reset_running_stats_and_parameters() -> None:
    theirs, ours = pair(nn.BatchNorm2d, 3)
    x = torch.randn(4, 3, 2, 2)
    for model in (theirs, ours):
        model(x)
        model.reset_running_stats()
    assert_same_state(theirs, ours)
    for model in (theirs, ours):
        model.reset_parameters()
    torch.testing.assert_close(ours.weight, theirs.weight)
    torch.testing.assert_close(ours.bias, theirs.bias)
    assert_same_state(theirs, ours)


def test_extra_repr_extends_torchs() -> None:
    theirs, ours = pair(nn.BatchNorm2d, 3, eps=1e-3, momentum=None, affine=False)
    assert ours.extra_repr() == theirs.extra_repr()
    ours.timeout = 5.0
    assert ours.extra_repr() == theirs.extra_repr() + ", timeout=5.0"


def test_meta_device_and_to_empty() -> None:
    theirs, ours = nn.BatchNorm2d(3, device="meta"), NN.BatchNorm2d(3, device="meta")
    assert ours.weight.is_meta and ours.running_mean.is_meta
    for model in (theirs, ours):
        model.to_empty(device="cpu")
        model.reset_parameters()
    torch.testing.assert_close(ours.weight, theirs.weight)
    assert_same_state(theirs, ours)
    x = torch.randn(4, 3, 2, 2)
    torch.testing.assert_close(ours(x), theirs(x))


def test_deepcopy_pickle_and_torch_save() -> None:
    _, ours = pair(nn.BatchNorm2d, 3)
    ours(torch.randn(4, 3, 2, 2))
    buffer = io.BytesIO()
    torch.save(ours, buffer)
    buffer.seek(0)
    copies = [copy.deepcopy(ours), pickle.loads(pickle.dumps(ours)), torch.load(buffer, weights_only=False)]
    x = torch.randn(4, 3, 2, 2)
    for clone in copies:
        assert_same_state(ours, clone)
        torch.testing.assert_close(clone.eval()(x), copy.deepcopy(ours).eval()(x))
        clone.train()(x)  # and trains


def test_parametrize_and_weight_norm_on_our_parameters() -> None:
    theirs, ours = pair(nn.BatchNorm2d, 3)
    theirs.double(), ours.double()

    class Positive(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return nn.functional.softplus(w)

    for model in (theirs, ours):
        parametrize.register_parametrization(model, "weight", Positive())
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-12, rtol=1e-12)
    ours(x).sum().backward(), theirs(x).sum().backward()
    original = [m.parametrizations.weight.original.grad for m in (theirs, ours)]
    torch.testing.assert_close(original[1], original[0], atol=1e-12, rtol=1e-12)
    normed = [torch.nn.utils.parametrizations.weight_norm(pair(nn.BatchNorm1d, 4)[i].double(), "weight", dim=None) for i in (0, 1)]
    x = torch.randn(5, 4, dtype=torch.float64)
    torch.testing.assert_close(normed[1](x), normed[0](x), atol=1e-12, rtol=1e-12)


def test_qconfig_passes_through_conversion_and_back() -> None:
    qconfig = torch.ao.quantization.get_default_qat_qconfig("x86")
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3))
    model[1].qconfig = qconfig
    ours = NN.convert_sync_batchnorm(model)
    assert ours[1].qconfig is qconfig
    assert NN.revert_sync_batchnorm(ours)[1].qconfig is qconfig
    torch_sync = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model))  # torch's does the same
    assert torch_sync[1].qconfig is not None


def test_models_of_torchs_sync_batchnorm_load_into_ours_and_back() -> None:
    torch_sync = nn.SyncBatchNorm.convert_sync_batchnorm(randomize_affine(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))))
    ours = NN.convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))
    ours.load_state_dict(torch_sync.state_dict())
    back = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))
    back.load_state_dict(ours.state_dict())
    for key, value in torch_sync.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    assert type(NN.convert_sync_batchnorm(torch_sync)[1]) is NN.SyncBatchNorm
    assert type(NN.revert_sync_batchnorm(NN.convert_sync_batchnorm(torch_sync))[1]) is nn.SyncBatchNorm


def weight_grad_error(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> float:
    """The weight gradient's largest error against float64, over sum |dy * xhat| per channel."""
    layer.train()(x.clone().requires_grad_()).backward(dy)
    x64 = x.double()
    dims = (0, 2, 3)
    xhat = (x64 - x64.mean(dims, keepdim=True)) / (x64.var(dims, correction=0, keepdim=True) + layer.eps).sqrt()
    truth = (dy.double() * xhat).sum(dims)
    return ((layer.weight.grad.double() - truth).abs() / (dy.double() * xhat).abs().sum(dims)).max().item()


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["NCHW", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_accumulation_no_worse_than_torch(dtype: torch.dtype, memory_format) -> None:
    # a large mean against the spread and positive dy: sum(dy * (x - mean)) is as sensitive to
    # the mean's error as it gets; ours stays within 2x of torch's double accumulation
    errors = {"theirs": [], "ours": []}
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        x = (torch.randn(24, 6, 8, 8, generator=generator) * 28 + 3).to(dtype).contiguous(memory_format=memory_format)
        dy = torch.rand(24, 6, 8, 8, generator=generator).to(dtype).contiguous(memory_format=memory_format)
        theirs, ours = pair(nn.BatchNorm2d, 6)
        errors["theirs"].append(weight_grad_error(theirs, x, dy))
        errors["ours"].append(weight_grad_error(ours, x, dy))
    assert max(errors["ours"]) <= 2 * max(errors["theirs"]), errors
