"""Synchronization across processes (torch.distributed): which group a layer syncs over, and
the two collectives of one synchronized call.

Forward: ONE all_gather of a float64 row per rank,
    [layer id, call number, dtype code, failed flag, ndim, shape (8 dims, 0-padded), count,
     mean (C), M2 (C)],
so that every rank holds every rank's (count, mean, M2) and merges them in rank order (the same
arithmetic on every rank: identical statistics, identical running stats). The header lets every
rank check, on the same gathered data and so with the same verdict, that all ranks are at the
same call of the same layer, with inputs of one dtype, and that none failed before the exchange.
The verdict, the merge, the global count and the running statistics' update are one operator
on the collective's device (``merge_gathered_stats``: where the verdict fails, nothing is
updated); nothing is read on the host per layer but where :mod:`syncbn.functions.synchronization.checks` says (at once
for CPU tensors or ``SYNCBN_CHECKS=layer``, deferred on CUDA by default).

Backward: ONE all_reduce (sum) of the float64 row [id, id^2, n, n^2, sum_dy (C), sum_dy_xmu (C)]
(layer id and call number n). All ranks agree iff count * sum(v^2) == sum(v)^2 for each of the
two (Cauchy-Schwarz), and every rank sees the same sums, so a mismatch raises on every rank.

Ranks whose layer has another number of channels send rows of another size: the backend itself
fails (Gloo aborts the process, "Received data size doesn't match expected size"). A rank that
never arrives is covered by the collective's own timeout (``init_process_group(timeout=...)``,
``new_group(timeout=...)``).
"""
from __future__ import annotations

import math
from datetime import timedelta
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from . import checks
from ..stats import mask_disagreement
from ..operators.ops import OVERLOADS

SHAPE_DIMS = 8  # input dims carried for error messages; further dims are dropped
LAYER, NUMBER, DTYPE, FAILED, NDIM, SHAPE = range(6)  # the header's columns: the first three agree
HEADER_SIZE = SHAPE + SHAPE_DIMS + 1  # and the count
IDENTITY_SIZE = 4  # the backward row's [id, id^2, n, n^2]
LAYER_ID_RANGE = 2**20  # ids and call numbers below 2**20: their squares sum exactly in float64
FAILED_IDENTITY = -(2.0**40)
"""The layer id and call number that a rank which failed in a backward pass sends: below any sum
of real ones (whose total stays above -2**40 + world * 2**20), so the sum says how many failed."""
_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
MASKED_CODE = 16
"""Added to the dtype code of a masked call's row: ranks that disagree on ``mask=`` disagree there."""


def checked_process_group(process_group: Any | None, owner: str) -> Any | None:
    """``process_group`` where it is None or a ``torch.distributed`` group; else a TypeError naming ``owner``."""
    groups = (dist.ProcessGroup,) if dist.is_available() else ()
    non_member = getattr(dist.GroupMember, "NON_GROUP_MEMBER", None) if dist.is_available() else None
    if process_group is None or isinstance(process_group, groups) or process_group is non_member:
        return process_group
    raise TypeError(
        f"{owner}: process_group must be a torch.distributed process group (dist.new_group(...), "
        f"dist.group.WORLD) or None for the default group, got {type(process_group).__name__} {process_group!r}"
    )


def active_process_group(process_group: Any | None, label: Callable[[], str]) -> Any | None:
    """The group that the layer syncs over across processes, or None within one process.

    ``process_group=None`` means the default group when it is initialized with more than one
    rank (as in PyTorch); a group of one rank needs no exchange. ``label()`` names the layer in
    errors (called only then: this runs on every training call).
    """
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        return dist.group.WORLD
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{label()}: process_group is set but torch.distributed is not initialized")
    if process_group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(process_group) < 0:
        raise RuntimeError(f"{label()}: this rank is not a member of the layer's process_group")
    return process_group if dist.get_world_size(process_group) > 1 else None


