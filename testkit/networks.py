"""The small networks that ``test.py`` trains side by side with their copy of our layers, and
how each copy is made: torch's layers throughout (the reference), converted by
``convert_sync_batchnorm`` or ``convert_inplace_abn``, checkpointed, or masked."""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from syncbn import nn as NN


def build_1d() -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 12, bias=False),
        nn.BatchNorm1d(12),
        nn.ReLU(),
        nn.Unflatten(1, (4, 3)),
        nn.Conv1d(4, 5, kernel_size=2, bias=False),
        nn.BatchNorm1d(5, momentum=None),
    )


def build_conv(conv: type[nn.Module], batch_norm: type[nn.Module], channels: int) -> nn.Module:
    """Conv, BN, ReLU, conv, BN of the given dimensionality."""
    return nn.Sequential(
        conv(channels, 6, kernel_size=3, padding=1, bias=False),
        batch_norm(6),
        nn.ReLU(),
        conv(6, 4, kernel_size=3, bias=False),
        batch_norm(4, momentum=None),
    )


def build_2d() -> nn.Module:
    return build_conv(nn.Conv2d, nn.BatchNorm2d, channels=3)


def build_3d() -> nn.Module:
    return build_conv(nn.Conv3d, nn.BatchNorm3d, channels=2)


def build_inplace() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 6, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(6),
        nn.LeakyReLU(0.1),
        nn.Conv2d(6, 4, kernel_size=3, bias=False),
        nn.BatchNorm2d(4, momentum=None),
        nn.ELU(0.7),
    )


def in_place(model: nn.Module) -> nn.Module:
    """Every batch norm -> activation pair an in-place layer (the reference's weights are at
    least 0.5, so that |weight| + eps can equal them)."""
    done = NN.convert_inplace_abn(model)
    if done.left_alone:
        raise RuntimeError(f"convert_inplace_abn left pairs alone: {done.left_alone}")
    return done.module


class CheckpointedSequential(nn.Sequential):
    """``nn.Sequential`` (same layers, same names) whose first ``k`` layers run under
    ``torch.utils.checkpoint`` (non-reentrant): their forward runs again in backward."""

    def __init__(self, layers: nn.Sequential, k: int) -> None:
        super().__init__(*layers)
        self.k = k

    def forward(self, x: Tensor) -> Tensor:
        layers = list(self)
        x = checkpoint(nn.Sequential(*layers[: self.k]), x, use_reentrant=False)
        for layer in layers[self.k :]:
            x = layer(x)
        return x


def checkpointed(model: nn.Module) -> nn.Module:
    """Ours, its first conv, batch norm and ReLU recomputed in backward by checkpoint."""
    return CheckpointedSequential(NN.convert_sync_batchnorm(model), 3)


class MaskedReference(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` whose statistics are those of the valid positions of ``mask`` (N, H, W),
    in torch ops on the whole batch (float32 at least): the reference of the ``masked`` case,
    converted to ours by ``convert_sync_batchnorm`` as any ``nn.BatchNorm2d``."""

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:  # type: ignore[override]
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        values = xf.movedim(1, -1)[mask]
        mean, var = values.mean(0), values.var(0, unbiased=False)
        if self.training:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.mul_(1 - factor).add_(factor * mean)
                self.running_var.mul_(1 - factor).add_(factor * values.var(0))
        shape = (1, -1, 1, 1)
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps) * self.weight.view(shape)
        return (y + self.bias.view(shape)).to(x.dtype)


class MaskedNet(nn.Module):
    """Conv2d, BatchNorm2d, ReLU, Conv2d, BatchNorm2d over padded images: ``forward(x, mask)``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 6, 3, padding=1, bias=False), MaskedReference(6)
        self.conv2, self.bn2 = nn.Conv2d(6, 4, 3, padding=1, bias=False), MaskedReference(4, momentum=None)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = torch.relu(self.bn1(self.conv1(x), mask=mask))
        return self.bn2(self.conv2(x), mask=mask)


def padded_images_mask(batch: int, size: int, generator: torch.Generator) -> Tensor:
    """(batch, size, size): sample i valid in a top-left block of at least 2 x 2, the last sample
    all padding (its replica, or rank, takes part with none)."""
    mask = torch.zeros(batch, size, size, dtype=torch.bool)
    for i in range(batch - 1):
        h, w = torch.randint(2, size + 1, (2,), generator=generator).tolist()
        mask[i, :h, :w] = True
    return mask


def masked_ours(model: nn.Module) -> nn.Module:
    """The masked network with our ``BatchNorm2d`` for each ``MaskedReference`` (same parameters
    and buffers; convert_sync_batchnorm converts torch's own classes only)."""
    for name, module in model.named_children():
        if isinstance(module, MaskedReference):
            ours = NN.BatchNorm2d(module.num_features, module.eps, module.momentum)
            ours.to(module.weight.device, module.weight.dtype).load_state_dict(module.state_dict())
            setattr(model, name, ours)
    return model
