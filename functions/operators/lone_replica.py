"""Which kernels serve a lone replica (one device, one process, nothing to exchange): ours or
torch's own batch norm.

A lone replica exchanges nothing, so torch's batch norm (``F.batch_norm``, then ``+ z`` and the
activation unfused) computes what ours computes; which one runs is a matter of speed alone. The
rule (:func:`takes_our_kernels`): our kernels serve a lone replica where

1. our compiled CPU kernels serve its device (torch's batch norm serves every other device),
2. nothing is compiling (Inductor fuses torch's batch norm with the ops around it; ours would be
   opaque calls between its kernels),
3. the layer computes batch statistics (training; frozen layers are one multiply-add, torch's
   is as fast),
4. the input is float32 or float64, contiguous (N, C, *) with at least one spatial dimension,
   and holds at least :data:`LARGE_INPUT` elements.

Everywhere else torch's batch norm serves. ``benchmarks/bench_lone_replica.py`` times both
routes and the rule's choice against ``nn.BatchNorm*`` on a ladder of sizes for every dtype,
layout and fused or not: where the rule takes ours, ours was clearly faster (large NCHW inputs,
where one pass of our kernels replaces torch's two); elsewhere the two were within noise of each
other or torch's was faster. :func:`forced` overrides the rule for a block of code (to test or to
measure).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor

from . import backend

CHOICES = ("rule", "ours", "torch")
LARGE_INPUT = 400_000
"""Elements from which our kernels serve a lone replica's NCHW input (about 8 x 64 x 28 x 28)."""
_OUR_DTYPES = (torch.float32, torch.float64)
_forced = "rule"


@contextlib.contextmanager
def forced(choice: str) -> Iterator[None]:
    """Within the block, a lone replica takes ``choice``: ``'ours'`` (where our compiled kernels
    serve the device), ``'torch'``, or ``'rule'`` (the default). Process-wide, not per thread;
    ``torch.compile`` guards on it (a change recompiles)."""
    global _forced
    if choice not in CHOICES:
        raise ValueError(f"choice must be one of {CHOICES}, got {choice!r}")
    before, _forced = _forced, choice
    try:
        yield
    finally:
        _forced = before


def takes_our_kernels(input: Tensor, *, fixed_stats: bool) -> bool:
    """Whether a lone replica's ``input`` (N, C, *) runs through our kernels, else torch's batch
    norm (the module docstring's rule); ``fixed_stats``: the layer normalizes with its running
    statistics (frozen)."""
    if _forced == "torch" or not (input.is_cpu and backend.SERVING["cpu"] == "compiled"):
        return False
    if _forced == "ours":
        return True
    return (
        not fixed_stats
        and not torch.compiler.is_compiling()
        and input.dtype in _OUR_DTYPES
        and input.dim() > 2
        and input.numel() >= LARGE_INPUT
        and input.is_contiguous()
    )
