"""The public surface, drawn: hypothesis draws a layer kind (``BatchNorm1d/2d/3d``, fused activation
and residual, ``ABN``, ``InPlaceABN``, frozen, timm's ``SyncBatchNormAct2d``), an input (float64 or
float32, contiguous or channels_last, odd sizes, uneven shares, a rank with no sample), a mask form
(every documented one, broadcast ones included, or none), a wrapper (one device,
``ThreadedDataParallel`` with 2-3 replicas, torch's ``replicate()`` as ``nn.DataParallel`` runs
it, 2 Gloo ranks eager and compiled), a checkpoint (none, reentrant, non-reentrant, a region with
an output left out of the loss) and a fault (none; a malformed mask or a missing one on one
participant; an exception between the two layers; one in a recomputation) (:mod:`testkit.surface`).

Clean steps are compared with the float64 reference on the full batch: output, input gradient,
weight and bias gradients, running statistics and num_batches_tracked, then an eval step (on one
device, the layer under ``torch.jit.script`` too). A fault
step must make every participant raise (the faulty one its own error) well within the timeout,
leave the state as the reference's forward up to the fault leaves it, and the next step exact.
``SYNCBN_GENERATED_EXAMPLES=10`` runs ten times more examples."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from syncbn.parallel import ThreadedDataParallel
from testkit.local_group import run_local_group
from testkit.surface import C, CHECKPOINTS, KINDS, MASKS, Case, Net, share, step_batch, values_per_channel
from helpers import run_threads, stock_replicas

TIMEOUT = 20.0
"""Replica and collective timeout: a participant freed at once waits far less than half of it."""
SCALE = int(os.environ.get("SYNCBN_GENERATED_EXAMPLES", "1"))


def _settings(examples: int) -> settings:
    return settings(max_examples=examples * SCALE, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


FAULTS = {
    "one": ("none", "bad_mask", "between", "recompute", "recompute_layer"),
    "threads": ("none", "bad_mask", "mask_disagrees", "between", "recompute", "recompute_layer"),
    "ranks": ("none", "bad_mask", "mask_disagrees", "recompute_layer"),
    "compiled": ("none", "bad_mask", "mask_disagrees"),
}
"""What each wrapper must survive; across ranks nothing outside our layers (the others wait for the
collective timeout, docs/limits.md), and under torch.compile no recomputation (no checkpoint)."""
FAULTS["stock"] = FAULTS["threads"]


def pairs(wrapper: str) -> list[tuple[str, str]]:
    """Every (layer kind, fault) the wrapper takes: each is a test of its own, so that all are drawn
    (hypothesis clusters its own choices); hypothesis draws the rest of the case."""
    return [(kind, fault) for kind in KINDS for fault in FAULTS[wrapper] if (kind, fault) != ("inplace_abn", "mask_disagrees")]


@st.composite
def cases(draw, wrapper: str, kind: str, fault: str) -> Case:
    rank = 4 if kind.startswith("timm") else draw(st.integers(2, 5))
    spatial = tuple(draw(st.integers(1, 3 if rank == 5 else 5)) for _ in range(rank - 2))
    if wrapper == "one":
        sizes = (draw(st.integers(1, 6)),)
    elif wrapper in ("threads", "stock"):
        n, replicas = draw(st.integers(2, 7)), draw(st.integers(2, 3))
        sizes = tuple(len(chunk) for chunk in torch.arange(n).chunk(replicas))
    else:
        sizes = (draw(st.integers(0, 4)), draw(st.integers(0, 4)))
    masks = (None,) if kind == "inplace_abn" else MASKS[1:] if fault == "mask_disagrees" else MASKS
    mask = draw(st.sampled_from(masks))
    checkpoints = {"one": CHECKPOINTS, "ranks": CHECKPOINTS, "compiled": ("none",)}.get(wrapper, ("none", "nonreentrant", "unused"))
    checkpoint = draw(st.sampled_from(("nonreentrant", "unused") if fault.startswith("recompute") else checkpoints))
    # float32 unmasked: a few valid values far from the padding make sums that cancel beyond its precision
    float32 = mask is None and draw(st.booleans())
    case = Case(kind, spatial, float32, rank >= 4 and draw(st.booleans()), sizes, mask, checkpoint, fault,
                draw(st.integers(0, len(sizes) - 1)), draw(st.integers(0, 999)))
    assume(case.sizes[case.faulty] > 0 or wrapper in ("ranks", "compiled"))
    assume(all(values_per_channel(case, step_batch(case, step, False)[1]) > 1 for step in range(3)))
    return case


class Failed(Exception):
    """A step that raised: what each participant raised (None: it did not), and how long it took."""

    def __init__(self, errors: list[BaseException | None], elapsed: float) -> None:
        super().__init__(errors)
        self.errors, self.elapsed = errors, elapsed


def _main(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _on_one(case: Case, model: Net, x: torch.Tensor, mask, dy: torch.Tensor) -> torch.Tensor:
    outs = model(x, mask)  # an auxiliary output stays alive through the backward, left out of the loss
    (_main(outs) * dy).sum().backward()
    return _main(outs)


def _in_threads(case: Case, model: Net, x: torch.Tensor, mask, dy: torch.Tensor) -> torch.Tensor:
    outs = ThreadedDataParallel(model, ["cpu"] * len(case.sizes), timeout=TIMEOUT)(x, mask)
    (_main(outs) * dy).sum().backward()
    return _main(outs)


def _stock(case: Case, model: Net, x: torch.Tensor, mask, dy: torch.Tensor) -> torch.Tensor:
    """torch's replicate() (its broadcast on the CPU), one thread per replica in forward and in
    backward, as nn.DataParallel's parallel_apply and the autograd engine's device threads."""
    for layer in (model.layer1, model.layer2, model.aux):
        layer.timeout = TIMEOUT
    replicas = stock_replicas(model, len(case.sizes))
    rows = [case.rows(j) for j in range(len(case.sizes))]
    outs = run_threads([lambda j=j: replicas[j](x[rows[j]], share(mask, rows[j])) for j in range(len(rows))])
    if any(isinstance(out, BaseException) for out in outs):
        raise Failed([out if isinstance(out, BaseException) else None for out in outs], 0.0)
    grads = run_threads([lambda j=j: (_main(outs[j]) * dy[rows[j]]).sum().backward() for j in range(len(rows))])
    if any(grad is not None for grad in grads):
        raise Failed(grads, 0.0)
    return torch.cat([_main(out) for out in outs])


RUNNERS = {"one": _on_one, "threads": _in_threads, "stock": _stock}


def _compare(case: Case, step: int, got, want, what: str, scale: float = 1.0) -> None:
    """``scale``: the largest magnitude that the compared sums hold terms of (rounding scales with it)."""
    tolerance = dict(case.tolerance, atol=case.tolerance["atol"] * max(scale, 1.0))
    torch.testing.assert_close(got.double(), want.double(), **tolerance, msg=lambda m: f"{case}\nstep {step} {what}: {m}")


def _compare_state(case: Case, step: int, ours: Net, ref: Net, grads: bool = True) -> None:
    for name in ("layer1", "layer2", "aux"):
        mine, theirs = getattr(ours, name), getattr(ref, name)
        for buffer in ("running_mean", "running_var", "num_batches_tracked"):
            _compare(case, step, getattr(mine, buffer), getattr(theirs, buffer), f"{name}.{buffer}")
        # the weight's and bias' gradients sum terms as large as the weight's gradient (a padded
        # value far from a few valid ones: a large normalized value), and round on that scale
        scale = max((float(p.grad.abs().max()) for p in theirs.parameters() if p.grad is not None), default=1.0)
        for param in ("weight", "bias") if grads else ():
            # none and zeros alike: replicas' unused outputs take zero gradients, as under nn.DataParallel
            got, want = (getattr(m, param).grad for m in (mine, theirs))
            zeros = torch.zeros_like(getattr(theirs, param))
            _compare(case, step, zeros if got is None else got, zeros if want is None else want, f"{name}.{param}.grad", scale)


def _reference_forward(case: Case, ref: Net, x: torch.Tensor, mask, fault: bool) -> torch.Tensor | None:
    """The reference's step: its output, or, in a fault step, its state stepped as far as ours
    must be (the layers whose exchange completed before the fault)."""
    ref.zero_grad(set_to_none=True)
    if not fault:
        return _main(ref(x, mask))
    with torch.no_grad():
        if case.fault == "between":
            z = torch.tanh(x) if case.kind in ("fused", "timm_relu") else None
            ref.layer1(x, z, mask=mask) if z is not None else ref.layer1(x, mask=mask)
        elif case.fault.startswith("recompute"):
            ref(x, mask)
    return None


def train(case: Case, run, rank: int | None = None, compiled: bool = False) -> None:
    """Two clean steps (after a fault step, where the case has a fault) and an eval step, ours
    through ``run`` against the reference on the full batch; ``rank``: this process's share;
    ``compiled``: ours under ``torch.compile(fullgraph=True)``."""
    torch.manual_seed(case.seed)
    ours = Net(case).to(case.dtype)
    ref = Net(case, reference=ours)
    if compiled:
        torch._dynamo.reset()  # each case is a new model: its compiles must not add up to the recompile limit
    runs = torch.compile(ours, fullgraph=True) if compiled else ours
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ours, ref)]
    faults = [True] if case.fault != "none" else []
    for step, fault in enumerate(faults + [False, False]):
        x, mask, dy = step_batch(case, step, fault)
        rows = case.rows(rank) if rank is not None else slice(None)
        x_ours = x[rows].to(case.dtype).requires_grad_()
        mask_ours = share(mask, rows) if rank is not None else mask
        ours.zero_grad(set_to_none=True)
        ours.armed = ("here" if rank == case.faulty else "") if rank is not None else ("share" if fault else "")
        ours.armed = ours.armed if fault else ""
        start = time.monotonic()
        try:
            out = run(case, runs, x_ours, mask_ours, dy[rows].to(case.dtype))
            errors = None
        except Failed as failed:
            errors = failed.errors
        except Exception as error:  # noqa: BLE001 (the test judges what each participant raised)
            errors = [error]
        elapsed = time.monotonic() - start
        x_ref = x.clone().requires_grad_()
        y_ref = _reference_forward(case, ref, x_ref, mask, fault)
        if fault:
            _judge_fault(case, errors, elapsed, rank, compiled)
            _compare_state(case, step, ours, ref, grads=False)
            continue
        assert errors is None, f"{case}\nstep {step}: a clean step raised {errors}"
        (y_ref * dy).sum().backward()
        _compare(case, step, out, y_ref[rows], "output", float(y_ref.abs().max()))
        _compare(case, step, x_ours.grad, x_ref.grad[rows], "input grad", float(x_ref.grad.abs().max()))
        if rank is not None:
            for param in ours.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad)  # as DDP, summed
        _compare_state(case, step, ours, ref)
        for optimizer in optimizers:
            optimizer.step()
    ours.eval(), ref.eval()
    with torch.no_grad():
        x, mask, _ = step_batch(case, 9, False)
        rows = case.rows(rank) if rank is not None else slice(None)
        _compare(case, 9, _main(ours(x[rows].to(case.dtype), share(mask, rows) if rank is not None else mask)),
                 _main(ref(x, mask))[rows], "eval output")
        if run is _on_one:  # TorchScript runs the eval layer as eager does (a mask ignored: fixed statistics)
            layer = ours.layer1
            _compare(case, 9, torch.jit.script(layer)(x.to(case.dtype).clone(), None, mask),
                     layer(x.to(case.dtype).clone(), mask=mask), "scripted eval output")
        if case.kind != "inplace_abn":  # a malformed mask raises in eval as in training, before any state changes
            with pytest.raises((RuntimeError, TypeError), match=r"mask"):
                ours.layer1(x[rows].to(case.dtype), mask=torch.ones(x[rows].size(0) + 2, dtype=torch.bool))


def _judge_fault(case: Case, errors: list[BaseException | None] | None, elapsed: float, rank: int | None,
                 compiled: bool) -> None:
    assert errors is not None, f"{case}: the fault step raised nowhere"
    assert elapsed < TIMEOUT / 2, f"{case}: the fault step took {elapsed:.1f} s (timeout {TIMEOUT} s)"
    own = {"bad_mask": "mask", "mask_disagrees": "mask=", "between": "between"}.get(case.fault, "recomputation")
    if case.kind == "inplace_abn" and case.fault == "bad_mask":
        own = "not supported in place"
    own = "failed the layer's checks" if compiled and case.fault == "bad_mask" else own
    faulty = errors[0] if len(errors) == 1 and rank in (None, case.faulty) else errors[case.faulty] if rank is None else None
    assert all(error is not None for error in errors), f"{case}: a participant did not raise: {errors}"
    if faulty is not None:  # the caller's one error, or the faulty replica's or rank's: its own
        assert own in str(faulty), f"{case}: {faulty!r}"
    else:  # another rank: told at the layer, which it names, in the collective it waited in
        told = "a rank failed at this layer" if compiled else {  # one device-side message under compile
            "bad_mask": "failed before this exchange", "mask_disagrees": "disagree on mask=",
            "recompute_layer": "failed in this backward pass"}[case.fault]
        assert f"({C})" in str(errors[0]) and told in str(errors[0]), f"{case}: {errors[0]!r}"


NAMED = [
    # a broadcast mask under ThreadedDataParallel ran one replica on the first chunk
    ("threads", Case("bn", (4, 4), False, False, (3, 3), "broadcast", "none", "none", 0, 1)),
    ("threads", Case("bn", (4, 4), False, False, (3, 3), "broadcast_channel", "none", "none", 0, 2)),
    ("one", Case("bn", (4, 4), False, False, (6,), "broadcast", "none", "none", 0, 1)),
    # replicas that disagreed on mask= merged silently
    ("threads", Case("abn", (3,), False, False, (3, 2), "positions", "none", "mask_disagrees", 1, 3)),
    # a replica's mask that is not bool, under torch's replicate()
    ("stock", Case("bn", (5, 5), False, False, (4, 4), "positions", "none", "bad_mask", 1, 0)),
    # a failing first layer of a recomputed region frees every replica at once
    ("threads", Case("bn", (4, 4), False, False, (3, 3, 1), None, "nonreentrant", "recompute_layer", 2, 6)),
]
RUNS = {"one": lambda case: train(case, _on_one), "threads": lambda case: train(case, _in_threads),
        "stock": lambda case: train(case, _stock)}


@pytest.mark.parametrize("wrapper, case", NAMED, ids=[f"{w}-{c.kind}-{c.mask}-{c.fault}" for w, c in NAMED])
def test_named_cases(wrapper: str, case: Case) -> None:
    RUNS[wrapper](case)


@pytest.mark.parametrize("kind, fault", pairs("one"))
def test_on_one_device(kind: str, fault: str) -> None:
    _settings(4)(given(cases("one", kind, fault))(lambda case: train(case, _on_one)))()


@pytest.mark.parametrize("kind, fault", pairs("threads"))
def test_under_thread_replicas(kind: str, fault: str) -> None:
    _settings(2)(given(cases("threads", kind, fault))(lambda case: train(case, _in_threads)))()


@pytest.mark.parametrize("kind, fault", pairs("stock"))
def test_under_torch_replicate(kind: str, fault: str) -> None:
    _settings(1)(given(cases("stock", kind, fault))(lambda case: train(case, _stock)))()


RANK_EXAMPLES = {
    # a rank's bad mask under compile made it skip the collective: rank 0 merged rank 1's next step
    "compiled": [Case("bn", (4, 4), False, False, (2, 2), "positions", "none", "bad_mask", 1, 4)],
    # a failed recomputation told through an unused head's collective (a SIGABRT); then every rank
    # that learnt of it told again, and the ranks counted the recomputed calls differently
    "ranks": [Case("bn", (4, 4), False, False, (2, 2), "positions", "none", "bad_mask", 1, 4),
              Case("bn", (4, 4), False, False, (3, 4), None, "nonreentrant", "recompute_layer", 1, 6),
              # InPlaceABN refused a mask before its synchronized call: the others waited for the timeout
              Case("inplace_abn", (3,), False, False, (2, 3), None, "none", "bad_mask", 0, 8),
              Case("abn", (4,), False, False, (3, 2), "positions", "unused", "recompute_layer", 1, 5)],
}


def _ranks_draw(rank: int, world: int, wrapper: str, examples: int) -> str:
    # both ranks run the same cases (derandomized, pair by pair), so their collectives pair up
    for case in RANK_EXAMPLES[wrapper]:
        train(case, _on_one, rank, compiled=wrapper == "compiled")
    for kind, fault in pairs(wrapper):
        if wrapper == "compiled" and (kind, fault) not in COMPILED_PAIRS:
            continue
        _settings(examples)(given(cases(wrapper, kind, fault))(
            lambda case: train(case, _on_one, rank, compiled=wrapper == "compiled")))()
    return "ok"


COMPILED_PAIRS = [("bn", "none"), ("fused", "bad_mask"), ("abn", "mask_disagrees"), ("inplace_abn", "none"),
                  ("frozen", "bad_mask"), ("timm_silu", "none"), ("timm_relu", "mask_disagrees")]
"""A compile per case costs seconds: these pairs, one case each."""


@pytest.mark.parametrize("wrapper, examples", [("ranks", 2), pytest.param("compiled", 1, marks=pytest.mark.exhaustive)])
def test_across_ranks(wrapper: str, examples: int) -> None:
    assert run_local_group(_ranks_draw, 2, wrapper, examples, timeout_s=TIMEOUT) == ["ok", "ok"]
