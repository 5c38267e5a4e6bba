"""The checks of a synchronized layer's statistics (one text per message, raised for the native
call too) and the merge of counted parts (math only: the parts' tensors are on one device)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .operators.ops import OVERLOADS


def check_values_per_channel(total: int, layer: str, shapes: Sequence[Sequence[int]], parts: str = "replicas") -> None:
    """Batch statistics need more than one value per channel (torch raises ValueError too); the
    native meeting calls this where its replicas hold one value per channel, for its message."""
    if total == 1:
        sizes = ", ".join(str(tuple(s)) for s in shapes)
        raise ValueError(
            f"{layer}: Expected more than 1 value per channel when training, got input size "
            f"{sizes}" + (f" over {len(shapes)} {parts}" if len(shapes) > 1 else "")
        )


def check_valid_positions(total: int, layer: str, shapes: Sequence[Sequence[int]]) -> None:
    """Batch statistics over a mask's valid positions need more than one of them over the whole
    batch (every replica and rank): torch's one-value error, with the count of valid positions."""
    if total < 2:
        sizes = ", ".join(str(tuple(s)) for s in shapes)
        raise ValueError(
            f"{layer}: Expected more than 1 value per channel when training, got {total} valid position"
            f"{'' if total == 1 else 's'} of the mask (True: valid) over input size {sizes}"
        )


def check_inputs_agree(
    layer: str, channels: Sequence[int], dtypes: Sequence[torch.dtype], masked: Sequence[bool] = ()
) -> None:
    """The replicas' inputs have the same channels and dtype, and all or none have a mask (replica
    ``i``'s input: ``channels[i]`` channels of ``dtypes[i]``, ``masked[i]``); the native meeting
    calls this where they do not, for its message."""
    for index, (count, dtype) in enumerate(zip(channels, dtypes)):
        if count != channels[0] or dtype != dtypes[0]:
            raise RuntimeError(
                f"{layer}: replicas disagree on their input: replica 0 has "
                f"{channels[0]} channels of {dtypes[0]}, replica {index} has "
                f"{count} channels of {dtype}"
            )
    error = mask_disagreement(layer, masked, "replica")
    if error is not None:
        raise error


def mask_disagreement(layer: str, masked: Sequence[bool], parts: str) -> RuntimeError | None:
    """The error where some of the ``parts`` ('replica' or 'rank') pass a mask and others do not."""
    if all(flag == masked[0] for flag in masked):
        return None
    with_mask = [index for index, flag in enumerate(masked) if flag]
    without = [index for index, flag in enumerate(masked) if not flag]
    return RuntimeError(
        f"{layer}: {parts}s disagree on mask=: {parts}(s) {with_mask} pass a mask, {parts}(s) {without} do not; "
        f"pass one on every {parts} (an all-True mask where nothing is padded) or on none"
    )


def check_not_capturing(capturing: bool, layer: str, direction: str) -> None:
    """A synchronized step waits for other threads or ranks and reads their verdicts on the host,
    which a CUDA graph can neither capture nor replay: its ``direction`` ('forward' or
    'backward') under capture is refused, naming ``layer``, before any work."""
    if capturing:
        raise RuntimeError(
            f"{layer}: a training step synchronized across replicas or processes cannot be captured in a CUDA "
            f"graph (its {direction} meets the other replicas or ranks on the host). Capture a model whose layers "
            "run alone (no DataParallel replicas, no process group of more than one rank, or in eval mode), or "
            "run the synchronized step without capture."
        )


def merge_rows(total: int, counts: Tensor, means: Tensor, m2s: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and biased variance of the union of ``(R,)`` counts (``total`` in all, known on the
    host) and ``(R, C)`` means and M2s, with Chan's formula (the ``merge_stats`` operator); an
    all-empty union gives mean 0 and variance 1."""
    if total == 0:
        return torch.zeros_like(means[0]), torch.ones_like(means[0])
    return OVERLOADS.merge_stats(counts, means, m2s)


Running = tuple[Tensor | None, Tensor | None, Tensor | None, float | None]
"""A layer's (running_mean, running_var, num_batches_tracked, momentum)."""


def update_running_stats(running: Running, mean: Tensor, var: Tensor, count: int) -> None:
    """The running statistics' update, once per step on the master (the operator; across ranks
    it is part of ``merge_gathered_stats``: :class:`syncbn.functions.synchronization.synchronizer.Synchronizer`)."""
    OVERLOADS.update_running_stats(*running, mean, var, count)
