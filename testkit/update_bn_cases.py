"""What the tests of ``NN.update_bn`` share (``tests/test_update_bn_*.py``): float64 batches whose
statistics differ widely from batch to batch, a two-layer net, a model's batch norms, and the check
of the population statistics against float64 references over the concatenated data."""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from testkit.lockstep import randomize_affine


F64 = torch.float64


def batches(sizes: list[int], seed: int = 0, channels: int = 3) -> list[Tensor]:
    """float64 ``(n, C, 5, 4)`` batches whose means and scales differ widely from batch to batch,
    so that averaging per-batch variances is far from the population's variance."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, channels, 5, 4, generator=gen, dtype=F64) * (1 + i) + 4.0 * i - 3.0 for i, n in enumerate(sizes)]


def two_layer_net(bn: Callable[[int], nn.Module] = nn.BatchNorm2d, seed: int = 0) -> nn.Sequential:
    """conv -> BN -> ReLU -> conv -> BN, float64."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), bn(4), nn.ReLU(), nn.Conv2d(4, 5, 1), bn(5))
    return randomize_affine(net, seed).to(F64)


def population(x: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and unbiased variance per channel of ``(N, C, *)``."""
    dims = [0, *range(2, x.dim())]
    return x.mean(dims), x.var(dims, unbiased=True)


def bn_layers(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def assert_population(model: nn.Module, inputs: list[Tensor], calls: int, tol: float = 1e-12) -> None:
    for layer, x in zip(bn_layers(model), inputs):
        mean, var = population(x)
        torch.testing.assert_close(layer.running_mean, mean, atol=tol, rtol=tol)
        torch.testing.assert_close(layer.running_var, var, atol=tol, rtol=tol)
        assert int(layer.num_batches_tracked) == calls
