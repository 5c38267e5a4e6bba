"""``syncbn.parallel.join(ddp_model)``: DDP training on uneven inputs with synchronized batch norm.

torch's ``Join([ddp])`` lets ranks that ran out of batches shadow DDP's gradient all_reduces, but
not the all_gather and all_reduce that every synchronized batch norm sends in each step: the ranks
wait in different collectives until the group's timeout. Here a rank that has joined shadows a
whole step instead: torch's :class:`~torch.distributed.algorithms.join.Join` runs the loop, and
our :class:`~torch.distributed.algorithms.join.Joinable`'s hook runs the same DDP model forward and
backward on an *empty* batch shaped like the rank's last one, its gradients cleared first, so that
every collective of ours and of DDP's comes in the same order as on the ranks still training.

Per step, with ``W`` ranks of which ``J`` have joined:

- statistics: the joined ranks send count 0, so the merged (count, mean, M2) is Chan's merge over
  the ``W - J`` ranks with data: exactly the statistics of their concatenated batches;
  ``running_mean/var`` and ``num_batches_tracked`` are updated on every rank alike (the merge is
  the same arithmetic everywhere), so they stay equal;
- gradients: the joined ranks' backward sums ``sum_dy``, ``sum_dy_xmu`` are zeros, and DDP
  averages the buckets over ``W`` (``divide_by_initial_world_size=True``, torch's default) or
  over ``W - J``, as torch's ``Join`` does; a step of the ranks still training that computes no
  gradients, or does not reduce them (``no_sync()``), or runs under autocast, is shadowed alike;
- at the end, the parameters and buffers of the highest rank among the last to join are
  broadcast to every rank (a joined rank's optimizer did not step).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.nn.parallel import DistributedDataParallel

from ..functions.synchronization import uneven

__all__ = ["join"]


class _ShadowStep(JoinHook):
    """Torch's join loop calls :meth:`main_hook` once per step of the ranks still training."""

    def __init__(self, joinable: "_UnevenInputs") -> None:
        self.joinable = joinable

    def main_hook(self) -> None:
        self.joinable.shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.joinable.sync_final_model(is_last_joiner)


