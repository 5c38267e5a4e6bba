"""Our layers under FSDP2 (``fully_shard``) with a bf16 parameter policy, 2 Gloo ranks: torch's
``nn.BatchNorm2d`` refuses the bf16 parameters beside its float32 running statistics; ours runs,
keeps float32 running statistics, and matches the float64 full batch within bf16's rounding: the
output within the spread that rounding alone makes (the float64 model with bf16 rounding where the
policy puts it, both ways), the running statistics and each gradient alike."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from syncbn import nn as NN
from testkit.ddp_lockstep import conv_bn_2d, rank_slice
from testkit.lockstep import randomize_affine
from testkit.process_sets import across_processes, process_sets  # noqa: F401 - the fixture of the tests it makes

U = 2.0**-8  # bf16's unit roundoff
SIZES = [4, 3]


class RoundedToBf16(torch.autograd.Function):
    """Rounding to bf16 (kept in float64) in forward, and of the gradient in backward: where
    a bf16 tensor of the policy stands, in both directions."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # noqa: ANN001
        return x.to(torch.bfloat16).double()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # noqa: ANN001
        return grad.to(torch.bfloat16).double()


bf16 = RoundedToBf16.apply


def rounded_forward(model: nn.Sequential, x: Tensor) -> Tensor:
    """``model`` (float64, conv/BN/ReLU) with bf16 rounding where the policy puts it: the input,
    the parameters, each layer's output; the statistics exact, as ours accumulates in float32."""
    x = bf16(x)
    for layer in model:
        if isinstance(layer, nn.Conv2d):
            x = bf16(F.conv2d(x, bf16(layer.weight), None, layer.stride, layer.padding))
        elif isinstance(layer, nn.BatchNorm2d):
            layer.num_batches_tracked += 1
            momentum = layer.momentum if layer.momentum is not None else 1.0 / float(layer.num_batches_tracked)
            x = bf16(F.batch_norm(x, layer.running_mean, layer.running_var, bf16(layer.weight), bf16(layer.bias), True, momentum, layer.eps))
        else:
            x = layer(x)
    return x


def sharded(convert: bool) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = copy.deepcopy(randomize_affine(conv_bn_2d()))
    model = NN.convert_sync_batchnorm(model) if convert else model
    return fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))


def assert_within(ours: Tensor, exact: Tensor, allowed: float, what: str) -> None:
    error = float((ours.double() - exact).abs().max())
    assert error <= allowed, f"{what}: {error:.3g} off, {allowed:.3g} allowed"


@across_processes(2)
def test_fsdp2_bf16_parameters(rank: int, world: int) -> None:
    rows = rank_slice(SIZES, rank)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(SIZES), 3, 4, 5, generator=gen, dtype=torch.float64) * 3 + 1
    dy = torch.randn(sum(SIZES), 5, 4, 5, generator=gen, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="expected scalar type BFloat16 but found Float"):
        sharded(convert=False)(x[rows].float())

    torch.manual_seed(0)
    exact = randomize_affine(conv_bn_2d()).double()
    rounded, ours = copy.deepcopy(exact), sharded(convert=True)
    y = ours(x[rows].float())
    y_exact = exact(x)
    y_rounded = rounded_forward(rounded, x)
    assert y.dtype == torch.bfloat16
    spread = float((y_rounded - y_exact).detach().abs().max())
    assert_within(y, y_rounded[rows], 2 * U * float(y_exact.abs().max()), "output against the rounded float64 model")
    assert_within(y, y_exact[rows], 1.5 * spread, "output against the float64 model")
    for name, buffer in ours.named_buffers():
        if name.endswith(("running_mean", "running_var")):
            assert buffer.dtype == torch.float32, name
            exact_buffer, rounded_buffer = exact.get_buffer(name), rounded.get_buffer(name)
            allowed = 2 * float((rounded_buffer - exact_buffer).abs().max()) + 1e-6
            assert_within(buffer, exact_buffer, allowed, name)

    (y.float() * bf16(dy[rows]).float()).sum().backward()
    (y_exact * dy).sum().backward()
    (y_rounded * dy).sum().backward()
    for (name, p), q, r in zip(ours.named_parameters(), exact.parameters(), rounded.parameters()):
        grad = p.grad.full_tensor().double() * world  # FSDP2 averages over the ranks
        assert p.grad.dtype == torch.float32, name
        assert_within(grad, q.grad, 2 * float((r.grad - q.grad).abs().max()), f"{name} gradient")
