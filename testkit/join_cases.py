"""A rank's side of the uneven-inputs tests (``tests/test_join*.py``): ours under DDP inside
``syncbn.parallel.join`` against a single float64 process that steps, at each step, on the
concatenated batches of the ranks that still have one (``nn.BatchNorm*``, SGD). Per step on a rank
with data: its output rows, input gradient and every parameter's gradient (times DDP's divisor:
the initial world size, or the ranks not joined); after the loop on every rank: every parameter
and buffer (running statistics, num_batches_tracked), and that they are identical on every rank."""
from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from syncbn import nn as NN
from syncbn.parallel import join
from testkit.ddp_lockstep import assert_identical_on_all_ranks, conv_bn_2d
from testkit.lockstep import randomize_affine
from testkit.networks import padded_images_mask

TOL = dict(atol=1e-10, rtol=1e-10)
LR = 0.05


@dataclass
class Case:
    """``counts[r]`` batches on rank r of ``sizes[r]`` rows (its last one a row fewer, where it has
    more than one) of ``sample``-shaped samples; ``masked``: the model takes ``(x, mask)``;
    ``then``: the counts of a second join over the same model (a second epoch)."""

    counts: Sequence[int]
    then: Sequence[int] = ()
    first_step: int = 0
    sizes: Sequence[int] = (3, 2, 4)
    make_ref: Callable[[], nn.Module] = conv_bn_2d
    make_ours: Callable[[nn.Module], nn.Module] = NN.convert_sync_batchnorm
    sample: tuple[int, ...] = (3, 4, 5)
    masked: bool = False
    divide_by_initial_world_size: bool = True
    example: bool = False
    compiled: Callable[[nn.Module], nn.Module] | None = None
    ddp: dict[str, Any] = field(default_factory=dict)
    accumulate: int = 1  # steps per optimizer step, all but the last under ddp.no_sync()

    def epochs(self) -> list["Case"]:
        second = [replace(self, counts=self.then, then=(), first_step=max(self.counts))] if self.then else []
        return [self, *second]

    def rows(self, rank: int, step: int) -> int:
        size = self.sizes[rank]
        return size - 1 if step == self.counts[rank] - 1 and size > 1 else size

    def reduces(self, step: int) -> bool:
        return (step + 1) % self.accumulate == 0

    def active(self, step: int) -> list[int]:
        return [r for r, count in enumerate(self.counts) if count > step]


def step_inputs(case: Case, step: int) -> tuple[list[Tensor], dict[int, slice]]:
    """The step's concatenated batch (x, and the mask where masked) and each active rank's rows."""
    slices, start = {}, 0
    for r in case.active(step):
        slices[r] = slice(start, start + case.rows(r, step))
        start += case.rows(r, step)
    gen = torch.Generator().manual_seed(1000 + case.first_step + step)
    x = torch.randn(start, *case.sample, generator=gen, dtype=torch.float64) * 3 + 1
    if not case.masked:
        return [x], slices
    return [x, padded_images_mask(start, case.sample[-1], gen)], slices


def first_output(y: Any) -> Tensor:
    return y[0] if isinstance(y, (tuple, list)) else y


def upstream(step: int, y: Tensor) -> Tensor:
    return torch.randn(y.shape, generator=torch.Generator().manual_seed(2000 + step), dtype=torch.float64)


def reference_run(case: Case, ref: nn.Module, world: int) -> list[dict[str, Any]]:
    """Each step's full output, input gradient, parameter gradients and DDP's divisor; ``ref``
    ends in the final state."""
    records = []
    for step in range(max(case.counts)):
        inputs, _ = step_inputs(case, step)
        x = inputs[0].clone().requires_grad_()
        y = first_output(ref(x, *inputs[1:]))
        if step % case.accumulate == 0:
            ref.zero_grad(set_to_none=True)
        (y * upstream(case.first_step + step, y)).sum().backward()
        divisor = world if case.divide_by_initial_world_size else len(case.active(step))
        grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in ref.named_parameters()}
        records.append(dict(y=y.detach(), x_grad=x.grad, grads=grads if case.reduces(step) else None, divisor=divisor))
        with torch.no_grad():
            for name, p in ref.named_parameters():
                p -= LR / divisor * grads[name] if case.reduces(step) else 0
    return records


