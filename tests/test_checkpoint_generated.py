"""Generated checkpoint regions: hypothesis draws a sequence of our layers and plain ops (affine
or not, an input that needs grad or not, under no_grad, inference_mode or neither, frozen, fused,
in-place), one or two checkpoint levels (reentrant or not, early stop or not, selective activation checkpointing,
a backward with retain_graph run twice), and every output, gradient and buffer of a few SGD steps
is compared, float64, with the same model without checkpointing: on one device, under 2-3 thread
replicas, and across 2 Gloo ranks (a smaller draw). The named cases are the structures that
once mixed up a recomputed call's statistics; failures are tests/test_checkpoint_failures.py's."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from syncbn import nn as NN
from syncbn.parallel import ThreadedDataParallel
from testkit.local_group import run_local_group
from testkit.lockstep import state_quantities

F64 = torch.float64
C = 3
TOL = dict(atol=1e-10, rtol=1e-10)

LAYERS = {
    "bn": lambda: NN.BatchNorm2d(C),
    "bn_plain": lambda: NN.BatchNorm2d(C, affine=False),
    "cumulative": lambda: NN.BatchNorm2d(C, momentum=None),
    "fused_relu": lambda: NN.BatchNorm2d(C, activation="relu"),
    "inplace_abn": lambda: NN.InPlaceABN(C, activation="leaky_relu", activation_param=0.01),
    "frozen": lambda: NN.BatchNorm2d(C).freeze(),
    "conv": lambda: nn.Conv2d(C, C, 3, padding=1),
    "tanh": lambda: nn.Tanh(),
}
IN_PLACE = {"inplace_abn"}


@dataclass(frozen=True)
class Step:
    """One op of a region: ``out = layer(input)``, then ``h = out + h`` (so a step whose output
    has no gradient leaves the graph connected)."""

    layer: str
    detached: bool  # the layer's input needs no grad
    no_grad: bool  # the layer runs under torch.no_grad()
    inference: bool = False  # ... or torch.inference_mode() (where no_grad)


@dataclass(frozen=True)
class Plan:
    """A model: its steps; the outer region (steps [outer_from, len)) and an inner one inside it
    (steps [inner_from, inner_to)), each reentrant or not; checkpoint's options."""

    steps: tuple[Step, ...]
    outer_from: int
    inner: tuple[int, int] | None
    outer_reentrant: bool
    inner_reentrant: bool
    early_stop: bool
    retain_graph: bool
    selective: bool = False  # the outer region, non-reentrant: selective activation checkpointing


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective checkpointing: keep the convolutions' outputs, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.convolution.default else CheckpointPolicy.PREFER_RECOMPUTE


