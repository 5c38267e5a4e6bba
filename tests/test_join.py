"""``syncbn.parallel.join``: DDP training on uneven inputs across 2 and 3 Gloo ranks, each rank
against a single float64 process that steps on the batches of the ranks that still have one
(testkit.join_cases): uneven counts over two joins, a rank with no batch at all, DDP's divisor, a
masked model, a checkpointed block, ``find_unused_parameters=True`` with an output left out of the
loss, gradient accumulation under ``no_sync()``, a compiled model; and a loop under autocast,
against the short rank padded with empty batches by hand. Each behaviour runs on every rank, in one set of processes per world size
(testkit.process_sets)."""
from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from syncbn import nn as NN
from syncbn.parallel import join
from testkit.ddp_lockstep import conv_bn_2d
from testkit.join_cases import Case, TwoHeads, gather_all, train_in_join
from testkit.networks import MaskedNet, checkpointed, masked_ours
from testkit.process_sets import across_processes, process_sets  # noqa: F401 - the fixture of the tests it makes


@across_processes(2, 3)
def test_join_uneven_counts(rank: int, world: int) -> None:
    # 3/2 and 3/2/1 batches, each rank's last batch a row smaller; then a second join (epoch)
    train_in_join(Case(counts=[3, 2, 1][:world], then=[1, 2, 2][:world]), rank, world)


@across_processes(2, 3)
def test_join_rank_without_batch(rank: int, world: int) -> None:
    # rank 1 never has a batch: its empty batch is shaped on example_input; where no rank has
    # one, none needs an example
    train_in_join(Case(counts=[2, 0, 1][:world], example=True), rank, world)
    train_in_join(Case(counts=[0, 0, 0][:world]), rank, world)


@across_processes(2)
def test_join_divides_by_ranks_with_data(rank: int, world: int) -> None:
    # divide_by_initial_world_size=False: DDP averages over the ranks not joined, as torch's Join
    train_in_join(Case(counts=[3, 1], divide_by_initial_world_size=False), rank, world)


@across_processes(2, 3)
def test_join_masked_model(rank: int, world: int) -> None:
    # the model's forward(x, mask): the empty batch cuts both
    case = Case(counts=[1, 3, 2][:world], sizes=(3, 4, 4), make_ref=MaskedNet, make_ours=masked_ours, sample=(3, 5, 5), masked=True)
    train_in_join(case, rank, world)


@across_processes(2)
def test_join_checkpointed_block(rank: int, world: int) -> None:
    # the shadow step's recomputation meets no one again, as a real step's
    train_in_join(Case(counts=[2, 3], make_ours=checkpointed), rank, world)


@across_processes(2)
def test_join_find_unused_parameters(rank: int, world: int) -> None:
    # an output left out of the loss: the shadow step's backward runs through the same outputs;
    # buckets of a parameter or two, so DDP's all_reduces come between the layers' own
    ddp = dict(find_unused_parameters=True, bucket_cap_mb=1e-4)
    train_in_join(Case(counts=[3, 1], make_ref=TwoHeads, ddp=ddp), rank, world)


@across_processes(2, 3)
def test_join_gradient_accumulation(rank: int, world: int) -> None:
    # two steps per optimizer step, the first under ddp.no_sync(): the joined rank shadows it alike
    train_in_join(Case(counts=[4, 2, 2][:world], accumulate=2), rank, world)


@across_processes(2)
def test_join_under_autocast(rank: int, world: int) -> None:
    # a loop under autocast to bfloat16: the shadow step runs under it too, and ends as padding
    # the short rank with empty batches by hand does
    states = [autocast_run(rank, pad_by_hand) for pad_by_hand in (False, True)]
    for name, tensor in states[0].items():
        assert torch.equal(tensor, states[1][name]), name
        assert all(torch.equal(tensor, other) for other in gather_all(tensor)), f"{name} differs across ranks"


def autocast_run(rank: int, pad_by_hand: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    ours = NN.convert_sync_batchnorm(conv_bn_2d())
    ddp = DistributedDataParallel(ours)
    optimizer = torch.optim.SGD(ours.parameters(), lr=0.05)
    batches = [torch.randn(3, 3, 4, 5, generator=torch.Generator().manual_seed(10 * s + rank)) for s in range(3 - rank)]
    if pad_by_hand:
        batches += [batches[-1][:0]] * rank
    with join(ddp, enable=not pad_by_hand):
        for x in batches:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = ddp(x)
            y.float().square().mean().backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in ours.state_dict().items()}


@across_processes(2)
def test_join_compiled_model(rank: int, world: int) -> None:
    # DDP(torch.compile(model)): the empty batch compiles once more
    train_in_join(Case(counts=[3, 2], compiled=lambda m: torch.compile(m, backend="aot_eager")), rank, world)
