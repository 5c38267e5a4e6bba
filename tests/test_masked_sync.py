"""``mask=`` across replicas and ranks: three uneven ThreadedDataParallel replicas with one all
padding, two Gloo ranks with one all padding (eager, and compiled with fullgraph=True), against the
float64 reference on the concatenated batch (``testkit.masking``); no valid position anywhere
raises on every replica and rank before any state changes. A replica or rank with a bad mask, or
none where the others have one: ``tests/test_generated_surface.py``."""
from __future__ import annotations

import re

import pytest
import torch
from torch import Tensor

from syncbn.modules.parallel import ThreadedDataParallel
from testkit.local_group import run_local_group
from testkit.masking import CL2, TOL, Reference, make_layer, random_mask, step_both


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, CL2], ids=str)
def test_three_uneven_replicas_one_all_masked(memory_format) -> None:
    generator = torch.Generator().manual_seed(4)
    shape = (10, 3, 4, 5)  # chunks of 4, 4 and 2
    layer = make_layer(shape, activation="relu")
    ref = Reference(layer)
    model = ThreadedDataParallel(layer, ["cpu"] * 3)
    for _ in range(3):
        x, z = (torch.randn(shape, generator=generator, dtype=torch.float64).contiguous(memory_format=memory_format)
                for _ in range(2))
        mask = random_mask(shape, "positions", generator)
        mask[8:] = False  # the third replica holds padding only
        step_both(lambda x, m, z: model(x, z, mask=m), layer, ref, x, mask, TOL, z)
    with pytest.raises(ValueError, match=r"more than 1 value per channel.*0 valid positions"):
        model(x, mask=torch.zeros(10, 4, 5, dtype=torch.bool))


# --- two Gloo ranks ------------------------------------------------------------------------------

SIZES = (4, 2)  # rank 1: all padding at every step


def _ranks_masked(rank: int, world: int, compiled: bool) -> list:
    """Three steps of a layer synchronized over the two ranks (rank 1's mask all False), eager or
    compiled with fullgraph=True: per step (y, x.grad, z.grad) and at the end the layer's state."""
    torch.manual_seed(0)
    layer = make_layer((1, 3, 1, 1), activation="relu")
    run = torch.compile(layer, fullgraph=True, dynamic=False, backend="aot_eager") if compiled else layer
    steps = []
    for x, z, mask, grad in _rank_inputs()[rank]:
        x, z = x.requires_grad_(), z.requires_grad_()
        y = run(x, z, mask=mask)
        y.backward(grad)
        steps.append((y.detach(), x.grad, z.grad))
    state = [layer.weight.grad, layer.bias.grad, layer.running_mean.clone(), layer.running_var.clone(),
             layer.num_batches_tracked.clone()]
    try:  # no valid position on any rank: every rank raises at the layer, nothing updated
        run(x, z, mask=torch.zeros_like(mask))
        raised = ""
    except (ValueError, RuntimeError) as error:
        raised = str(error)
    unchanged = bool(torch.equal(layer.running_var, state[3]) and int(layer.num_batches_tracked) == 3)
    return [steps, *state, raised, unchanged]


def _rank_inputs() -> list[list[tuple[Tensor, ...]]]:
    """Every step's (x, z, mask, grad) per rank, the same in every process."""
    generator = torch.Generator().manual_seed(7)
    per_rank: list[list[tuple[Tensor, ...]]] = [[], []]
    for _ in range(3):
        for rank, n in enumerate(SIZES):
            x, z, grad = (torch.randn(n, 3, 4, 4, generator=generator, dtype=torch.float64) for _ in range(3))
            mask = torch.rand(n, 4, 4, generator=generator) > 0.4
            mask.view(-1)[:2] = rank == 0
            per_rank[rank].append((x, z, mask if rank == 0 else torch.zeros_like(mask), grad))
    return per_rank


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_two_ranks_one_all_masked(compiled: bool) -> None:
    results = run_local_group(_ranks_masked, 2, compiled)
    torch.manual_seed(0)
    layer = make_layer((1, 3, 1, 1), activation="relu")
    ref = Reference(layer)
    inputs = _rank_inputs()
    for step in range(3):
        x, z, mask, grad = (torch.cat(parts) for parts in zip(inputs[0][step], inputs[1][step]))
        xr, zr = x.clone().requires_grad_(), z.clone().requires_grad_()
        yr = ref(xr, mask, zr, relu=True)
        yr.backward(grad)
        for name, index, expected in (("y", 0, yr.detach()), ("x.grad", 1, xr.grad), ("z.grad", 2, zr.grad)):
            got = torch.cat([results[rank][0][step][index] for rank in range(2)])
            torch.testing.assert_close(got, expected, **TOL, msg=lambda m: f"step {step} {name}: {m}")
    torch.testing.assert_close(results[0][1] + results[1][1], ref.weight.grad, **TOL)  # each rank's own sums
    torch.testing.assert_close(results[0][2] + results[1][2], ref.bias.grad, **TOL)
    for rank in range(2):
        torch.testing.assert_close(results[rank][3], ref.running_mean, **TOL)
        torch.testing.assert_close(results[rank][4], ref.running_var, **TOL)
        assert int(results[rank][5]) == 3
        expected = "one valid position, or none" if compiled else "Expected more than 1 value per channel.*0 valid positions"
        assert re.search(expected, results[rank][6]), results[rank][6]
        assert results[rank][7]


class CheckpointedBlock(torch.nn.Module):
    """conv + our fused batch norm, under torch.utils.checkpoint (non-reentrant) where ``recompute``,
    then our batch norm: each called with the mask."""

    def __init__(self, recompute: bool) -> None:
        super().__init__()
        self.recompute = recompute
        self.conv, self.bn = torch.nn.Conv2d(3, 4, 3, padding=1), make_layer((1, 4, 1, 1), activation="relu")
        self.bn2 = make_layer((1, 4, 1, 1))

    def block(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.bn(self.conv(x), mask=mask)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.block, x, mask, use_reentrant=False) if self.recompute else self.block(x, mask)
        return self.bn2(h, mask=mask)


@pytest.mark.parametrize("replicas", [1, 3])
def test_a_checkpointed_masked_layer_reuses_its_statistics(replicas: int) -> None:
    generator = torch.Generator().manual_seed(9)
    plain, recomputed = CheckpointedBlock(False).double(), CheckpointedBlock(True).double()
    recomputed.load_state_dict(plain.state_dict())
    runs = [ThreadedDataParallel(m, ["cpu"] * replicas) if replicas > 1 else m for m in (plain, recomputed)]
    for _ in range(2):
        x = torch.randn(7, 3, 5, 5, generator=generator, dtype=torch.float64)
        mask = random_mask((7, 3, 5, 5), "positions", generator)
        mask[5:] = False  # the last replica holds padding only
        grad = torch.randn(7, 4, 5, 5, generator=generator, dtype=torch.float64)
        xs = [x.clone().requires_grad_() for _ in runs]
        ys = [run(xi, mask) for run, xi in zip(runs, xs)]
        for y in ys:
            y.backward(grad)
        assert torch.equal(ys[0], ys[1]) and torch.equal(xs[0].grad, xs[1].grad)
        for a, b in zip(plain.state_dict().values(), recomputed.state_dict().values()):
            assert torch.equal(a, b)  # running statistics and num_batches_tracked counted once
        assert torch.equal(plain.conv.weight.grad, recomputed.conv.weight.grad)
        plain.zero_grad(), recomputed.zero_grad()
