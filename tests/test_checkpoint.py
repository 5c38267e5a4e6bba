"""Activation checkpointing (torch.utils.checkpoint): a forward recomputed in backward leaves the
running statistics and num_batches_tracked as one forward does, with the outputs and gradients
of the same model without checkpointing on the whole batch, on one device (reentrant too), under
ThreadedDataParallel (checkpoint around the wrapper and inside the replicas) and across ranks
(against nn.BatchNorm2d); float64, three steps, uneven replica batches; batch norm, the
cumulative average, a fused activation, in-place ABN and a frozen layer. A synchronized layer
recomputed by checkpoint (reentrant or not) reuses its first run's statistics: a checkpointed step
meets the replicas and makes the collectives that a plain step does, no more."""
from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from helpers import count_exchanges, run_threads, stock_replicas
from syncbn import nn as NN
from syncbn.parallel import ThreadedDataParallel
from testkit.collectives import count_collectives
from testkit.local_group import run_local_group
from testkit.lockstep import assert_agree, train_side_by_side

F64 = torch.float64
TOL = dict(atol=1e-12, rtol=1e-12)


class Net(nn.Module):
    """conv -> norm (the block, checkpointed where ``inner``) -> conv -> our BN, plus a residual."""

    def __init__(self, norm: Callable[[], nn.Module], inner: bool = False, reentrant: bool = False) -> None:
        super().__init__()
        self.inner, self.reentrant = inner, reentrant
        self.block = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), norm())
        self.head = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), NN.BatchNorm2d(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.block, x, use_reentrant=self.reentrant) if self.inner else self.block(x)
        return self.head(h) + h


LAYERS = {
    "bn": lambda: NN.BatchNorm2d(4),
    "cumulative": lambda: NN.BatchNorm2d(4, momentum=None),
    "fused_relu": lambda: NN.BatchNorm2d(4, activation="relu"),
    "inplace_abn": lambda: NN.InPlaceABN(4, activation="leaky_relu", activation_param=0.01),
    "frozen": lambda: NN.BatchNorm2d(4).freeze(),
}


class CheckpointAround(nn.Module):
    """``model`` under torch.utils.checkpoint, its whole forward recomputed in backward."""

    def __init__(self, model: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.model, self.reentrant = model, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.model, x, use_reentrant=self.reentrant)