class ProcessGroupCall(NamedTuple):
    """One synchronized call of a layer across the ranks of ``group``.

    ``layer_id`` (a hash of the layer's label) and ``number`` (the layer's count of such
    calls) travel with both collectives so that ranks at different calls are told apart.
    (A named tuple: one is made per synchronized call, and a frozen dataclass costs more.)
    """

    group: Any
    layer: str
    layer_id: int
    number: int


class ProcessGroupSync:
    """Held by a layer (and shared with its replicas): counts its calls across processes.

    Copies and pickles start at zero, like a new layer.
    """

    def __init__(self) -> None:
        self._calls = 0
        self._label, self._layer_id = "", 0  # the last label and its hash

    def __reduce__(self):
        return (ProcessGroupSync, ())

    def next_call(self, group: Any, layer: str) -> ProcessGroupCall:
        if layer != self._label:
            self._label, self._layer_id = layer, layer_key(layer)
        # no reference to the group is kept: destroy_process_group must be able to free it
        call = ProcessGroupCall(group, layer, self._layer_id, self._calls)
        self._calls += 1
        return call

    def renumber(self, call: ProcessGroupCall, number: int) -> ProcessGroupCall:
        """``call`` (the last one made) as the earlier call ``number`` again, uncounted: a
        checkpoint's recomputation, which meets no one in its forward."""
        self._calls -= 1
        return call._replace(number=number)


def layer_key(layer: str) -> int:
    """A number below :data:`LAYER_ID_RANGE` that tells layers apart across ranks: a polynomial
    hash of their labels, the same in every process, in plain Python that torch.compile folds
    into a constant of its graph."""
    key = 0
    for character in layer:
        key = (key * 131 + ord(character)) % LAYER_ID_RANGE
    return key


def dtype_code(dtype: torch.dtype, masked: bool = False) -> int:
    """The header's code of an input dtype (-1 for others), plus :data:`MASKED_CODE` for a masked call."""
    return (_DTYPES.index(dtype) if dtype in _DTYPES else -1) + (MASKED_CODE if masked else 0)


def stats_header(
    key: int, number: int, dtype: torch.dtype, failed: bool, shape: Sequence, count: Any, masked: bool = False
) -> list:
    """The header of a rank's forward row, as the native call and the traced path send it: its columns (``LAYER`` ...
    ``SHAPE``) and the count last. ``shape`` and ``count`` may be symbolic under torch.compile."""
    dims = list(shape)[:SHAPE_DIMS]
    return [key, number % LAYER_ID_RANGE, dtype_code(dtype, masked), float(failed), len(shape), *dims,
            *([0] * (SHAPE_DIMS - len(dims))), count]


def _all_gather_rows(row: Tensor, group: Any) -> Tensor:
    """(world, len(row)): every rank's row, through the gather-into-one-tensor collective where
    this torch has it (Gloo and NCCL in torch >= 2.1), else the list form."""
    world = dist.get_world_size(group)
    gather_single = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
    if gather_single is not None:
        rows = row.new_empty(world * row.numel())
        gather_single(rows, row, group=group)
        return rows.view(world, row.numel())
    parts = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(parts, row, group=group)
    return torch.stack(parts)


def all_gather_rows(row: Tensor, call: ProcessGroupCall) -> Tensor:
    """(world, len(row)): every rank's ``row`` of this call (the forward's all_gather)."""
    return _all_gather_rows(row, call.group)


def all_reduce_row(row: Tensor, call: ProcessGroupCall) -> None:
    """``row`` summed over the ranks of this call, in place (the backward's all_reduce)."""
    dist.all_reduce(row, group=call.group)


