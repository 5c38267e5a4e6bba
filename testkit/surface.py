"""The generated differential test of the public surface (``tests/test_generated_surface.py``): a
drawn :class:`Case` (layer kind x input x mask form x wrapper x checkpoint x fault), the two-layer
model it describes in our layers and in a float64 reference written with torch ops on the full
batch, and the participants' shares of each step's batch."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from syncbn import nn as NN
from syncbn.modules.timm_layers import SyncBatchNormAct2d
from testkit.masking import full_mask

C = 3
SENTINEL = 4096.0
"""The first value of the faulty participant's share in a fault step: how a replica knows it is the one."""
KINDS = ("bn", "fused", "abn", "inplace_abn", "frozen", "timm_relu", "timm_silu")
MASKS = (None, "positions", "channel", "samples", "leading", "broadcast", "broadcast_channel")
CHECKPOINTS = ("none", "reentrant", "nonreentrant", "unused")
FAULTS = ("none", "bad_mask", "mask_disagrees", "between", "recompute", "recompute_layer")
"""recompute: raised in a recomputation outside our layers; recompute_layer: inside layer1's call."""


@dataclass(frozen=True)
class Case:
    """One drawn call of the surface. ``sizes``: each participant's samples (replicas: the chunks
    that the wrapper cuts; ranks: their rows, 0 allowed); ``spatial``: the input's dims after C."""

    kind: str
    spatial: tuple[int, ...]
    float32: bool
    channels_last: bool
    sizes: tuple[int, ...]
    mask: str | None
    checkpoint: str
    fault: str
    faulty: int
    seed: int

    @property
    def batch(self) -> int:
        return sum(self.sizes)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.float32 else torch.float64

    @property
    def tolerance(self) -> dict[str, float]:
        return dict(atol=2e-3, rtol=2e-3) if self.float32 else dict(atol=1e-9, rtol=1e-9)

    def rows(self, participant: int) -> slice:
        start = sum(self.sizes[:participant])
        return slice(start, start + self.sizes[participant])


def _layer_class(rank: int) -> type[nn.Module]:
    return {2: NN.BatchNorm1d, 3: NN.BatchNorm1d, 4: NN.BatchNorm2d, 5: NN.BatchNorm3d}[rank]


def make_layer(kind: str, rank: int, channels: int = C) -> nn.Module:
    """Our layer of ``kind`` for an input of ``rank`` dims, its weight and bias drawn from the global generator."""
    if kind in ("bn", "frozen"):
        layer = _layer_class(rank)(channels)
    elif kind == "fused":
        layer = _layer_class(rank)(channels, activation="relu")
    elif kind in ("abn", "inplace_abn"):
        layer = (NN.ABN if kind == "abn" else NN.InPlaceABN)(channels, activation="leaky_relu", activation_param=0.01)
    else:
        layer = SyncBatchNormAct2d(channels, act_layer=nn.ReLU if kind == "timm_relu" else nn.SiLU)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-0.5, 0.5)
        layer.running_mean.uniform_(-0.5, 0.5)
        layer.running_var.uniform_(0.5, 1.5)
    return layer.freeze() if kind == "frozen" else layer


class ReferenceLayer(nn.Module):
    """A layer of ours written with torch ops on the full batch (float64): statistics over every
    position, or over a mask's valid ones; running statistics stepped as ``nn.BatchNorm*``'s."""

    def __init__(self, ours: nn.Module) -> None:
        super().__init__()
        self.weight = nn.Parameter(ours.weight.detach().double().clone())
        self.bias = nn.Parameter(ours.bias.detach().double().clone())
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            buffer = getattr(ours, name)
            self.register_buffer(name, buffer.clone() if name == "num_batches_tracked" else buffer.double().clone())
        self.eps, self.momentum, self.frozen = ours.eps, ours.momentum, getattr(ours, "frozen", False)
        self.activation = getattr(ours, "activation", None)
        self.slope = getattr(ours, "activation_param", getattr(ours, "negative_slope", 0.01))
        self.silu = isinstance(getattr(ours, "act", None), nn.SiLU)
        self.paper_scale = isinstance(ours, NN.InPlaceABN)  # its scale is |weight| + eps (docs/inplace-abn.md)

    def forward(self, x: Tensor, z: Tensor | None = None, *, mask: Tensor | None = None) -> Tensor:
        if self.training and not self.frozen:
            positions = torch.ones(x.shape[:1] + x.shape[2:], dtype=torch.bool) if mask is None else full_mask(mask, x)
            values = x.movedim(1, -1)[positions]
            mean, var = values.mean(0), values.var(0, unbiased=False)
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = self.momentum if self.momentum is not None else 1 / int(self.num_batches_tracked)
                self.running_mean.mul_(1 - factor).add_(factor * mean)
                self.running_var.mul_(1 - factor).add_(factor * var * len(values) / (len(values) - 1))
        else:
            mean, var = self.running_mean, self.running_var
        shape = (1, -1) + (1,) * (x.dim() - 2)
        weight = self.weight.abs() + self.eps if self.paper_scale else self.weight
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps) * weight.view(shape) + self.bias.view(shape)
        y = y if z is None else y + z
        if self.activation == "relu":
            return F.relu(y)
        if self.activation == "leaky_relu":
            return F.leaky_relu(y, self.slope)
        return F.silu(y) if self.silu else y