PATHS = {  # how the checkpointed model runs: (Net's checkpoint arguments, replicas, a checkpoint around
    # the wrapper: None, or its use_reentrant)
    "lone": (dict(inner=True), None, None),
    "lone_reentrant": (dict(inner=True, reentrant=True), None, None),
    "threads_inside": (dict(inner=True), 3, None),
    "threads_around": (dict(), 3, False),
    "threads_around_reentrant": (dict(), 3, True),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layer", LAYERS)
def test_a_recomputed_forward_updates_nothing_twice(layer, path) -> None:
    """Against the same model without checkpointing, on the whole batch on one device
    (testkit.lockstep: outputs, input and parameter gradients, every buffer, SGD steps)."""
    net_args, replicas, around = PATHS[path]
    torch.manual_seed(0)
    plain = Net(LAYERS[layer]).to(F64)
    ours = Net(LAYERS[layer], **net_args).to(F64)
    ours.load_state_dict(plain.state_dict())
    runner = ThreadedDataParallel(ours, ["cpu"] * replicas) if replicas else ours
    runner = runner if around is None else CheckpointAround(runner, around)
    inputs = lambda step: [torch.randn(7, 3, 5, 5, dtype=F64)]  # 3 replicas: 3, 3 and 1 samples  # noqa: E731
    assert_agree(train_side_by_side(plain, ours, inputs, 3, runner=runner), **TOL)


def test_reentrant_checkpoint_inside_thread_replicas_says_what_to_do() -> None:
    model = ThreadedDataParallel(Net(LAYERS["bn"], inner=True, reentrant=True).to(F64), ["cpu"] * 2)
    with pytest.raises(RuntimeError, match=r"ThreadedDataParallel: .* pass use_reentrant=False"):
        model(torch.randn(4, 3, 5, 5, dtype=F64, requires_grad=True)).sum().backward()


def ranks_checkpointed(rank: int, world: int) -> None:
    """Each rank checkpoints its rows' block under DDP (3 and 4 rows); torch's model takes all 7."""
    torch.manual_seed(0)
    theirs = NN.revert_sync_batchnorm(Net(lambda: nn.BatchNorm2d(4))).to(F64)  # torch's layers only
    ours = Net(lambda: NN.BatchNorm2d(4), inner=True).to(F64)
    ours.load_state_dict(theirs.state_dict())
    inputs = lambda step: [torch.randn(7, 3, 5, 5, dtype=F64)]  # noqa: E731
    steps = train_side_by_side(theirs, ours, inputs, 3, runner=DistributedDataParallel(ours),
                               rows=[slice(0, 3), slice(3, 7)][rank], averaged_over=world)
    assert_agree(steps, **TOL)


def test_ranks_recomputing_a_forward_update_nothing_twice() -> None:
    run_local_group(ranks_checkpointed, 2, timeout_s=60)


SYNCED_LAYERS = [name for name in LAYERS if name != "frozen"]  # a frozen layer never meets


def one_step(model: nn.Module, rows: int, seed: int = 1) -> None:
    torch.manual_seed(seed)
    model(torch.randn(rows, 3, 5, 5, dtype=F64)).sum().backward()


@pytest.mark.parametrize("layer", SYNCED_LAYERS)
def test_a_recomputed_layer_meets_the_replicas_as_often_as_a_plain_step(layer, monkeypatch) -> None:
    """Every replica exchange of a step, with the block checkpointed inside the replicas and without:
    the same (direction, call) list; the recomputation meets no one."""
    exchanges = count_exchanges(monkeypatch)
    seen = {}
    for inner in (False, True):
        torch.manual_seed(0)
        one_step(ThreadedDataParallel(Net(LAYERS[layer], inner=inner).to(F64), ["cpu"] * 3), rows=7)
        seen[inner], exchanges[:] = sorted(exchanges), []
    assert seen[False], "the plain step met no one: the test tests nothing"
    assert seen[True] == seen[False]


def test_a_layer_called_several_times_in_checkpointed_regions_takes_each_call_its_own_statistics() -> None:
    """One layer twice in a region, and the region twice: each recomputed call finds the statistics of
    its own first run (3 thread replicas, against the same model without checkpointing)."""

    class Shared(nn.Module):
        def __init__(self, checkpointed: bool) -> None:
            super().__init__()
            self.checkpointed = checkpointed
            self.stem, self.conv = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
            self.norm = NN.BatchNorm2d(4, activation="relu")

        def block(self, h: torch.Tensor) -> torch.Tensor:
            return self.norm(self.conv(self.norm(h)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.stem(x)
            for _ in range(2):
                h = checkpoint(self.block, h, use_reentrant=False) if self.checkpointed else self.block(h)
            return h

    torch.manual_seed(0)
    plain, ours = Shared(False).to(F64), Shared(True).to(F64)
    ours.load_state_dict(plain.state_dict())
    runner = ThreadedDataParallel(ours, ["cpu"] * 3)
    inputs = lambda step: [torch.randn(7, 3, 5, 5, dtype=F64)]  # noqa: E731
    assert_agree(train_side_by_side(plain, ours, inputs, 3, runner=runner), **TOL)
    assert ours.norm.num_batches_tracked.item() == 3 * 4


CHECKPOINTS = {"plain": dict(), "non_reentrant": dict(inner=True), "reentrant": dict(inner=True, reentrant=True)}


def collectives_per_step(rank: int, world: int) -> dict:
    """Each layer kind synchronized over 2 ranks (3 and 4 rows), a step with its block checkpointed
    (non-reentrant under DDP, reentrant without: DDP refuses a parameter's gradient twice) and one
    without: the collectives our layers make, as {name: sorted element counts}."""
    counts = {}
    for layer in SYNCED_LAYERS:
        for name, net_args in CHECKPOINTS.items():
            torch.manual_seed(0)
            model = Net(LAYERS[layer], **net_args).to(F64)
            model = model if name == "reentrant" else DistributedDataParallel(model)
            x = torch.randn(3 + rank, 3, 5, 5, dtype=F64, requires_grad=True)  # reentrant needs one
            with count_collectives() as seen:
                model(x).sum().backward()
            counts[layer, name] = {op: sorted(sizes) for op, sizes in seen.items()}
    return counts


def test_a_checkpointed_step_makes_no_more_collectives_than_a_plain_one() -> None:
    for counts in run_local_group(collectives_per_step, 2, timeout_s=60):
        for layer in SYNCED_LAYERS:
            plain = counts[layer, "plain"]
            assert sum(map(len, plain.values())) == 4, plain  # two layers, forward and backward each
            for name in ("non_reentrant", "reentrant"):
                assert counts[layer, name] == plain, (layer, name, counts[layer, name], plain)


def ranks_reentrant(rank: int, world: int, layer: str) -> None:
    """Reentrant checkpoint across ranks (3 and 4 rows), the recomputation's graph differentiated:
    against the same synchronized model without checkpointing."""
    torch.manual_seed(0)
    plain = Net(LAYERS[layer]).to(F64)
    ours = Net(LAYERS[layer], inner=True, reentrant=True).to(F64)
    ours.load_state_dict(plain.state_dict())
    inputs = lambda step: [torch.randn(3 + rank, 3, 5, 5, dtype=F64)]  # noqa: E731
    assert_agree(train_side_by_side(plain, ours, inputs, 3), **TOL)


@pytest.mark.parametrize("layer", ["bn", "inplace_abn"])
def test_reentrant_checkpoint_across_ranks_reuses_the_statistics_exactly(layer) -> None:
    run_local_group(ranks_reentrant, 2, layer, timeout_s=60)


def test_replicas_made_inside_a_backward_pass_update_copies() -> None:
    """Stock nn.DataParallel under a checkpoint around it: the recomputation's replicate() runs in
    the backward, its replicas in torch's threads, which are not in it; they meet and leave the
    buffers as they were."""
    bn = NN.BatchNorm2d(3).to(F64)
    before = copy.deepcopy(bn.state_dict())
    x = torch.randn(5, 3, 2, 2, dtype=F64)

    class ForwardInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            replicas = stock_replicas(bn, 2)
            results = run_threads([lambda r=r, part=part: r(part) for r, part in zip(replicas, x.split([3, 2]))])
            assert all(isinstance(y, torch.Tensor) for y in results), results
            return grad

    ForwardInBackward.apply(torch.ones(1, requires_grad=True)).sum().backward()
    for name, value in bn.state_dict().items():
        assert torch.equal(value, before[name]), name