class Drawn(nn.Module):
    """The plan's steps, checkpointed as it says where ``checkpointed``."""

    def __init__(self, plan: Plan, checkpointed: bool) -> None:
        super().__init__()
        self.plan, self.checkpointed = plan, checkpointed
        self.layers = nn.ModuleList(LAYERS[step.layer]() for step in plan.steps)

    def _run(self, h: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        index = start
        while index < stop:
            inner = self.plan.inner
            if inner is not None and index == inner[0] and self.checkpointed:
                h = self._region(h, inner[0], inner[1], self.plan.inner_reentrant, nested=True)
                index = inner[1]
                continue
            h = self._step(h, index)
            index += 1
        return h

    def _step(self, h: torch.Tensor, index: int) -> torch.Tensor:
        step = self.plan.steps[index]
        x = h.detach() if step.detached else h
        if step.layer in IN_PLACE:
            x = x.clone()  # it writes its input
        mode = torch.inference_mode() if step.inference else torch.no_grad()
        with mode if step.no_grad else torch.enable_grad():
            out = self.layers[index](x)
        if step.inference and step.no_grad:
            out = out.clone()  # an inference tensor: a copy for autograd to use
        return out + h

    def _region(self, h: torch.Tensor, start: int, stop: int, reentrant: bool, nested: bool) -> torch.Tensor:
        body = functools.partial(self._run_plain if nested else self._run, start=start, stop=stop)
        if reentrant:
            return checkpoint(body, h, use_reentrant=True)
        options: dict[str, Any] = dict(use_reentrant=False, early_stop=self.plan.early_stop)
        if self.plan.selective and not nested:
            options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _policy)
        return checkpoint(body, h, **options)

    def _run_plain(self, h: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        for index in range(start, stop):
            h = self._step(h, index)
        return h

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self._run(h, 0, self.plan.outer_from) if self.plan.outer_from else h
        if not self.checkpointed:
            return self._run(h, self.plan.outer_from, len(self.plan.steps))
        return self._region(h, self.plan.outer_from, len(self.plan.steps), self.plan.outer_reentrant, nested=False)


GRAD_MODES = [(False, False), (True, False), (True, True)]  # (no_grad, inference): grad, no_grad, inference_mode


@st.composite
def plans(draw: Any, reentrant: bool = True, max_steps: int = 5) -> Plan:
    steps = tuple(
        Step(draw(st.sampled_from(sorted(LAYERS))), draw(st.booleans()), *draw(st.sampled_from(GRAD_MODES)))
        for _ in range(draw(st.integers(2, max_steps)))
    )
    outer_from = draw(st.integers(0, 1))
    inner = None
    if draw(st.booleans()) and len(steps) - outer_from >= 2:
        start = draw(st.integers(outer_from, len(steps) - 1))
        inner = (start, draw(st.integers(start + 1, len(steps))))
    outer_reentrant = reentrant and draw(st.booleans())
    selective = not outer_reentrant and draw(st.booleans())
    return Plan(
        steps, outer_from, inner, outer_reentrant, reentrant and draw(st.booleans()),
        early_stop=draw(st.booleans()), retain_graph=not selective and draw(st.booleans()),  # SAC: one backward
        selective=selective,
    )


def compare(plan: Plan, runner_of: Any, rows: slice = slice(None), averaged_over: int = 1, steps: int = 2) -> None:
    """Train the plan with and without checkpointing side by side (the same runner around each),
    asserting every output, input gradient, parameter gradient and buffer agree at each step."""
    torch.manual_seed(0)
    plain = Drawn(plan, checkpointed=False).to(F64)
    ours = Drawn(plan, checkpointed=True).to(F64)
    ours.load_state_dict(plain.state_dict())
    runners = runner_of(plain), runner_of(ours)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (plain, ours) if list(m.parameters())]
    for step in range(steps):
        x = torch.randn(7, C, 4, 4, dtype=F64) * 2 + 1
        weights = torch.randn(7, C, 4, 4, dtype=F64)[rows]
        results = []
        for runner, model in zip(runners, (plain, ours)):
            model.zero_grad(set_to_none=True)
            x_here = x[rows].clone().requires_grad_()
            y = runner(x_here)
            loss = (y * weights).sum()
            loss.backward(retain_graph=plan.retain_graph)
            if plan.retain_graph:
                loss.backward()
            results.append((y.detach(), x_here.grad))
        (y_plain, grad_plain), (y_ours, grad_ours) = results
        torch.testing.assert_close(y_ours, y_plain, **TOL, msg=lambda m: f"step {step} output: {m}")
        torch.testing.assert_close(grad_ours, grad_plain, **TOL, msg=lambda m: f"step {step} input grad: {m}")
        for q in state_quantities(step, plain, ours, 1):
            assert (q.ours is None) == (q.reference is None), f"step {step}: {q.layer}.{q.name} present in one model"
            if q.ours is not None:
                torch.testing.assert_close(q.ours, q.reference, **TOL, msg=lambda m: f"step {step} {q.layer}.{q.name}: {m}")
        for optimizer in optimizers:
            optimizer.step()


GENERATED = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                     suppress_health_check=[HealthCheck.too_slow])


