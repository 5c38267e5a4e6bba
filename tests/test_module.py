"""The user API: constructor, state_dict compatibility, convert/revert, copying and pickling,
the single-device path, and every kind of bad input."""
from __future__ import annotations

import copy
import inspect
import io
import pickle

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from syncbn.functions import serves_single_device
from syncbn.functions.operators import lone_replica
from helpers import count_exchanges, randomize_affine
from syncbn import nn as NN
from syncbn.modules.parallel import ThreadedDataParallel

PAIRS = [(nn.BatchNorm1d, NN.SyncBatchNorm1d), (nn.BatchNorm2d, NN.SyncBatchNorm2d), (nn.BatchNorm3d, NN.SyncBatchNorm3d)]


def test_public_names() -> None:
    assert NN.BatchNorm1d is NN.SyncBatchNorm1d
    assert NN.BatchNorm2d is NN.SyncBatchNorm2d
    assert NN.BatchNorm3d is NN.SyncBatchNorm3d
    for cls in (NN.SyncBatchNorm, NN.SyncBatchNorm1d, NN.SyncBatchNorm2d, NN.SyncBatchNorm3d):
        assert issubclass(cls, _BatchNorm)


@pytest.mark.parametrize("torch_cls, our_cls", PAIRS)
def test_positional_arguments_mean_what_they_mean_for_torch(torch_cls, our_cls) -> None:
    # num_features, eps, momentum, affine, track_running_stats: torch's layers take them in this
    # order; after them torch's BatchNorm*d and SyncBatchNorm differ, so the rest is by keyword
    theirs, ours = torch_cls(5, 1e-3, None, False, False), our_cls(5, 1e-3, None, False, False)
    for name in ("num_features", "eps", "momentum", "affine", "track_running_stats"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.weight is None and ours.running_mean is None
    group = torch.distributed.ProcessGroup(torch.distributed.HashStore(), 0, 1)
    assert NN.SyncBatchNorm(5, 1e-3, 0.2, True, True, group).process_group is group  # as nn.SyncBatchNorm


@pytest.mark.parametrize("torch_cls, our_cls", PAIRS)
def test_accepts_every_torch_argument(torch_cls, our_cls) -> None:
    for name in inspect.signature(torch_cls).parameters:
        assert name in inspect.signature(our_cls).parameters, name
    layer = our_cls(5, eps=1e-3, momentum=None, affine=True, track_running_stats=True, device="cpu", dtype=torch.float64, bias=False)
    assert layer.bias is None and layer.weight.dtype == torch.float64
    assert "bias=False" in repr(layer)


@pytest.mark.parametrize("kwargs", [dict(num_features=0), dict(num_features=2.0), dict(activation="gelu")])
def test_validates_arguments(kwargs) -> None:
    args = dict(num_features=3) | kwargs
    with pytest.raises(ValueError):
        NN.SyncBatchNorm2d(**args)


@pytest.mark.parametrize("options", [dict(), dict(affine=False), dict(bias=False), dict(track_running_stats=False)])
@pytest.mark.parametrize("torch_cls, our_cls", PAIRS)
def test_state_dict_is_torchs_both_ways(torch_cls, our_cls, options) -> None:
    theirs = randomize_affine(torch_cls(4, **options))
    theirs.train()(torch.randn(8, 4, *([3] * (2 if our_cls is NN.SyncBatchNorm2d else 3 if our_cls is NN.SyncBatchNorm3d else 0))))
    ours = our_cls(4, **options)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    back = torch_cls(4, **options)
    back.load_state_dict(ours.state_dict())
    for key, value in theirs.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


@pytest.mark.parametrize("route", ["ours", "torch"])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_single_device_is_torchs_computation_where_torch_serves(momentum, route) -> None:
    # bit for bit: eval with running stats, and training where our kernels do not serve (the
    # reference backend; see test_lone_replica.py for the measured routing), is F.batch_norm
    # itself, empty batch too; the cumulative average (momentum=None) always takes our operators
    # in training (torch's reads num_batches_tracked on the host)
    torch.manual_seed(0)
    theirs = randomize_affine(nn.BatchNorm2d(4, momentum=momentum))
    ours = NN.SyncBatchNorm2d(4, momentum=momentum)
    ours_in_training = (route == "ours" and serves_single_device(torch.device("cpu"))) or momentum is None
    for training, batch in [(True, 6), (True, 0), (True, 3), (False, 5), (False, 0)]:
        ours.load_state_dict(theirs.state_dict())
        theirs.train(training)
        ours.train(training)
        x = torch.randn(batch, 4, 3, 3)
        exact = not (training and ours_in_training)
        compare = torch.equal if exact else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        with lone_replica.forced(route):
            assert compare(ours(x), theirs(x)), (training, batch)
        for key, value in theirs.state_dict().items():
            assert compare(ours.state_dict()[key], value), (training, batch, key)


def test_single_device_training_takes_compiled_kernels() -> None:
    # the suite forces our route (tests/conftest.py): a lone replica runs the compiled kernels
    # where they are loaded; with the pure-PyTorch reference torch's own batch norm serves
    layer = NN.SyncBatchNorm2d(3)
    x = torch.randn(4, 3, 2, 2, requires_grad=True)
    ours = serves_single_device(torch.device("cpu"))
    training = type(layer(x).grad_fn).__name__
    assert (training == "SyncBatchNormFunctionBackward") == ours, training
    assert type(layer.eval()(x).grad_fn).__name__ == "NativeBatchNormBackward0"


def test_eval_with_running_stats_never_syncs(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_exchanges(monkeypatch)
    model = ThreadedDataParallel(nn.Sequential(NN.SyncBatchNorm2d(3), NN.SyncBatchNorm2d(3)), ["cpu"] * 4)
    model.eval()
    model(torch.randn(10, 3, 2, 2, requires_grad=True)).sum().backward()
    assert calls == []
    model.train()
    model(torch.randn(10, 3, 2, 2, requires_grad=True)).sum().backward()
    assert len(calls) == 2 * 2 * 4  # 2 layers x (forward + backward) x 4 replicas


def test_eval_without_running_stats_never_syncs(monkeypatch: pytest.MonkeyPatch) -> None:
    # as nn.SyncBatchNorm (need_sync only in training): each replica normalizes its own chunk
    calls = count_exchanges(monkeypatch)
    model = ThreadedDataParallel(NN.SyncBatchNorm2d(3, track_running_stats=False).eval().double(), ["cpu"] * 2)
    x = torch.randn(5, 3, 2, 2, dtype=torch.float64)
    y = model(x)
    assert calls == []
    expected = torch.cat([F.batch_norm(chunk, None, None, training=True) for chunk in x.chunk(2)])
    torch.testing.assert_close(y, expected, atol=1e-12, rtol=1e-12)


# --- convert and revert -----------------------------------------------------------------------


def model_with_every_torch_bn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 1),
        nn.BatchNorm2d(4, momentum=None),
        nn.Sequential(nn.BatchNorm2d(4, affine=False), nn.BatchNorm2d(4, bias=False)),
        nn.SyncBatchNorm(4, track_running_stats=False),
        nn.Flatten(2),
        nn.BatchNorm1d(4, eps=1e-3),
    )