class Injected(Exception):
    """The fault that a drawn case injects between two layers or in a recomputation."""


class Net(nn.Module):
    """``layer1`` (the drawn kind) -> ``layer2`` (a plain batch norm), both under ``mask``, in the
    drawn checkpoint region; ``unused``: the region also returns an auxiliary head (a 2-channel
    batch norm of ``layer1``'s output) that the loss leaves out. ``forward(x, mask, fault)``
    returns the output, or (output, auxiliary)."""

    def __init__(self, case: Case, reference: "Net | None" = None) -> None:
        super().__init__()
        self.case, rank = case, 2 + len(case.spatial)
        if reference is None:
            self.layer1, self.layer2, self.aux = make_layer(case.kind, rank), make_layer("bn", rank), make_layer("bn", rank, 2)
        else:
            self.layer1, self.layer2, self.aux = (ReferenceLayer(m) for m in (reference.layer1, reference.layer2, reference.aux))
        self.armed = ""  # a fault step: "share" (the share that starts with SENTINEL fails), "here" (this rank fails)
        if reference is None:
            check = self.layer1._check_input

            def failing_check(input: Tensor, z: Tensor | None = None) -> None:  # inside the layer's call
                if case.fault == "recompute_layer" and _in_backward() and self._faulty(input):
                    raise Injected("out of memory in the recomputation")
                check(input, z)

            self.layer1._check_input = failing_check

    def _faulty(self, x: Tensor) -> bool:
        if self.armed == "share":
            return x.numel() > 0 and bool(x.reshape(-1)[0] == SENTINEL)
        return self.armed == "here"

    def _region(self, x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
        fault, faulty = self.case.fault, self._faulty(x)
        mask1 = mask2 = mask
        if faulty and fault == "bad_mask":  # of no shape that broadcasts, or not bool
            bad = torch.ones(x.size(0) + 2, dtype=torch.bool) if self.case.seed % 2 else torch.ones(x.shape[:1] + x.shape[2:])
            # to the first layer, checked in every mode; a frozen one meets no one, and across ranks a
            # rank failing outside every collective leaves the others to the timeout (docs/limits.md)
            if self.case.kind == "frozen" and self.armed == "here":
                mask2 = bad
            else:
                mask1 = bad
        elif faulty and fault == "mask_disagrees":
            mask1 = mask2 = None
        elif faulty and fault == "recompute" and _in_backward():
            raise Injected("out of memory in the recomputation")
        z = torch.tanh(x) if self.case.kind in ("fused", "timm_relu") else None
        h = self.layer1(x * 1.0, z, mask=mask1) if z is not None else self.layer1(x * 1.0, mask=mask1)
        if faulty and fault == "between":
            raise Injected("out of memory between the layers")
        y = self.layer2(h * 1.0, mask=mask2)
        # the head last: the region's latest synchronized call, whose backward never runs
        return y, self.aux(h[:, :2] * 1.0, mask=mask) if self.case.checkpoint == "unused" else None

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        kind = self.case.checkpoint
        if kind == "none" or isinstance(self.layer1, ReferenceLayer):
            y, aux = self._region(x, mask)
        else:
            y, aux = checkpoint(functools.partial(self._region, mask=mask), x, use_reentrant=kind == "reentrant")
        return y if aux is None else (y, aux)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def step_batch(case: Case, step: int, fault: bool) -> tuple[Tensor, Tensor | None, Tensor]:
    """Step ``step``'s full batch (float64, the case's layout), its mask (None, or the full
    batch's, or a broadcast one) and dL/dy; in a fault step the faulty share starts with SENTINEL."""
    generator = torch.Generator().manual_seed(case.seed * 100 + step)
    shape = (case.batch, C, *case.spatial)
    x = torch.randn(shape, generator=generator, dtype=torch.float64) * 2 + 1
    if fault and case.sizes[case.faulty] > 0:
        x[case.rows(case.faulty)].view(-1)[0] = SENTINEL
    if case.channels_last:
        x = x.contiguous(memory_format=torch.channels_last if len(shape) == 4 else torch.channels_last_3d)
    dy = torch.randn(shape, generator=generator, dtype=torch.float64)
    return x, make_mask(case, generator), dy


def make_mask(case: Case, generator: torch.Generator) -> Tensor | None:
    """The drawn form of mask (at least two valid positions over the batch where it has any)."""
    if case.mask is None:
        return None
    n = 1 if case.mask.startswith("broadcast") else case.batch
    shape = {"samples": (n,), "leading": (n, *case.spatial[:1])}.get(case.mask, (n, *case.spatial))
    mask = torch.rand(shape, generator=generator) > 0.35
    mask.view(-1)[:2] = True
    return mask.unsqueeze(1) if case.mask.endswith("channel") else mask


def share(mask: Tensor | None, rows: slice) -> Tensor | None:
    """A participant's part of a mask: its rows, or the whole of a broadcast (size-1) one."""
    return mask if mask is None or mask.size(0) == 1 else mask[rows]


def values_per_channel(case: Case, mask: Tensor | None) -> int:
    """How many values per channel the full batch's statistics cover."""
    x = torch.empty(case.batch, C, *case.spatial)
    return int(full_mask(mask, x).sum()) if mask is not None else x.numel() // C