@GENERATED
@given(plans())
def test_generated_regions_on_one_device(plan: Plan) -> None:
    compare(plan, lambda model: model)


@GENERATED
@given(plans(reentrant=False), st.integers(2, 3))
def test_generated_regions_under_thread_replicas(plan: Plan, replicas: int) -> None:
    # reentrant checkpoint inside thread replicas is refused with a message (test_checkpoint.py)
    compare(plan, lambda model: ThreadedDataParallel(model, ["cpu"] * replicas))


def _ranks_draw(rank: int, world: int, examples: int) -> str:
    # both ranks draw the same plans (derandomized), so their collectives pair up
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(plans(max_steps=4))
    def run(plan: Plan) -> None:
        compare(plan, lambda model: model, rows=[slice(0, 3), slice(3, 7)][rank])

    run()
    return "ok"


def test_generated_regions_across_ranks() -> None:
    # the reference is the same plan without checkpointing across the same ranks; the gradients
    # compared are each rank's own (no DDP: a retain_graph backward runs twice)
    assert run_local_group(_ranks_draw, 2, 12, timeout_s=60) == ["ok", "ok"]


# ---- the named cases ----

def test_a_call_that_saves_nothing_keeps_its_own_statistics() -> None:
    # an affine=False layer on an input that needs no grad saves no tensor, then a training layer
    # with nothing saved in between: 2 thread replicas, non-reentrant
    plan = Plan((Step("bn_plain", True, False), Step("bn", False, False), Step("conv", False, False)),
                0, None, False, False, True, False)
    compare(plan, lambda model: ThreadedDataParallel(model, ["cpu"] * 2), steps=3)


def _no_grad_call_in_a_reentrant_region(rank: int, world: int) -> str:
    plan = Plan((Step("bn_plain", False, True), Step("bn", False, False), Step("conv", False, False)),
                0, None, True, False, True, False)
    compare(plan, DistributedDataParallel, rows=[slice(0, 3), slice(3, 7)][rank], steps=3)
    return "ok"


def test_a_no_grad_call_in_a_reentrant_region_keeps_its_own_statistics() -> None:
    assert run_local_group(_no_grad_call_in_a_reentrant_region, 2, timeout_s=30) == ["ok", "ok"]


def test_a_region_whose_first_run_raised_leaves_the_next_step_exact() -> None:
    # a replica raises in the region's first run: every replica raises; the next checkpointed step
    # equals the same model without checkpointing from the state the failed step left
    plan = Plan((Step("bn", False, False), Step("conv", False, False), Step("fused_relu", False, False)),
                0, None, False, False, True, False)
    torch.manual_seed(0)
    ours = Drawn(plan, checkpointed=True).to(F64)
    target = ours.layers[2]
    check = type(target)._check_input

    def failing_check(input: torch.Tensor, z: torch.Tensor | None = None) -> None:
        if input.shape[0] == 1:
            raise MemoryError("out of memory in the first run")
        check(target, input, z)

    target._check_input = failing_check
    x = torch.randn(7, C, 4, 4, dtype=F64, requires_grad=True)
    with pytest.raises(MemoryError, match="first run"):
        ThreadedDataParallel(ours, ["cpu"] * 3, timeout=20)(x)
    del target._check_input
    plain = Drawn(plan, checkpointed=False).to(F64)
    plain.load_state_dict(ours.state_dict())
    compare_from = {"plain": plain, "ours": ours}
    results = {}
    for name, model in compare_from.items():
        x_here = x.detach().clone().requires_grad_()
        y = ThreadedDataParallel(model, ["cpu"] * 3, timeout=20)(x_here)
        y.backward(torch.ones_like(y))
        results[name] = [y.detach(), x_here.grad, *(p.grad for p in model.parameters()), *model.buffers()]
    for got, want in zip(results["ours"], results["plain"]):
        torch.testing.assert_close(got, want, **TOL)