def test_convert_keeps_everything_and_revert_round_trips() -> None:
    model = model_with_every_torch_bn().double()
    model[1].weight.requires_grad_(False)
    model[2][1].eval()
    params = [id(p) for p in model.parameters()]
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    converted = NN.convert_sync_batchnorm(model)
    assert [type(m) for m in converted.modules()].count(NN.SyncBatchNorm2d) == 3
    assert type(converted[3]) is NN.SyncBatchNorm and type(converted[5]) is NN.SyncBatchNorm1d
    assert [id(p) for p in converted.parameters()] == params  # optimizers keep working
    assert converted[1].weight.requires_grad is False
    assert converted[2][1].training is False and converted[1].training is True
    assert converted[1].momentum is None and converted[5].eps == 1e-3 and converted[2][1].bias is None
    assert converted[1].layer_name == "1" and converted[2][0].layer_name == "2.0"
    assert all(v.dtype == torch.float64 for k, v in converted.state_dict().items() if "num_batches" not in k)
    reverted = NN.revert_sync_batchnorm(converted)
    assert [type(m) for m in reverted.modules()] == [type(m) for m in model_with_every_torch_bn().modules()]
    assert [id(p) for p in reverted.parameters()] == params
    for key, value in reverted.state_dict().items():
        assert torch.equal(value, buffers[key]), key


