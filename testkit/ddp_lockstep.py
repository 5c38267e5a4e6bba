"""A rank's side of the lockstep comparison across processes (``tests/test_distributed_*.py``): our
layers (under DDP, or ThreadedDataParallel replicas in each process) against nn.BatchNorm* on the
concatenated global batch, in float64 with tolerance 1e-9, over several SGD steps: outputs, input
gradients, parameter gradients (DDP averages them, so ours * world is compared), running stats and
num_batches_tracked, and that the buffers are bitwise identical on every rank. Also the models that
these comparisons train, and the check that every rank raises."""
from __future__ import annotations

import copy
from typing import Callable, Sequence

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from syncbn import nn as NN
from syncbn.modules.parallel import ThreadedDataParallel
from testkit.lockstep import assert_agree, randomize_affine, train_side_by_side

TOL = dict(atol=1e-9, rtol=1e-9)
CL2, CL3 = torch.channels_last, torch.channels_last_3d


def conv_bn_2d(**bn_args) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4, **bn_args),
        nn.ReLU(),
        nn.Conv2d(4, 5, 1, bias=False),
        nn.BatchNorm2d(5, momentum=None, **{k: v for k, v in bn_args.items() if k != "momentum"}),
    )


def conv_bn_3d() -> nn.Module:
    return nn.Sequential(nn.Conv3d(2, 3, 3, padding=1, bias=False), nn.BatchNorm3d(3), nn.ReLU(), nn.BatchNorm3d(3, momentum=None))


def linear_bn_1d() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 5, bias=False), nn.BatchNorm1d(5), nn.Unflatten(1, (5, 1)), nn.BatchNorm1d(5, momentum=None))


def bn_1d_ncl() -> nn.Module:
    return nn.Sequential(nn.BatchNorm1d(4), nn.ReLU(), nn.BatchNorm1d(4, momentum=0.5))


def conv_abn_2d() -> nn.Module:
    """Convolutions, batch norms and invertible activations: what convert_inplace_abn makes
    in-place layers of (momentum None in the second)."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.LeakyReLU(0.1),
        nn.Conv2d(4, 5, 1, bias=False), nn.BatchNorm2d(5, momentum=None), nn.ELU(0.7),
    )


def in_place(model: nn.Module) -> nn.Module:
    done = NN.convert_inplace_abn(model)
    assert done.converted == ["1", "4"], done
    return done.module


class ResidualBlock(nn.Module):
    """relu(bn(conv(x)) + x), unfused; :meth:`fused` gives our layer the add and the relu."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)

    def forward(self, x: Tensor) -> Tensor:
        if isinstance(self.bn, NN.SyncBatchNorm) and self.bn.activation == "relu":
            return self.bn(self.conv(x), x)
        return torch.relu(self.bn(self.conv(x)) + x)

    @staticmethod
    def fused(model: "ResidualBlock") -> nn.Module:
        model = NN.convert_sync_batchnorm(model)
        model.bn.activation = "relu"
        return model


def rank_slice(sizes: Sequence[int], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def global_batch(step: int, sizes: Sequence[int], sample: Sequence[int], memory_format=torch.contiguous_format) -> Tensor:
    """The same global batch on every rank (mean 1, std 3)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(sum(sizes), *sample, generator=gen, dtype=torch.float64) * 3 + 1
    return x.contiguous(memory_format=memory_format)


def gather_all(tensor: Tensor, group=None) -> list[Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def assert_identical_on_all_ranks(model: nn.Module, group=None) -> None:
    for name, buffer in model.named_buffers():
        for rank, other in enumerate(gather_all(buffer, group)):
            assert torch.equal(other, buffer), f"buffer {name} differs on rank {rank}"


def train_against_full_batch(
    make_ref: Callable[[], nn.Module],
    sizes: Sequence[int],
    sample: Sequence[int],
    steps: int = 3,
    memory_format=torch.contiguous_format,
    replicas: int = 1,
    training: bool = True,
    group=None,
    make_ours: Callable[[nn.Module], nn.Module] = NN.convert_sync_batchnorm,
    ref_training: bool | None = None,
    compiled: Callable[[nn.Module], nn.Module] | None = None,
) -> nn.Module:
    """This rank trains on its slice (``sizes[rank]`` samples) of the global batch; the reference
    trains on all of it. With ``replicas`` 1 the model runs under DDP (gradients averaged over
    the group); otherwise under ThreadedDataParallel in each process, with the parameter
    gradients summed over the group by hand. Ours is ``make_ours`` of a copy of the reference
    (made before its training flag is set to ``ref_training``, default ``training``);
    ``compiled(ours)`` (torch.compile) is what DDP wraps where given. Returns our model."""
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    torch.manual_seed(0)
    ref = randomize_affine(make_ref()).double().to(memory_format=memory_format)
    ours = make_ours(copy.deepcopy(ref)).train(training)
    ref.train(training if ref_training is None else ref_training)
    if group is not None:
        for layer in ours.modules():
            if isinstance(layer, NN.SyncBatchNorm):
                layer.process_group = group
    if replicas == 1:  # DDP averages the gradients over the group
        inner = ours if compiled is None else compiled(ours)
        runner: nn.Module = DistributedDataParallel(inner, process_group=group, forward_sync_buffers=False)
        averaged_over, sum_grads = world, None
    else:  # ThreadedDataParallel in each process: the parameter gradients summed by hand

        def sum_grads() -> None:
            for p in ours.parameters():
                dist.all_reduce(p.grad, group=group)

        runner, averaged_over = ThreadedDataParallel(ours, ["cpu"] * replicas), 1

    def batch(step: int) -> list[Tensor]:
        return [global_batch(step, sizes, sample, memory_format)]

    def upstream(step: int, y: Tensor) -> Tensor:
        return torch.randn(y.shape, generator=torch.Generator().manual_seed(step), dtype=torch.float64)

    steps_run = train_side_by_side(
        ref, ours, batch, steps, runner=runner, rows=rank_slice(sizes, rank), upstream=upstream,
        averaged_over=averaged_over, after_backward=sum_grads,
    )
    assert_agree(steps_run, **TOL)
    assert_identical_on_all_ranks(ours, group)
    return ours


def expect_error_on_every_rank(run: Callable[[], object], error: type, *words: str) -> None:
    with pytest.raises(error) as caught:
        run()
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))
