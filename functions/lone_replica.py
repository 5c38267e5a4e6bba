"""Which kernels serve a lone replica (one device, one process, nothing to exchange): ours or
torch's own batch norm.

A lone replica exchanges nothing, so torch's batch norm (``F.batch_norm``, then ``+ z`` and the
activation unfused) computes what ours computes; which one runs is a matter of speed alone, and
the faster one depends on the CPU, the dtype, the layout, the size and what the layer fuses. It
is decided by measurement, never by guess: ``benchmarks/bench_lone_replica.py`` times our layer
through each of the two on a ladder of sizes for every :class:`LoneCase` and prints
:data:`OURS_FROM_ELEMENTS` for the machine's backend; ``benchmarks/RESULTS.md`` keeps each run
with its CPU model, torch version and date. A case takes ours from the smallest measured size at
which ours was faster there and at every larger measured size; a case where ours never won, or
that was never measured on this backend, takes torch's, as does every case under
``torch.compile`` (see :func:`takes_our_kernels`).

``SYNCBN_LONE_REPLICA=ours`` or ``=torch`` overrides the table for the whole process (to test or
to measure); :func:`forced` does it for a block of code.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, NamedTuple

import torch
from torch import Tensor

from .backend import backend_name, serves_single_device
from .reference import memory_format_of

CHOICES = ("measured", "ours", "torch")


class LoneCase(NamedTuple):
    """What decides the kernel: ``stats`` ``'batch'`` (training) or ``'fixed'`` (frozen);
    ``fused`` whether a residual or an activation is fused; the input's dtype name; its
    ``layout``: ``'contiguous'``, ``'channels_last'`` (2d or 3d) or ``'no_spatial'`` ((N, C))."""

    stats: str
    fused: bool
    dtype: str
    layout: str


def layout_of(input: Tensor) -> str:
    """:attr:`LoneCase.layout` of ``input`` (N, C, *)."""
    if input.dim() == 2:
        return "no_spatial"
    return "contiguous" if memory_format_of(input) == torch.contiguous_format else "channels_last"


def _cases(stats: str, fused: bool, ours_from: dict[tuple[str, str], int | None]) -> dict[LoneCase, int | None]:
    return {LoneCase(stats, fused, dtype, layout): n for (dtype, layout), n in ours_from.items()}


# From how many input elements ours serves each case (None: never), per backend; cases absent
# take torch's.
OURS_FROM_ELEMENTS: dict[str, dict[LoneCase, int | None]] = {
    # Intel Xeon (AVX-512), 2 vCPUs, torch 2.13.0, 2026-11-24: two runs of bench_lone_replica.py
    # (RESULTS.md); they disagreed on 8 of the 48 cases, so each case takes the larger of the two
    # runs' thresholds, and torch's where either run said never (the rule of the AVX2 entry).
    "compiled-cpu-avx512": {
        **_cases("batch", False, {
            ("float32", "contiguous"): 401408,
            ("float32", "no_spatial"): None,
            ("float32", "channels_last"): 401408,
            ("bfloat16", "contiguous"): 6422528,
            ("bfloat16", "no_spatial"): 2097152,
            ("bfloat16", "channels_last"): 401408,
            ("float16", "contiguous"): None,
            ("float16", "no_spatial"): 2097152,
            ("float16", "channels_last"): 401408,
            ("float64", "contiguous"): 401408,
            ("float64", "no_spatial"): 2097152,
            ("float64", "channels_last"): 401408,
        }),
        **_cases("batch", True, {
            ("float32", "contiguous"): 401408,
            ("float32", "no_spatial"): 2097152,
            ("float32", "channels_last"): 401408,
            ("bfloat16", "contiguous"): 6422528,
            ("bfloat16", "no_spatial"): 131072,
            ("bfloat16", "channels_last"): 401408,
            ("float16", "contiguous"): 6422528,
            ("float16", "no_spatial"): 524288,
            ("float16", "channels_last"): 401408,
            ("float64", "contiguous"): 401408,
            ("float64", "no_spatial"): 131072,
            ("float64", "channels_last"): 32768,
        }),
        **_cases("fixed", False, {
            ("float32", "contiguous"): None,
            ("float32", "no_spatial"): None,
            ("float32", "channels_last"): 6422528,
            ("bfloat16", "contiguous"): 6422528,
            ("bfloat16", "no_spatial"): 2097152,
            ("bfloat16", "channels_last"): 401408,
            ("float16", "contiguous"): 6422528,
            ("float16", "no_spatial"): None,
            ("float16", "channels_last"): 1605632,
            ("float64", "contiguous"): 6422528,
            ("float64", "no_spatial"): None,
            ("float64", "channels_last"): 6422528,
        }),
        **_cases("fixed", True, {
            ("float32", "contiguous"): 6422528,
            ("float32", "no_spatial"): 524288,
            ("float32", "channels_last"): 401408,
            ("bfloat16", "contiguous"): 6422528,
            ("bfloat16", "no_spatial"): 131072,
            ("bfloat16", "channels_last"): 401408,
            ("float16", "contiguous"): 6422528,
            ("float16", "no_spatial"): 524288,
            ("float16", "channels_last"): 401408,
            ("float64", "contiguous"): 6422528,
            ("float64", "no_spatial"): 131072,
            ("float64", "channels_last"): 401408,
        }),
    },
    # AMD EPYC, 2 vCPUs, torch 2.13.0, 2026-11-23: two runs of bench_lone_replica.py (RESULTS.md);
    # the two runs disagreed on 20 of the 48 cases (a VM with bursts of steal time), so each case
    # takes the larger of the two runs' thresholds, and torch's where either run said never.
    "compiled-cpu-avx2": {
        **_cases("batch", False, {
            ("float32", "contiguous"): 401408,
            ("float32", "no_spatial"): None,
            ("float32", "channels_last"): None,
            ("bfloat16", "contiguous"): None,
            ("bfloat16", "no_spatial"): None,
            ("bfloat16", "channels_last"): 6422528,
            ("float16", "contiguous"): None,
            ("float16", "no_spatial"): None,
            ("float16", "channels_last"): 6422528,
            ("float64", "contiguous"): 6422528,
            ("float64", "no_spatial"): 2097152,
            ("float64", "channels_last"): 1605632,
        }),
        **_cases("batch", True, {
            ("float32", "contiguous"): 401408,
            ("float32", "no_spatial"): 2097152,
            ("float32", "channels_last"): 6422528,
            ("bfloat16", "contiguous"): 6422528,
            ("bfloat16", "no_spatial"): 524288,
            ("bfloat16", "channels_last"): 401408,
            ("float16", "contiguous"): 6422528,
            ("float16", "no_spatial"): 2097152,
            ("float16", "channels_last"): 1605632,
            ("float64", "contiguous"): 401408,
            ("float64", "no_spatial"): 524288,
            ("float64", "channels_last"): 401408,
        }),
        **_cases("fixed", False, {
            ("float32", "contiguous"): 6422528,
            ("float32", "no_spatial"): 2097152,
            ("float32", "channels_last"): 6422528,
            ("bfloat16", "contiguous"): None,
            ("bfloat16", "no_spatial"): None,
            ("bfloat16", "channels_last"): 6422528,
            ("float16", "contiguous"): 6422528,
            ("float16", "no_spatial"): None,
            ("float16", "channels_last"): 6422528,
            ("float64", "contiguous"): 6422528,
            ("float64", "no_spatial"): 2097152,
            ("float64", "channels_last"): 6422528,
        }),
        **_cases("fixed", True, {
            ("float32", "contiguous"): 401408,
            ("float32", "no_spatial"): 524288,
            ("float32", "channels_last"): 401408,
            ("bfloat16", "contiguous"): 6422528,
            ("bfloat16", "no_spatial"): 524288,
            ("bfloat16", "channels_last"): 401408,
            ("float16", "contiguous"): 6422528,
            ("float16", "no_spatial"): 2097152,
            ("float16", "channels_last"): 401408,
            ("float64", "contiguous"): 401408,
            ("float64", "no_spatial"): 131072,
            ("float64", "channels_last"): 401408,
        }),
    },
}

_forced: str = os.environ.get("SYNCBN_LONE_REPLICA", "measured").lower()
if _forced not in CHOICES:
    raise ValueError(f"SYNCBN_LONE_REPLICA must be one of {CHOICES}, got {_forced!r}")


@contextlib.contextmanager
def forced(choice: str) -> Iterator[None]:
    """Within the block, a lone replica takes ``choice``: ``'ours'`` (where our kernels are
    compiled for the device), ``'torch'``, or ``'measured'`` (the table). Process-wide, not
    per thread; ``torch.compile`` guards on it (a change recompiles)."""
    global _forced
    if choice not in CHOICES:
        raise ValueError(f"choice must be one of {CHOICES}, got {choice!r}")
    before, _forced = _forced, choice
    try:
        yield
    finally:
        _forced = before


def takes_our_kernels(input: Tensor, *, fixed_stats: bool, fused: bool) -> bool:
    """Whether a lone replica's ``input`` runs through our kernels (else torch's batch norm).
    Runs on every call of a lone layer: kept to a few dictionary lookups."""
    # our kernels serve a lone replica on the CPU only (backend.serves_single_device); is_cpu
    # and a backend looked up once: torch.device.type costs ~0.4 us a call
    if _forced == "torch" or not (input.is_cpu and _CPU_SERVES):
        return False
    if _forced == "ours":
        return True
    if torch.compiler.is_compiling():
        # Inductor decomposes torch's batch norm and fuses it with the pointwise ops around it
        # (ReLU, residual adds) in layouts of its choosing; our operators are opaque calls
        # between its kernels. Measured (AMD EPYC, 2026-11-23; RESULTS.md): a small ResNet's
        # compiled training step took 65.4 / 64.3 ms through our operators and 54.0 / 58.0 ms
        # through torch's batch norm (two runs of 10 interleaved rounds).
        return False
    table = OURS_FROM_ELEMENTS.get(_CPU_BACKEND)
    if not table:
        return False
    dtype = _DTYPE_NAMES.get(input.dtype) or str(input.dtype).removeprefix("torch.")
    # a plain tuple: equal to the LoneCase (and hashed alike), cheaper to build
    threshold = table.get(("fixed" if fixed_stats else "batch", fused, dtype, layout_of(input)))  # type: ignore[call-overload]
    return threshold is not None and input.numel() >= threshold


_DTYPE_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16)}
_CPU_SERVES = serves_single_device(torch.device("cpu"))
_CPU_BACKEND = backend_name(torch.device("cpu"))