def test_convert_a_lone_layer_and_set_process_group() -> None:
    layer = NN.convert_sync_batchnorm(nn.BatchNorm3d(2))
    assert type(layer) is NN.SyncBatchNorm3d
    group = torch.distributed.ProcessGroup(torch.distributed.HashStore(), 0, 1)
    assert NN.convert_sync_batchnorm(layer, process_group=group).process_group is group


# --- copies and pickles -------------------------------------------------------------------------


def trained_model() -> nn.Module:
    model = nn.Sequential(nn.Conv2d(2, 3, 1), NN.SyncBatchNorm2d(3, timeout=7), nn.ReLU())
    ThreadedDataParallel(model, ["cpu"] * 2)(torch.randn(4, 2, 2, 2)).sum().backward()
    return model


@pytest.mark.parametrize("how", ["deepcopy", "torch.save", "pickle"])
def test_copies_and_pickles(how: str) -> None:
    model = trained_model()
    if how == "deepcopy":
        clone = copy.deepcopy(model)
    elif how == "pickle":
        clone = pickle.loads(pickle.dumps(model))
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        clone = torch.load(buffer, weights_only=False)
    assert clone[1]._round_tracker is not model[1]._round_tracker
    assert clone[1].timeout == 7
    for key, value in model.state_dict().items():
        assert torch.equal(clone.state_dict()[key], value)
    x = torch.randn(6, 2, 2, 2)
    torch.testing.assert_close(ThreadedDataParallel(clone, ["cpu"] * 3)(x), ThreadedDataParallel(model, ["cpu"] * 3)(x))


# --- bad input ----------------------------------------------------------------------------------


def unchanged(layer: nn.Module, before: dict) -> bool:
    return all(torch.equal(layer.state_dict()[k], v) for k, v in before.items())


BAD_INPUTS = [
    (NN.SyncBatchNorm2d, torch.randn(4, 3, 2), ValueError, r"SyncBatchNorm2d\(3\): expected 4D input \(got 3D input\)"),
    (NN.SyncBatchNorm1d, torch.randn(4, 3, 2, 2), ValueError, r"expected 2D or 3D input \(got 4D input\)"),
    (NN.SyncBatchNorm3d, torch.randn(4, 3, 2, 2), ValueError, r"expected 5D input \(got 4D input\)"),
    (NN.SyncBatchNorm, torch.randn(3), ValueError, r"expected at least 2D input \(got 1D input\)"),
    (NN.SyncBatchNorm2d, torch.randn(4, 5, 2, 2), RuntimeError, r"expected 3 channels in dim 1, got input of size \(\d, 5, 2, 2\)"),
    (NN.SyncBatchNorm2d, torch.ones(4, 3, 2, 2, dtype=torch.long), RuntimeError, r"expected a floating point input, got torch.int64"),
    (NN.SyncBatchNorm2d, torch.ones(4, 3, 2, 2, dtype=torch.bool), RuntimeError, r"floating point input, got torch.bool"),
    (NN.SyncBatchNorm2d, torch.randn(4, 3, 2, 2, dtype=torch.float64), RuntimeError, r"input of torch.float64 needs weight of the same dtype"),
    (NN.SyncBatchNorm2d, torch.randn(4, 3, 2, 2, device="meta"), RuntimeError, r"input is on meta but weight is on cpu"),
    (NN.SyncBatchNorm2d, torch.randn(1, 3, 1, 1), ValueError, r"Expected more than 1 value per channel when training"),
    (NN.SyncBatchNorm1d, torch.randn(1, 3), ValueError, r"Expected more than 1 value per channel when training"),
]