def train_in_join(case: Case, rank: int, world: int) -> nn.Module:
    """Run ``case`` on this rank inside ``join`` and compare it with :func:`reference_run`."""
    torch.manual_seed(0)
    ref = randomize_affine(case.make_ref()).double()
    ours = case.make_ours(copy.deepcopy(ref))
    ddp = DistributedDataParallel(ours if case.compiled is None else case.compiled(ours), **case.ddp)
    optimizer = torch.optim.SGD(ours.parameters(), lr=LR)
    for epoch in case.epochs():
        records = reference_run(epoch, ref, world)
        example = tuple(t[:1] for t in step_inputs(epoch, 0)[0]) if case.example else None
        with join(ddp, example, divide_by_initial_world_size=case.divide_by_initial_world_size):
            for step in range(epoch.counts[rank]):
                inputs, slices = step_inputs(epoch, step)
                mine = [t[slices[rank]] for t in inputs]
                x = mine[0].clone().requires_grad_()
                with nullcontext() if case.reduces(step) else ddp.no_sync():
                    y = first_output(ddp(x, *mine[1:]))
                    if step % case.accumulate == 0:
                        optimizer.zero_grad(set_to_none=True)
                    (y * upstream(epoch.first_step + step, records[step]["y"])[slices[rank]]).sum().backward()
                check_step(epoch.first_step + step, records[step], slices[rank], y, x, ours)
                if case.reduces(step):
                    optimizer.step()
    for (name, mine), (_, theirs) in zip(ours.state_dict().items(), ref.state_dict().items()):
        torch.testing.assert_close(mine, theirs, **TOL, msg=lambda m: f"after the loop, {name}: {m}")
    assert_identical_on_all_ranks(ours)
    for name, p in ours.named_parameters():
        for other_rank, other in enumerate(gather_all(p.detach())):
            assert torch.equal(other, p), f"parameter {name} differs on rank {other_rank}"
    return ours


def check_step(step: int, record: dict[str, Any], rows: slice, y: Tensor, x: Tensor, ours: nn.Module) -> None:
    what = f"step {step}"
    torch.testing.assert_close(y.detach(), record["y"][rows], **TOL, msg=lambda m: f"{what} output: {m}")
    torch.testing.assert_close(x.grad, record["x_grad"][rows], **TOL, msg=lambda m: f"{what} input grad: {m}")
    for name, p in ours.named_parameters() if record["grads"] is not None else ():
        grad = torch.zeros_like(p) if p.grad is None else p.grad * record["divisor"]
        torch.testing.assert_close(grad, record["grads"][name], **TOL, msg=lambda m: f"{what} {name} grad: {m}")


def gather_all(tensor: Tensor) -> list[Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return parts


class TwoHeads(nn.Module):
    """A trunk and two heads, the second's output left out of the loss, and a parameter that no
    step uses: what ``find_unused_parameters=True`` is for."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU())
        self.head, self.aux = nn.Sequential(nn.Conv2d(4, 5, 1), nn.BatchNorm2d(5)), nn.BatchNorm2d(4)
        self.unused = nn.Linear(2, 2)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        x = self.trunk(x)
        return self.head(x), self.aux(x)


class FlattensByView(nn.Module):
    """A classifier head that cannot take an empty batch: ``view(x.size(0), -1)``."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.fc = conv_bn_2d(), nn.Linear(5 * 4 * 5, 2)

    def forward(self, x: Tensor) -> Tensor:
        x = self.body(x)
        return self.fc(x.view(x.size(0), -1))


class ScalesByMax(nn.Module):
    """A data-dependent op that an empty batch fails: the batch's largest value."""

    def __init__(self) -> None:
        super().__init__()
        self.body = conv_bn_2d()

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x / x.abs().max())