class _UnevenInputs(Joinable):
    """The DDP model as a :class:`Joinable`: forward hooks that tell the join context of each real
    step and remember the batch's shape, and the shadow step of a rank that has joined."""

    def __init__(self, ddp: DistributedDataParallel, example_input: Any, shadows: bool) -> None:
        super().__init__()
        self.ddp, self.shadows = ddp, shadows
        self.template = None if example_input is None else uneven.empty_batch(_as_args(example_input), {})
        self.had_batch, self.checked, self.shadowing = False, False, False
        self.announced: tuple[Any, torch.Tensor] | None = None
        self.used: list[bool] | None = None
        self.divide_by_initial_world_size = True
        self.handles = [
            ddp.register_forward_pre_hook(self.before_step, with_kwargs=True),
            ddp.register_forward_hook(self.after_step),
        ]

    def join_hook(self, **kwargs: Any) -> JoinHook:
        self.divide_by_initial_world_size = kwargs.get("divide_by_initial_world_size", True)
        return _ShadowStep(self)

    @property
    def join_device(self) -> torch.device:
        return self.ddp.device

    @property
    def join_process_group(self) -> Any:
        return self.ddp.process_group

    def before_step(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A real step: the verdict at the first, then torch's notice that this rank has not joined
        (whose count DDP divides by where ``divide_by_initial_world_size=False``), then what kind
        of step this is, for the joined ranks."""
        if self.shadowing:
            return
        self.template, self.had_batch = uneven.empty_batch(args, kwargs), True
        if not self.checked:
            self.check_shadowing()
        work = Join.notify_join_context(self)
        if work is not None and not self.divide_by_initial_world_size:
            uneven.divide_by_ranks_not_joined(self.ddp, work)
        if self.shadows:
            self.announced = uneven.announce_step(self.ddp)

    def after_step(self, module: nn.Module, args: tuple, output: Any) -> None:
        """Remember which outputs the step's loss reaches, so a shadow step's backward runs
        through the same ones (and so meets the same layers' backward collectives)."""
        if self.shadowing:
            return
        tensors = uneven.output_tensors(output)
        used = self.used = [False] * len(tensors)
        for i, tensor in enumerate(tensors):
            if tensor.requires_grad:
                tensor.register_hook(lambda grad, i=i: used.__setitem__(i, True))

    def check_shadowing(self) -> None:
        """The verdict (:func:`syncbn.functions.synchronization.uneven.exchange_verdicts`): every
        rank raises here alike where one cannot shadow the others' steps."""
        self.checked = True
        if not self.shadows:
            return
        if self.template is None:
            verdict, message = uneven.NO_EXAMPLE, ""
        else:
            device = self.ddp.device if self.ddp.device_ids else None  # where DDP moves the inputs
            message = uneven.probe_empty_batch(self.ddp.module, *self.template, device) or ""
            verdict = uneven.REJECTED if message else uneven.HAD_BATCH if self.had_batch else uneven.EXAMPLE
        lines = uneven.refusals(uneven.exchange_verdicts(verdict, message, self.ddp.process_group, self.ddp.device))
        if lines:
            raise RuntimeError(
                "syncbn.parallel.join cannot shadow the steps of the ranks that still have data on an "
                "empty batch:\n  " + "\n  ".join(lines) + "\nA model must take a batch of 0 rows (x.flatten(1), "
                "not x.view(x.size(0), -1)); a rank that may have no batch at all needs example_input= "
                "(one call's arguments)."
            )

    def shadow_step(self) -> None:
        """One step of a rank that has joined: the DDP model forward and backward on the empty
        batch, as the ranks still training step (with or without gradients, under ``no_sync()`` or
        not, under their autocast dtype), its stale gradients cleared first (DDP would reduce
        them), the loss the sum of the outputs that the last step's loss reached (zero)."""
        grad, sync, autocast = uneven.step_kind(self.ddp)
        args, kwargs = self.template
        for p in self.ddp.parameters():
            p.grad = None
        self.shadowing = True
        try:
            with torch.set_grad_enabled(grad), (nullcontext() if sync else self.ddp.no_sync()), torch.autocast(
                self.ddp.device.type, dtype=autocast, enabled=autocast is not None
            ):
                output = self.ddp(*args, **kwargs)
                tensors = uneven.output_tensors(output)
                known = self.used is not None and len(self.used) == len(tensors) and any(self.used)
                used = self.used if known else [True] * len(tensors)
                reached = [t.sum() for t, u in zip(tensors, used) if u and t.requires_grad]
                if reached:
                    torch.autograd.backward(reached)
        except Exception as error:
            raise RuntimeError(
                f"syncbn.parallel.join: the step that shadows the other ranks' step on an empty batch failed "
                f"({type(error).__name__}: {error}); where the model raised, the other ranks wait until the "
                "process group's timeout"
            ) from error
        finally:
            self.shadowing = False

    def sync_final_model(self, is_last_joiner: bool) -> None:
        skip = set(getattr(self.ddp, "parameters_to_ignore", ()))
        uneven.broadcast_final_model(self.ddp.module, is_last_joiner, self.ddp.process_group, self.ddp.device, skip)

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()


def _as_args(example_input: Any) -> tuple:
    return example_input if isinstance(example_input, tuple) else (example_input,)


class join:  # noqa: N801 - a context manager used as a function, as torch's Join
    """Train a DDP model whose ranks hold different numbers of batches, with synchronized batch
    norm::

        with syncbn.parallel.join(ddp_model):
            for x, y in loader:          # any number of batches per rank, 0 included
                loss = criterion(ddp_model(x), y)
                optimizer.zero_grad(); loss.backward(); optimizer.step()

    A rank that runs out of batches shadows the other ranks' steps: it runs ``ddp_model`` forward
    and backward on an empty batch shaped like its last one (dim 0 of every tensor argument cut to
    0 rows), so every synchronized layer and DDP's gradient buckets meet it, contributing nothing:
    the statistics are those of the ranks with data, the running statistics stay equal on every
    rank, and DDP's gradients are what torch's ``Join`` gives them. At the end the model of the
    (highest) last rank to join is broadcast, so it is the same on every rank.

    Args:
        ddp_model: a ``DistributedDataParallel`` module (it may wrap a compiled model).
        example_input: one call's arguments (a tensor, or a tuple of positional arguments) to
            shape the empty batch of a rank that may have no batch at all.
        divide_by_initial_world_size: as torch's: DDP averages gradients over the initial world
            size (True) or over the ranks that have not joined (False).
        enable: False makes the context do nothing (inputs known to be even).
        throw_on_early_termination: as torch's: every rank raises as soon as one runs out.

    Each loop step is one call of ``ddp_model`` and at most one backward, alike on the ranks still
    training; a step under ``ddp_model.no_sync()`` (gradient accumulation) is shadowed under it
    too. Before the first step every rank checks that it can shadow (the model run once on the
    empty batch, without gradients and with its batch norms in eval), and where one cannot, every
    rank raises the same ``RuntimeError`` there, naming the rank and what failed (the module and
    the source line). Collectives outside ``ddp_model`` (a metric's all_reduce in the loop) are
    the caller's: the joined ranks do not shadow them.
    """

    def __init__(
        self,
        ddp_model: nn.Module,
        example_input: Any = None,
        *,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> None:
        if not isinstance(ddp_model, DistributedDataParallel):
            raise TypeError(
                f"syncbn.parallel.join takes a DistributedDataParallel model, got {type(ddp_model).__name__}: "
                "wrap it as DistributedDataParallel(model) first"
            )
        self.ddp_model, self.example_input, self.enable = ddp_model, example_input, enable
        self.throw_on_early_termination = throw_on_early_termination
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self._joinable: _UnevenInputs | None = None
        self._join: Join | None = None

    def __enter__(self) -> "join":
        if self.enable:
            shadows = not self.throw_on_early_termination
            joinable = _UnevenInputs(self.ddp_model, self.example_input, shadows)
            try:
                self._join = Join(
                    [joinable], True, self.throw_on_early_termination,
                    divide_by_initial_world_size=self.divide_by_initial_world_size,
                )
            except BaseException:
                joinable.remove_hooks()
                raise
            self._joinable = joinable
            self._join.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: Any) -> None:
        joinable, joined = self._joinable, self._join
        if joinable is None or joined is None:
            return
        self._joinable = self._join = None
        try:
            if kind is None and not joinable.checked:  # a rank that had no batch meets the others' verdict
                joinable.check_shadowing()
            joined.__exit__(kind, value, tb)
        finally:
            joinable.remove_hooks()