def _explain_forward(call: ProcessGroupCall, heads: list[list[float]]) -> BaseException | None:
    """The error that the gathered headers (read on the host) stand for (the same on every rank:
    they all hold the same rows), or None: what ``merge_gathered_stats`` judges on the device."""
    total = sum(head[HEADER_SIZE - 1] for head in heads)
    if not (0 <= total < 2.0**63 and total == int(total)):  # NaN fails the first test
        return RuntimeError(f"{call.layer}: the ranks' gathered counts are malformed (their total is {total})")
    heads = [[int(v) for v in head] for head in heads]
    if any(head[FAILED] for head in heads):
        ranks = [rank for rank, head in enumerate(heads) if head[FAILED]]
        return RuntimeError(
            f"{call.layer}: rank(s) {ranks} of the process group failed before this exchange "
            "(their own error says why)"
        )
    if any(head[:DTYPE] != heads[0][:DTYPE] for head in heads):
        ids = [(head[LAYER], head[NUMBER]) for head in heads]
        return RuntimeError(
            f"{call.layer}: ranks are at different synchronized calls (layer id, call number per "
            f"rank: {ids}); this rank is at call {call.number} of {call.layer}. Every rank must "
            "call each synchronized layer the same number of times, in the same order."
        )
    disagreement = mask_disagreement(call.layer, [head[DTYPE] >= MASKED_CODE - 1 for head in heads], "rank")
    if disagreement is not None:
        return disagreement
    if any(head[DTYPE] != heads[0][DTYPE] for head in heads):
        codes = [h[DTYPE] % MASKED_CODE if h[DTYPE] >= 0 else -1 for h in heads]
        names = [str(_DTYPES[code]) if 0 <= code < len(_DTYPES) else "?" for code in codes]
        return RuntimeError(f"{call.layer}: ranks disagree on the input dtype: {names} (per rank)")
    if total == 1:
        shapes = ", ".join(str(tuple(head[SHAPE : SHAPE + min(head[NDIM], SHAPE_DIMS)])) for head in heads)
        return ValueError(
            f"{call.layer}: Expected more than 1 value per channel when training, got input size "
            f"{shapes} over {len(heads)} ranks"
        )
    return None


def judge_gathered(call: ProcessGroupCall, valid: Tensor, rows: Tensor) -> bool:
    """Check the gathered ``rows`` that ``merge_gathered_stats`` judged ``valid``: at once or
    deferred (:func:`syncbn.functions.synchronization.checks.verify_judged`, whose result this returns)."""
    return checks.verify_judged(valid, lambda: rows[:, :HEADER_SIZE], lambda values: _explain_forward(call, values))


def defer_gathered(call: ProcessGroupCall, valid: Tensor, headers: Tensor, ready: checks.Ready | None) -> None:
    """The forward checks, deferred: ``valid`` (``merge_gathered_stats``'s verdict)
    and the gathered rows' ``headers``, copied to host memory behind ``ready`` by the caller, read
    later as :func:`judge_gathered` would have read them."""
    checks.defer_read(headers, ready, lambda values: _explain_forward(call, values), valid)


def failed_row(key: int, number: int, channels: int, device: torch.device) -> Tensor:
    """The forward row of a rank that failed before the exchange: its failed flag, no statistics."""
    zeros = torch.zeros(channels, dtype=torch.float64, device=device)
    return OVERLOADS.pack_row(stats_header(key, number, torch.float64, True, torch.Size(), 0), zeros, zeros)


def report_failure(call: ProcessGroupCall, channels: int, device: torch.device) -> None:
    """Join the forward's all_gather with a failed flag (after a local error such as bad
    input), so that the other ranks raise at once instead of waiting for the timeout."""
    all_gather_rows(failed_row(call.layer_id, call.number, channels, device), call)


