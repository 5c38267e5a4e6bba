r"""Population statistics of a batch norm's input: per channel, the count, mean and M2 of every
value it saw over many batches, merged over the ranks of a process group (what
:func:`syncbn.modules.population.update_bn` collects).

The math, for one channel: batch ``b`` gives its count ``n_b``, mean ``m_b`` and
``M2_b = sum (x - m_b)^2`` (the ``local_stats`` operator, float64 whatever the input dtype), and
Chan's parallel formula merges parts without ever forming E[x^2] - E[x]^2 (the ``merge_stats``
operator, through :func:`syncbn.functions.stats.merge_rows`):

.. math::
    n = \sum_b n_b, \quad m = \frac{1}{n} \sum_b n_b m_b, \quad
    M2 = \sum_b M2_b + \sum_b n_b (m_b - m)^2.

Batches are merged into a running part as they come (two rows at a time); across ranks, ONE
all_gather of a float64 row per rank carries every layer's part,
    ``[failed, layers, channels, (count, calls, mean (C), M2 (C)) per layer]``,
and every rank merges the gathered rows in rank order with the same arithmetic, so every rank
ends with the same bits. The population's unbiased variance is ``M2 / (n - 1)``.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .devices import host_values_on
from .operators.ops import OVERLOADS
from .operators.reference import STATS_DTYPE, values_per_channel
from .stats import merge_rows
from .synchronization.distributed import _all_gather_rows

HEADER = 3  # [failed, layers, channels]: a rank that failed, and the model's shape, per row
PART_HEAD = 2  # [count, calls] before each layer's mean and M2


class Population:
    """One layer's running part: count, calls, mean and M2 of every value of every input seen.

    ``add`` is thread-safe: replicas of a wrapper nested in the model share the layer's hooks.
    """

    def __init__(self, channels: int) -> None:
        self.channels = channels
        self.count = 0  # values per channel
        self.calls = 0  # inputs seen, empty ones included
        self.mean: Tensor | None = None  # (C,) float64, None until a non-empty input
        self.m2: Tensor | None = None  # (C,) float64
        self._lock = threading.Lock()

    def add(self, x: Tensor, mask: Tensor | None = None) -> None:
        """Merge the values of ``x`` ``(N, C, *)`` into the part (Chan's formula); with a
        ``mask`` (bool ``(N, *spatial)``, True where valid), its valid positions only."""
        if mask is None:
            mean, m2 = OVERLOADS.local_stats(x.detach())
            count = values_per_channel(x)
        else:
            mean, m2, valid = OVERLOADS.masked_local_stats(x.detach(), mask)
            count = int(valid.item())  # one host read per batch: a pass over a loader, not a training step
        with self._lock:
            self.calls += 1
            if count == 0:
                return
            if self.mean is None or self.m2 is None:
                self.count, self.mean, self.m2 = count, mean, m2
                return
            total = self.count + count
            counts = host_values_on([self.count, count], self.mean.device)
            rows = torch.stack([self.mean, mean.to(self.mean.device)]), torch.stack([self.m2, m2.to(self.m2.device)])
            merged, var = merge_rows(total, counts, *rows)
            # merge_stats returns M2 / n: times n, M2 again, to within an ulp
            self.count, self.mean, self.m2 = total, merged, var * total

    def row(self, device: torch.device) -> Tensor:
        """``[count, calls, mean (C), M2 (C)]`` float64 on ``device``; zeros where nothing was seen."""
        head = host_values_on([self.count, self.calls], device)
        if self.mean is None or self.m2 is None:
            return torch.cat([head, torch.zeros(2 * self.channels, dtype=STATS_DTYPE, device=device)])
        return torch.cat([head, self.mean.to(device), self.m2.to(device)])


@dataclass(frozen=True)
class Merged:
    """One layer's population over every rank: ``count`` values per channel in ``calls`` inputs,
    their ``mean`` and unbiased ``var`` ``(C,)`` float64 (None both where ``count`` is 0)."""

    count: int
    calls: int
    mean: Tensor | None
    var: Tensor | None


def group_device(group: Any | None) -> torch.device:
    """Where the collective's tensor lives: the CPU for Gloo (or no group), else the current
    device of the accelerator the backend serves (NCCL: the current CUDA device)."""
    if group is None:
        return torch.device("cpu")
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend:  # also "cpu:gloo,cuda:nccl"
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def pack(parts: Sequence[Population], failed: bool, device: torch.device) -> Tensor:
    """This rank's row: :data:`HEADER`, then each part's :meth:`Population.row`."""
    head = host_values_on([float(failed), len(parts), sum(part.channels for part in parts)], device)
    return torch.cat([head, *(part.row(device) for part in parts)])


def share(parts: Sequence[Population], group: Any | None, failed: bool = False) -> Tensor:
    """``(R, L)``: every rank's :func:`pack` row, from ONE all_gather over ``group`` (``R = 1``
    without a group: this process's row). Every rank of the group must call it once."""
    row = pack(parts, failed, group_device(group))
    if group is None:
        return row.unsqueeze(0)
    return _all_gather_rows(row, group)


def merge_ranks(rows: Tensor, parts: Sequence[Population]) -> list[Merged]:
    """Each layer's population over the rows of :func:`share`, merged in row (rank) order.

    Raises RuntimeError on every rank alike where a rank failed or the ranks' models differ.
    """
    starts = _part_starts(parts)
    columns = [0, 1, 2, *(column for start in starts for column in (start, start + 1))]
    heads = rows[:, columns].tolist()  # one host read: the counts decide the merge
    _check_heads(heads)
    merged = []
    for index, (part, start) in enumerate(zip(parts, starts)):
        counts = [head[HEADER + 2 * index] for head in heads]
        calls = int(sum(head[HEADER + 2 * index + 1] for head in heads))
        merged.append(_merge_part(rows, start, part.channels, counts, calls))
    return merged


def _part_starts(parts: Sequence[Population]) -> list[int]:
    """The column where each part's ``[count, calls, mean, M2]`` starts in a row."""
    starts, start = [], HEADER
    for part in parts:
        starts.append(start)
        start += PART_HEAD + 2 * part.channels
    return starts


def _check_heads(heads: list[list[float]]) -> None:
    """Every rank ran its pass and holds the same layers, or a RuntimeError names who did not."""
    failed = [rank for rank, head in enumerate(heads) if head[0] != 0]
    if failed:
        raise RuntimeError(f"update_bn: rank(s) {failed} of the process group failed during their pass over the data")
    shapes = {(head[1], head[2]) for head in heads}
    if len(shapes) > 1:
        found = ", ".join(f"rank {rank}: {int(head[1])} layers, {int(head[2])} channels" for rank, head in enumerate(heads))
        raise RuntimeError(f"update_bn: the ranks' models have different batch norm layers ({found})")


def _merge_part(rows: Tensor, start: int, channels: int, counts: list[float], calls: int) -> Merged:
    """One layer's columns of ``rows`` merged: Chan's formula over the ranks, then M2 / (n - 1)."""
    total = int(sum(counts))
    if total == 0:
        return Merged(0, calls, None, None)
    # columns of the rows: made contiguous for the kernels
    means = rows[:, start + PART_HEAD : start + PART_HEAD + channels].contiguous()
    m2s = rows[:, start + PART_HEAD + channels : start + PART_HEAD + 2 * channels].contiguous()
    mean, var = merge_rows(total, rows[:, start].contiguous(), means, m2s)
    # biased -> unbiased as update_running_stats does it; one value per channel has no variance
    unbiased = var * (total / (total - 1)) if total > 1 else var
    return Merged(total, calls, mean, unbiased)
