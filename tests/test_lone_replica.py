"""Which kernels serve a lone replica (functions/lone_replica.py): the measured table routes
each case, both routes compute what nn.BatchNorm* computes, and the override works."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch.nn import functional as F

from syncbn.functions import backend_name, lone_replica, serves_single_device
from syncbn.functions.lone_replica import CHOICES, LoneCase, layout_of, takes_our_kernels
from helpers import SmallResNet, assert_same_state, randomize_affine
from syncbn import nn as NN
from testkit.lockstep import assert_agree, train_side_by_side

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPILED = serves_single_device(torch.device("cpu"))
needs_compiled = pytest.mark.skipif(not COMPILED, reason="the compiled CPU kernels are not loaded")


def test_shipped_table_is_well_formed() -> None:
    assert lone_replica.OURS_FROM_ELEMENTS, "no measured table"
    for backend, table in lone_replica.OURS_FROM_ELEMENTS.items():
        assert backend.startswith("compiled-cpu-"), backend
        for case, threshold in table.items():
            assert isinstance(case, LoneCase), case
            assert case.stats in ("batch", "fixed") and isinstance(case.fused, bool), case
            assert isinstance(getattr(torch, case.dtype), torch.dtype), case
            assert case.layout in ("contiguous", "channels_last", "no_spatial"), case
            assert threshold is None or (isinstance(threshold, int) and threshold > 0), (case, threshold)


def test_layout_of() -> None:
    assert layout_of(torch.empty(4, 3)) == "no_spatial"
    assert layout_of(torch.empty(4, 3, 5)) == "contiguous"
    assert layout_of(torch.empty(4, 3, 5, 5)) == "contiguous"
    assert layout_of(torch.empty(4, 3, 5, 5).to(memory_format=torch.channels_last)) == "channels_last"
    assert layout_of(torch.empty(4, 3, 2, 5, 5).to(memory_format=torch.channels_last_3d)) == "channels_last"


def grad_fn_name(layer: nn.Module, x: torch.Tensor, z: torch.Tensor | None = None) -> str:
    return type((layer(x) if z is None else layer(x, z)).grad_fn).__name__


@needs_compiled
def test_route_follows_the_measured_table(monkeypatch: pytest.MonkeyPatch) -> None:
    table = {
        LoneCase("batch", False, "float32", "contiguous"): 100,
        LoneCase("batch", True, "float32", "contiguous"): None,
        LoneCase("fixed", False, "float32", "channels_last"): 1,
        LoneCase("fixed", True, "float32", "contiguous"): 100,
    }
    monkeypatch.setitem(lone_replica.OURS_FROM_ELEMENTS, backend_name(torch.device("cpu")), table)
    small, large = torch.randn(2, 3, 4, 4, requires_grad=True), torch.randn(2, 3, 5, 5, requires_grad=True)
    with lone_replica.forced("measured"):
        train, fused = NN.BatchNorm2d(3), NN.BatchNorm2d(3, activation="relu")
        frozen, frozen_fused = NN.BatchNorm2d(3, frozen=True), NN.BatchNorm2d(3, frozen=True, activation="relu")
        assert grad_fn_name(train, small) == "NativeBatchNormBackward0"  # 96 elements < 100
        assert grad_fn_name(train, large) == "SyncBatchNormFunctionBackward"  # 150 >= 100
        assert grad_fn_name(fused, large, torch.randn_like(large)) == "ReluBackward0"  # None: never ours
        assert grad_fn_name(frozen, large) == "NativeBatchNormBackward0"  # not in the table: torch's
        assert grad_fn_name(frozen, large.contiguous(memory_format=torch.channels_last)) == "FrozenBatchNormFunctionBackward"
        assert grad_fn_name(frozen_fused, small) == "ReluBackward0"
        assert grad_fn_name(frozen_fused, large) == "FrozenBatchNormFunctionBackward"
        # other dtypes are other cases: not measured here, so torch's
        assert grad_fn_name(NN.BatchNorm2d(3).double(), large.double()) == "NativeBatchNormBackward0"
        # the cumulative average takes our operators whatever the table says (see modules/batchnorm.py)
        cumulative = NN.BatchNorm2d(3, momentum=None)
        assert grad_fn_name(cumulative, small) == "SyncBatchNormFunctionBackward"
        # plain eval is torch's eval-mode batch norm, bit-exact
        assert grad_fn_name(train.eval(), large) == "NativeBatchNormBackward0"


def test_forced_routes() -> None:
    x = torch.randn(2, 3, 4, 4, requires_grad=True)
    layer = NN.BatchNorm2d(3)
    with lone_replica.forced("torch"):
        assert grad_fn_name(layer, x) == "NativeBatchNormBackward0"
        assert not takes_our_kernels(x, fixed_stats=False, fused=False)
    with lone_replica.forced("ours"):
        expected = "SyncBatchNormFunctionBackward" if COMPILED else "NativeBatchNormBackward0"
        assert grad_fn_name(layer, x) == expected
    with pytest.raises(ValueError, match="choice must be one of"):
        with lone_replica.forced("fastest"):
            pass


@pytest.mark.parametrize("route", ["ours", "torch", "measured"])
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


def run_with_override(value: str, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SYNCBN_LONE_REPLICA": value}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_environment_override() -> None:
    code = (
        "import torch; from syncbn import nn as NN\n"
        "x = torch.randn(64, 3, 8, 8, requires_grad=True)\n"
        "print(type(NN.BatchNorm2d(3)(x).grad_fn).__name__)"
    )
    assert run_with_override("torch", code).stdout.strip() == "NativeBatchNormBackward0"
    expected = "SyncBatchNormFunctionBackward" if COMPILED else "NativeBatchNormBackward0"
    assert run_with_override("OURS", code).stdout.strip() == expected
    bad = run_with_override("fastest", code)
    assert bad.returncode != 0 and f"SYNCBN_LONE_REPLICA must be one of {CHOICES}" in bad.stderr


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
def test_under_compile_the_measured_route_is_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    # Inductor fuses torch's batch norm with its neighbours; our operators are opaque to it
    table = {LoneCase("batch", False, "float32", "contiguous"): 1, LoneCase("fixed", True, "float32", "contiguous"): 1}
    monkeypatch.setitem(lone_replica.OURS_FROM_ELEMENTS, backend_name(torch.device("cpu")), table)
    net = nn.Sequential(NN.BatchNorm2d(3), NN.BatchNorm2d(3, frozen=True, activation="relu"))
    x = torch.randn(4, 3, 5, 5, requires_grad=True)
    with lone_replica.forced("measured"):
        assert grad_fn_name(net, x) == "FrozenBatchNormFunctionBackward"  # eager: the table
        code = compiled_graph_ops(net, x)
        assert "batch_norm" in code and "syncbn" not in code, code
    with lone_replica.forced("ours"):
        assert "syncbn" in compiled_graph_ops(net, x)
    torch._dynamo.reset()


def test_benchmark_rule_for_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    # benchmarks/bench_lone_replica.py: ours from the smallest size at which ours won there and
    # at every larger size (both shapes of an equal size must win)
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    from bench_lone_replica import ours_from

    def point(numel: int, ours: float, torchs: float):
        return numel, {"via ours": ours, "via torch": torchs}

    assert ours_from([point(10, 2, 1), point(100, 1, 2), point(1000, 1, 2)]) == 100
    assert ours_from([point(10, 1, 2), point(100, 2, 1), point(1000, 1, 2)]) == 1000
    assert ours_from([point(10, 1, 2), point(100, 1, 2), point(1000, 2, 1)]) is None
    assert ours_from([point(100, 1, 2), point(100, 2, 1), point(1000, 1, 2)]) == 1000
    assert ours_from([point(10, 1, 2), point(100, 1, 2)]) == 10
