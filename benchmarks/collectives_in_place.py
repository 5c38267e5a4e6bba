"""torch's unsynced batch norm making our layer's two collectives where ours makes them, and
those collectives alone: what the collectives cost in a step, apart from our own work
(``bench_sync_overhead.py``'s DDP rows). Needs a process group."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from syncbn.functions.synchronization import distributed


def layer_rows(channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero rows of the sizes that a layer of ``channels`` sends: the forward's statistics row
    (header, mean, M2) and the backward's sums row (identities, sum_dy, sum_dy_xmu), float64."""
    return (
        torch.zeros(distributed.HEADER_SIZE + 2 * channels, dtype=torch.float64),
        torch.zeros(distributed.IDENTITY_SIZE + 2 * channels, dtype=torch.float64),
    )


def collectives_alone(channels: int) -> Callable[[], None]:
    """The two collectives of a layer of ``channels``: the all_gather of its statistics row and
    the all_reduce of its backward sums."""
    row, sums = layer_rows(channels)

    def both() -> None:
        distributed._all_gather_rows(row, None)  # as our layer gathers (all_gather_single where torch has it)
        dist.all_reduce(sums)

    return both


class _CollectivesInPlace(torch.autograd.Function):
    """The identity, making a layer's two collectives where ours makes them: the all_gather of a
    statistics row in the forward, the all_reduce of the sums row in the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        row, ctx.sums = layer_rows(x.shape[1])
        distributed._all_gather_rows(row, None)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        dist.all_reduce(ctx.sums)
        return grad


class BatchNormWithCollectives(nn.BatchNorm2d):
    """torch's unsynced layer making our layer's two collectives at the same points of the step:
    the collectives as they cost in place, with the ranks' skew between them, without our work."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(_CollectivesInPlace.apply(x))
