"""Uneven inputs across ranks (``syncbn.parallel.join``): what a rank that has run out of batches
needs to shadow the others' steps, and the collectives the join adds to torch's.

A rank that has joined runs the model's forward and backward on an *empty* batch shaped like its
last one (:func:`empty_batch`): each synchronized layer then sends a row of count 0 through the
same all_gather and all_reduce as the ranks still training, so the merged statistics are those of
the ranks with data alone, and DDP's gradient buckets meet zeros. Each step of the ranks still
training adds, besides torch's join notice, one async all_reduce that tells a joined rank what
kind of step to shadow (:func:`announce_step`, :func:`step_kind`: with or without gradients,
reduced or under ``no_sync()``, under which autocast dtype). Two collectives are added once per
join:

- the *verdict* (:func:`exchange_verdicts`), the first collective of every rank inside the join
  (a rank with a batch sends it at its first step, a rank without one when it leaves the loop):
  one all_reduce (sum) of a ``[world, 1 + MESSAGE]`` int32 table in which each rank fills its own
  row with whether it had a batch and whether the model takes the empty batch
  (:func:`probe_empty_batch`), so that every rank raises the same error at once where one of them
  could not shadow, instead of a rank failing alone in a later step while the others wait;
- the final model (:func:`broadcast_final_model`): one all_reduce (max) that picks the highest
  rank among the last to join, and one broadcast per dtype of its parameters and buffers.
"""
from __future__ import annotations

import os
import traceback
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..torch_internals import divide_ddp_gradients_by, tree_flatten, tree_unflatten, uncompiled

HAD_BATCH, EXAMPLE, NO_EXAMPLE, REJECTED = 1, 2, 3, 4
"""A rank's verdict: it had a batch (and the model takes the empty one); it had none but an example
input that the model takes; it had none and no example; the model rejects the empty batch."""
MESSAGE = 240  # bytes of a rank's explanation carried in the verdict
_TORCH_DIR = os.path.dirname(torch.__file__)


