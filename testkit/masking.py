"""What the tests of ``mask=`` share (``tests/test_masked.py``, ``tests/test_masked_sync.py``): the
float64 reference written with torch ops on the whole batch, its state stepped as
``nn.BatchNorm*``'s, one training step of ours compared with it, and the layers and masks."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from syncbn import nn as NN

CL2, CL3 = torch.channels_last, torch.channels_last_3d
TOL = dict(atol=1e-10, rtol=1e-10)


def reference(x: Tensor, mask: Tensor, weight: Tensor, bias: Tensor, eps: float, z: Tensor | None = None,
              relu: bool = False) -> tuple[Tensor, Tensor]:
    """(y, the valid values (V, C)): the statistics of x's valid positions (mask (N, *spatial)),
    every position normalized, in torch ops that autograd differentiates."""
    values = x.movedim(1, -1)[mask]
    mean, var = values.mean(0), values.var(0, unbiased=False)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + eps) * weight.view(shape) + bias.view(shape)
    y = y if z is None else y + z
    return (torch.relu(y) if relu else y), values.detach()


def full_mask(mask: Tensor, x: Tensor) -> Tensor:
    """A mask as the layers take it ((N,), (N, 1, *spatial), ...) as (N, *spatial)."""
    positions = (x.size(0), *x.shape[2:])
    if mask.dim() == x.dim():
        mask = mask.squeeze(1)
    return mask.reshape(mask.shape + (1,) * (len(positions) - mask.dim())).expand(positions)


class Reference:
    """nn.BatchNorm*'s state, stepped by :func:`reference` on the whole batch."""

    def __init__(self, layer: nn.Module) -> None:
        self.weight = layer.weight.detach().double().clone().requires_grad_()
        self.bias = layer.bias.detach().double().clone().requires_grad_()
        self.running_mean = layer.running_mean.double().clone()
        self.running_var = layer.running_var.double().clone()
        self.steps = 0
        self.momentum, self.eps = layer.momentum, layer.eps

    def __call__(self, x: Tensor, mask: Tensor, z: Tensor | None = None, relu: bool = False) -> Tensor:
        y, values = reference(x, full_mask(mask, x), self.weight, self.bias, self.eps, z, relu)
        self.steps += 1
        factor = self.momentum if self.momentum is not None else 1 / self.steps
        self.running_mean.mul_(1 - factor).add_(factor * values.mean(0))
        self.running_var.mul_(1 - factor).add_(factor * values.var(0))
        return y


def step_both(run, layer: nn.Module, ref: Reference, x: Tensor, mask: Tensor, tol: dict, z: Tensor | None = None) -> None:
    """One training step of ``run(x, mask, z)`` (our layer, however it runs) and the reference,
    compared: output, input and residual gradients, weight and bias gradients, running
    statistics and num_batches_tracked."""
    xs = x.detach().clone().requires_grad_()
    xr = x.detach().double().requires_grad_()
    zs = None if z is None else z.detach().clone().requires_grad_()
    zr = None if z is None else z.detach().double().requires_grad_()
    y = run(xs, mask, zs)
    yr = ref(xr, mask, zr, relu=layer.activation == "relu")
    grad = torch.randn(y.shape, dtype=torch.float64)
    y.backward(grad.to(y.dtype))
    yr.backward(grad)
    torch.testing.assert_close(y.double(), yr, **tol)
    torch.testing.assert_close(xs.grad.double(), xr.grad, **tol)
    if z is not None:
        torch.testing.assert_close(zs.grad.double(), zr.grad, **tol)
    torch.testing.assert_close(layer.weight.grad.double(), ref.weight.grad, **tol)
    torch.testing.assert_close(layer.bias.grad.double(), ref.bias.grad, **tol)
    torch.testing.assert_close(layer.running_mean.double(), ref.running_mean, **tol)
    torch.testing.assert_close(layer.running_var.double(), ref.running_var, **tol)
    assert int(layer.num_batches_tracked) == ref.steps
    layer.weight.grad = layer.bias.grad = ref.weight.grad = ref.bias.grad = None
    assert y.is_contiguous(memory_format=_format_of(x))


def _format_of(x: Tensor) -> torch.memory_format:
    for memory_format in (CL2, CL3):
        if x.dim() == (4 if memory_format is CL2 else 5) and x.is_contiguous(memory_format=memory_format) and not x.is_contiguous():
            return memory_format
    return torch.contiguous_format


def make_layer(shape: tuple[int, ...], dtype: torch.dtype = torch.float64, **kwargs) -> nn.Module:
    layer = {2: NN.BatchNorm1d, 3: NN.BatchNorm1d, 4: NN.BatchNorm2d, 5: NN.BatchNorm3d}[len(shape)](shape[1], **kwargs)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5), layer.bias.uniform_(-0.5, 0.5)
    return layer.to(torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype)


def random_mask(shape: tuple[int, ...], kind: str, generator: torch.Generator) -> Tensor:
    """A mask of ``kind``: 'positions' (N, *spatial), 'channel' (N, 1, *spatial), 'samples' (N,),
    'lengths' (N, T) padding after each sample's length; at least two valid positions."""
    n, spatial = shape[0], shape[2:]
    if kind == "samples":
        mask = torch.rand(n, generator=generator) > 0.4
    elif kind == "lengths":
        lengths = torch.randint(0, spatial[-1] + 1, (n,), generator=generator)
        mask = torch.arange(spatial[-1]) < lengths[:, None]
    else:
        mask = torch.rand(n, *spatial, generator=generator) > 0.45
        mask = mask.unsqueeze(1) if kind == "channel" else mask
    flat = mask.view(-1)
    flat[:2] = True
    return mask