def _explain_backward(call: ProcessGroupCall, world: int, identity_sums: list[float]) -> BaseException | None:
    """The error that the summed identities ``[id, id^2, n, n^2]`` (read on the host) stand for:
    ranks that failed in this backward pass (:func:`report_backward_failure`), or the ranks' layer
    ids, or their call numbers, differ iff world * sum(v^2) != sum(v)^2 (Cauchy-Schwarz; exact in
    float64 below 2**20); or None."""
    ids, id_squares, numbers, number_squares = identity_sums
    if ids < 0:
        failed = math.ceil(ids / FAILED_IDENTITY)
        return RuntimeError(
            f"{call.layer}: {failed} rank(s) of the process group failed in this backward pass "
            "(their own error says why)"
        )
    if world * id_squares == ids**2 and world * number_squares == numbers**2:
        return None
    return RuntimeError(
        f"{call.layer}: ranks are at the backward of different synchronized calls (this rank: "
        f"call {call.number}). Every rank must run the backward of the same layers in the same order."
    )


def report_backward_failure(call: ProcessGroupCall, channels: int, device: torch.device) -> None:
    """Join the backward's all_reduce of ``call`` (the one the other ranks wait in) with the
    failed identity, after an error in this rank's backward pass, so that they raise at once."""
    zeros = torch.zeros(channels, dtype=torch.float64, device=device)
    failed = FAILED_IDENTITY
    all_reduce_row(OVERLOADS.pack_row([failed, failed**2, failed, failed**2], zeros, zeros), call)


def judge_summed(call: ProcessGroupCall, row: Tensor) -> None:
    """Check the summed identities that lead the backward's ``row``: at once or deferred
    (:func:`syncbn.functions.synchronization.checks.verify`)."""
    checks.verify(row[:IDENTITY_SIZE], lambda values: _explain_summed(call, values))


def defer_summed(call: ProcessGroupCall, identities: Tensor, ready: checks.Ready | None) -> None:
    """The backward checks, deferred: the summed ``identities`` that lead its row,
    copied to host memory behind ``ready`` by the caller, read later as :func:`judge_summed`
    would have read them."""
    checks.defer_read(identities, ready, lambda values: _explain_summed(call, values))


def _explain_summed(call: ProcessGroupCall, identity_sums: list[float]) -> BaseException | None:
    return _explain_backward(call, dist.get_world_size(call.group), identity_sums)


def native_ranks(call: ProcessGroupCall, dtype: torch.dtype, device: torch.device) -> tuple:
    """What the native call (``Ranks`` in src/ranks.h) needs of a call to build its
    rows and judge them itself: (layer id, call number, dtype code without and with a mask, world
    size, whether the checks are read at once on ``device``). The row layout is this module's
    (``row_layout()``)."""
    number = call.number % LAYER_ID_RANGE
    world = dist.get_world_size(call.group)
    codes = float(dtype_code(dtype)), float(dtype_code(dtype, masked=True))
    return float(call.layer_id), float(number), *codes, world, checks.reads_at_once(device)


def row_layout() -> tuple[int, int, int, int, int]:
    """The rows' layout as the native call takes it, once: (header size, agreeing columns, the
    failed flag's column, shape dims, identity size)."""
    return HEADER_SIZE, DTYPE + 1, FAILED, SHAPE_DIMS, IDENTITY_SIZE


def consecutive_rank_groups(group_size: int, timeout: timedelta | None = None) -> Any:
    """This rank's group when the default group is split into groups of ``group_size``
    consecutive ranks (ranks 0..k-1, k..2k-1, ...), with ``torch.distributed.new_subgroups``.

    Every rank must call it (it creates every group, in the same order, on every rank). The
    world size must be a multiple of ``group_size``. ``timeout`` is the groups' collective
    timeout (default: the backend's).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("consecutive_rank_groups: torch.distributed is not initialized")
    world = dist.get_world_size()
    if not (isinstance(group_size, int) and 0 < group_size <= world and world % group_size == 0):
        raise ValueError(f"consecutive_rank_groups: group_size must divide the world size {world}, got {group_size!r}")
    group, _ = dist.new_subgroups(group_size=group_size, timeout=timeout)
    return group