@pytest.mark.parametrize("cls, x, error, message", BAD_INPUTS, ids=[m[:40] for *_, m in BAD_INPUTS])
@pytest.mark.parametrize("replicas", [1, 2])
def test_bad_input_raises_before_any_state_changes(cls, x, error, message, replicas: int) -> None:
    layer = cls(3, timeout=30)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    model = ThreadedDataParallel(layer, ["cpu"] * replicas) if replicas > 1 and x.device.type == "cpu" else layer
    with pytest.raises(error, match=message):
        model(x)
    assert unchanged(layer, before)


def test_torch_raises_the_same_types() -> None:
    for cls, x, error, _ in BAD_INPUTS:
        torch_cls = {NN.SyncBatchNorm: nn.SyncBatchNorm, NN.SyncBatchNorm1d: nn.BatchNorm1d, NN.SyncBatchNorm2d: nn.BatchNorm2d, NN.SyncBatchNorm3d: nn.BatchNorm3d}[cls]
        if x.device.type == "meta":
            continue  # torch's meta kernels accept this; ours names the mismatch
        with pytest.raises(error):
            torch_cls(3)(x)


def test_one_value_per_channel_is_fine_in_eval() -> None:
    layer = NN.SyncBatchNorm2d(3).eval()
    assert layer(torch.randn(1, 3, 1, 1)).shape == (1, 3, 1, 1)


@pytest.mark.parametrize("replicas", [1, 4])
def test_nan_and_inf_propagate_like_torch(replicas: int) -> None:
    x = torch.randn(8, 3, 2, 2, dtype=torch.float64)
    x[0, 0, 0, 0] = float("nan")
    x[1, 1, 0, 0] = float("inf")
    ours, theirs = NN.SyncBatchNorm2d(3).double(), nn.BatchNorm2d(3).double()
    model = ThreadedDataParallel(ours, ["cpu"] * replicas) if replicas > 1 else ours
    y, y_ref = model(x), theirs(x)
    for a, b in [(y, y_ref), (ours.running_mean, theirs.running_mean), (ours.running_var, theirs.running_var)]:
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())
        torch.testing.assert_close(a[a.isfinite()], b[b.isfinite()], atol=1e-12, rtol=1e-12)


def test_convert_and_revert_a_layer_held_twice_and_keep_process_groups() -> None:
    bn = nn.BatchNorm1d(3)
    model = NN.convert_sync_batchnorm(nn.Sequential(bn, nn.Identity(), bn))
    assert type(model[0]) is NN.SyncBatchNorm1d and model[2] is model[0]
    model = NN.revert_sync_batchnorm(model)
    assert type(model[0]) is nn.BatchNorm1d and model[2] is model[0]
    group = object()
    converted = NN.convert_sync_batchnorm(nn.SyncBatchNorm(3, process_group=group))
    assert converted.process_group is group
    assert NN.revert_sync_batchnorm(converted).process_group is group


@pytest.mark.skipif(torch.cuda.is_available(), reason="nn.DataParallel has devices where CUDA is visible")
def test_stock_data_parallel_without_cuda_says_it_meets_no_one() -> None:
    import warnings

    model = nn.Sequential(NN.BatchNorm2d(3), NN.BatchNorm2d(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        NN.BatchNorm2d(3)(torch.randn(4, 3, 2, 2))  # a lone layer: nothing to say
        assert not caught
        y = nn.DataParallel(model)(torch.randn(4, 3, 2, 2))
        nn.DataParallel(model)(torch.randn(4, 3, 2, 2))  # each layer looks once
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2 and all("ThreadedDataParallel" in m and "no CUDA device" in m for m in messages), messages
    assert y.shape == (4, 3, 2, 2)
