"""Which kernels serve a lone replica (functions/operators/lone_replica.py): the rule routes each input,
both routes compute what nn.BatchNorm* computes, and the override works."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch.nn import functional as F

from syncbn.functions import serves_single_device
from syncbn.functions.operators import lone_replica
from syncbn.functions.operators.lone_replica import LARGE_INPUT, takes_our_kernels
from helpers import SmallResNet, assert_same_state, randomize_affine
from syncbn import nn as NN
from testkit.lockstep import assert_agree, train_side_by_side

COMPILED = serves_single_device(torch.device("cpu"))
needs_compiled = pytest.mark.skipif(not COMPILED, reason="the compiled CPU kernels are not loaded")


def grad_fn_name(layer: nn.Module, x: torch.Tensor, z: torch.Tensor | None = None) -> str:
    return type((layer(x) if z is None else layer(x, z)).grad_fn).__name__


def large(*shape_tail: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An input of at least LARGE_INPUT elements, (N, 8, *shape_tail)."""
    per_sample = 8 * int(torch.Size(shape_tail).numel())
    return torch.randn(-(-LARGE_INPUT // per_sample), 8, *shape_tail, dtype=dtype)


@needs_compiled
def test_the_rule_takes_ours_for_large_nchw_training_inputs_only() -> None:
    with lone_replica.forced("rule"):
        for x in (large(16, 16), large(4, 8, 8), large(256), large(16, 16, dtype=torch.float64)):
            assert takes_our_kernels(x, fixed_stats=False), x.shape
            assert not takes_our_kernels(x, fixed_stats=True), x.shape  # frozen: torch's
        small = torch.randn(2, 8, 4, 4)
        assert not takes_our_kernels(small, fixed_stats=False)
        just_below = torch.randn(LARGE_INPUT - 1, 1, 1)
        assert not takes_our_kernels(just_below, fixed_stats=False)
        assert takes_our_kernels(torch.randn(LARGE_INPUT, 1, 1), fixed_stats=False)
        assert not takes_our_kernels(large(16, 16).to(memory_format=torch.channels_last), fixed_stats=False)
        assert not takes_our_kernels(large(16, 16)[:, :, :, ::2], fixed_stats=False)  # strided
        assert not takes_our_kernels(torch.randn(LARGE_INPUT, 8), fixed_stats=False)  # (N, C): no spatial
        for dtype in (torch.bfloat16, torch.float16):
            assert not takes_our_kernels(large(16, 16, dtype=dtype), fixed_stats=False)


@needs_compiled
def test_layers_route_by_the_rule() -> None:
    x, small = large(16, 16).requires_grad_(), torch.randn(2, 8, 4, 4, requires_grad=True)
    with lone_replica.forced("rule"):
        train, fused = NN.BatchNorm2d(8), NN.BatchNorm2d(8, activation="relu")
        assert grad_fn_name(train, x) == "SyncBatchNormFunctionBackward"
        assert grad_fn_name(fused, x, torch.randn_like(x)) == "SyncBatchNormFunctionBackward"
        assert grad_fn_name(train, small) == "NativeBatchNormBackward0"
        assert grad_fn_name(fused, small, torch.randn_like(small)) == "ReluBackward0"
        frozen_fused = NN.BatchNorm2d(8, frozen=True, activation="relu")
        assert grad_fn_name(frozen_fused, x) == "ReluBackward0"  # frozen: torch's, act unfused
        # the cumulative average takes our operators whatever the rule says (see modules/batchnorm.py)
        assert grad_fn_name(NN.BatchNorm2d(8, momentum=None), small) == "SyncBatchNormFunctionBackward"
        # plain eval is torch's eval-mode batch norm, bit-exact
        assert grad_fn_name(train.eval(), x) == "NativeBatchNormBackward0"


def test_without_compiled_kernels_torchs_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(lone_replica.backend.SERVING, "cpu", "reference")
    for route in ("rule", "ours"):
        with lone_replica.forced(route):
            assert not takes_our_kernels(large(16, 16), fixed_stats=False)


def test_forced_routes() -> None:
    x = torch.randn(2, 3, 4, 4, requires_grad=True)
    layer = NN.BatchNorm2d(3)
    with lone_replica.forced("torch"):
        assert grad_fn_name(layer, x) == "NativeBatchNormBackward0"
        assert not takes_our_kernels(x, fixed_stats=False)
    with lone_replica.forced("ours"):
        expected = "SyncBatchNormFunctionBackward" if COMPILED else "NativeBatchNormBackward0"
        assert grad_fn_name(layer, x) == expected
    with pytest.raises(ValueError, match="choice must be one of"):
        with lone_replica.forced("fastest"):
            pass


@pytest.mark.parametrize("route", ["ours", "torch", "rule"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_every_route_trains_a_resnet_as_torch(route: str, channels_last: bool) -> None:
    # three steps of a ResNet-style net (residual adds, a fused BN+add+ReLU in ours, BN1d head)
    torch.manual_seed(0)
    ref = randomize_affine(SmallResNet()).double()
    ours = NN.fuse_bn_act(NN.convert_sync_batchnorm(randomize_affine(SmallResNet()).double()))
    ours.load_state_dict(ref.state_dict())
    memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def batch(step: int) -> list[torch.Tensor]:
        return [torch.randn(6, 3, 8, 8, dtype=torch.float64).contiguous(memory_format=memory_format)]

    with lone_replica.forced(route):
        assert_agree(train_side_by_side(ref, ours, batch, 3), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("route", ["ours", "torch"])
@pytest.mark.parametrize("frozen", [False, True])
def test_fused_layer_through_each_route_matches_torch(route: str, frozen: bool) -> None:
    torch.manual_seed(1)
    theirs = randomize_affine(nn.BatchNorm2d(4)).double()
    ours = NN.BatchNorm2d(4, activation="leaky_relu", negative_slope=0.2, frozen=frozen).double()
    ours.load_state_dict(theirs.state_dict())
    theirs.train(not frozen)
    x = torch.randn(5, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    z = torch.randn_like(x, requires_grad=True)
    dy = torch.randn_like(x)
    expected = F.leaky_relu(theirs(x) + z, 0.2)
    grads_expected = torch.autograd.grad(expected, [x, z, *theirs.parameters()], dy)
    with lone_replica.forced(route):
        y = ours(x, z)
    torch.testing.assert_close(y, expected, atol=1e-12, rtol=1e-12)
    for got, want in zip(torch.autograd.grad(y, [x, z, *ours.parameters()], dy), grads_expected):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert_same_state(theirs, ours, atol=1e-12, rtol=1e-12)


def compiled_graph_ops(model: nn.Module, x: torch.Tensor) -> str:
    """The forward and backward graphs (ATen level) of ``model`` compiled with fullgraph=True."""
    graphs: list[str] = []

    def keep(gm: torch.fx.GraphModule, _example_inputs):
        graphs.append(gm.code)
        return gm

    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)

    torch._dynamo.reset()
    out = torch.compile(model, fullgraph=True, backend=backend)(x)
    out.sum().backward()
    return "\n".join(graphs)


@needs_compiled
def test_under_compile_the_rule_takes_torchs() -> None:
    # Inductor fuses torch's batch norm with its neighbours; our operators are opaque to it
    net = nn.Sequential(NN.BatchNorm2d(8), nn.ReLU())
    x = large(16, 16).requires_grad_()
    with lone_replica.forced("rule"):
        assert grad_fn_name(net, x) == "ReluBackward0" and grad_fn_name(net[0], x) == "SyncBatchNormFunctionBackward"
        code = compiled_graph_ops(net, x)
        assert "batch_norm" in code and "syncbn" not in code, code
    with lone_replica.forced("ours"):
        assert "syncbn" in compiled_graph_ops(net, x)
    torch._dynamo.reset()