def empty_batch(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The arguments of a call with every tensor of at least one dimension cut to 0 rows along
    dim 0 (the batch; dtype, device, trailing shape and memory format kept, nothing of the data
    held); other arguments are kept as they are."""
    leaves, structure = tree_flatten((tuple(args), dict(kwargs)))
    cut = [x[:0].clone() if isinstance(x, Tensor) and x.dim() > 0 else x for x in leaves]
    return tree_unflatten(cut, structure)


def divide_by_ranks_not_joined(ddp: nn.Module, notice: Any) -> None:
    """Have DDP average this step's gradients over the ranks that have not joined: the sum of
    ``notice``, torch's join notice (an async all_reduce of 1 per rank still training)."""
    divide_ddp_gradients_by(ddp, notice)


_AUTOCAST = (None, torch.float16, torch.bfloat16)  # the autocast dtypes a step may run under, None: off


def announce_step(ddp: nn.Module) -> tuple[Any, Tensor]:
    """On a rank still training, at each step: whether its step computes gradients, whether DDP
    reduces them (not under ``no_sync()``), and its autocast dtype on the model's device type, in
    one async all_reduce (sum) that a joined rank reads (:func:`step_kind`). The work and its
    tensor, to keep until the next step."""
    device_type = ddp.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    if dtype not in _AUTOCAST:
        raise ValueError(f"syncbn.parallel.join shadows steps under autocast to float16 or bfloat16, not {dtype}")
    flags = [int(torch.is_grad_enabled()), int(ddp.require_backward_grad_sync)] + [int(dtype is d) for d in _AUTOCAST]
    tensor = torch.tensor(flags, device=ddp.device)
    return dist.all_reduce(tensor, group=ddp.process_group, async_op=True), tensor


def step_kind(ddp: nn.Module) -> tuple[bool, bool, torch.dtype | None]:
    """On a joined rank, at each step it shadows: (gradients computed, gradients reduced, the
    autocast dtype or None) of the ranks still training, which all run the same loop (the
    matching all_reduce, sending zeros)."""
    flags = torch.zeros(2 + len(_AUTOCAST), dtype=torch.int64, device=ddp.device)
    dist.all_reduce(flags, group=ddp.process_group)
    grad, sync, *autocast = flags.tolist()
    return grad > 0, sync > 0, next((d for d, n in zip(_AUTOCAST, autocast) if n > 0), None)


def output_tensors(output: Any) -> list[Tensor]:
    """The floating tensors of a model's output (any nesting of tuples, lists and dicts), in order."""
    return [x for x in tree_flatten(output)[0] if isinstance(x, Tensor) and x.is_floating_point()]


@contextmanager
def norms_in_eval(model: nn.Module) -> Iterator[None]:
    """Every batch norm of ``model`` (torch's, torch's SyncBatchNorm, ours) in eval mode for the
    block, its own mode restored after: in eval they communicate with no one and update nothing."""
    norms = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    modes = [m.training for m in norms]
    try:
        for m in norms:
            m.training = False
        yield
    finally:
        for m, mode in zip(norms, modes):
            m.training = mode


def probe_empty_batch(
    model: nn.Module, args: Sequence[Any], kwargs: dict[str, Any], device: torch.device | None = None
) -> str | None:
    """Run ``model`` (unwrapped from torch.compile) on the empty batch ``args, kwargs`` (its
    tensors moved to ``device`` where given, as DDP with ``device_ids`` moves them) without
    gradients and with its batch norms in eval (:func:`norms_in_eval`): no collective, no state
    changed. None where it runs; else what failed, and where: the innermost module running and
    the model's source line that raised."""
    model = uncompiled(model)
    if device is not None:
        leaves, structure = tree_flatten((tuple(args), dict(kwargs)))
        args, kwargs = tree_unflatten([x.to(device) if isinstance(x, Tensor) else x for x in leaves], structure)
    running: list[str] = []
    names = {m: name or type(model).__name__ for name, m in model.named_modules()}
    hooks = [
        handle
        for m in names
        for handle in (
            m.register_forward_pre_hook(lambda m, _: running.append(names[m])),
            m.register_forward_hook(lambda m, _i, _o: running.pop() and None),
        )
    ]
    try:
        with torch.no_grad(), norms_in_eval(model):
            model(*args, **kwargs)
        return None
    except Exception as error:  # noqa: BLE001 - the verdict tells every rank
        where = running[-1] if running else names[model]
        return f"in module '{where}' ({_source_line(error)}): {type(error).__name__}: {_first_line(error)}"
    finally:
        for handle in hooks:
            handle.remove()


def _source_line(error: BaseException) -> str:
    """The last frame of the traceback outside torch: the user's line that called the failing op."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(_TORCH_DIR)]
    if not frames:
        return "inside torch"
    frame = frames[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno}: {(frame.line or '').strip()}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def exchange_verdicts(verdict: int, message: str, group: Any, device: torch.device) -> list[tuple[int, int, str]]:
    """Every rank's ``(rank, verdict, message)``, in rank order, from one all_reduce (sum) of a
    table in which each rank fills its own row (the message's first :data:`MESSAGE` bytes)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    table = torch.zeros(world, 1 + MESSAGE, dtype=torch.int32)
    text = message.encode()[:MESSAGE]
    table[rank, 0] = verdict
    table[rank, 1 : 1 + len(text)] = torch.tensor(list(text), dtype=torch.int32)
    summed = table.to(device)
    dist.all_reduce(summed, group=group)
    rows = summed.cpu().tolist()
    return [(r, row[0], bytes(row[1:]).rstrip(b"\0").decode(errors="replace")) for r, row in enumerate(rows)]


def refusals(verdicts: list[tuple[int, int, str]]) -> list[str]:
    """What keeps the ranks from shadowing one another, one line per rank that cannot (empty where
    none; a rank without a batch or an example matters only where another rank has a batch)."""
    anyone_has_data = any(v in (HAD_BATCH, REJECTED) for _, v, _ in verdicts)
    lines = []
    for rank, verdict, message in verdicts:
        if verdict == REJECTED:
            lines.append(f"rank {rank}: the model rejects an empty batch {message}")
        elif verdict == NO_EXAMPLE and anyone_has_data:
            lines.append(f"rank {rank}: it had no batch to shape its empty one on, and no example_input=")
    return lines


def broadcast_final_model(module: nn.Module, is_last_joiner: bool, group: Any, device: torch.device, skip: set[str]) -> int:
    """Make ``module``'s parameters and buffers (but those named in ``skip``) those of the highest
    rank among the last to join, on every rank: one all_reduce (max), then one broadcast per dtype.
    Returns that rank (in ``group``)."""
    candidate = torch.tensor([dist.get_rank(group) if is_last_joiner else -1], device=device)
    dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=group)
    source = int(candidate.item())
    tensors = [t for name, t in (*module.named_parameters(), *module.named_buffers()) if name not in skip]
    by_dtype: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for same in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            dist.broadcast(flat, group=group, group_src=source)
            for t, part in zip(same, flat.split([t.numel() for t in same])):
                t.copy_(part.view_as(t))
    return source
