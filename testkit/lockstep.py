"""The one lockstep trainer of the tests and ``test.py``: a reference model trains on the full batch
and ours on its share of it (all of it, or a rank's rows), side by side with SGD, and every
quantity that must agree is handed out after each step: the output, the input gradients, every
parameter's gradient and every buffer (running statistics, num_batches_tracked)."""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Quantity:
    """One quantity of one step in both models. ``layer`` is a module's path ("" for the model's
    root), or "model" for the output and the input gradients."""

    step: int
    layer: str
    name: str
    ours: Tensor | None
    reference: Tensor | None


def randomize_affine(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every batch norm non-trivial weight and bias, so their gradients mean something."""
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.weight is not None:
            with torch.no_grad():
                module.weight.copy_(torch.rand(module.weight.shape, generator=gen) + 0.5)
                if module.bias is not None:
                    module.bias.copy_(torch.randn(module.bias.shape, generator=gen))
    return model


def train_side_by_side(
    reference: nn.Module,
    ours: nn.Module,
    inputs: Callable[[int], Sequence[Tensor]],
    steps: int = 3,
    *,
    runner: nn.Module | None = None,
    rows: slice = slice(None),
    upstream: Callable[[int, Tensor], Tensor] | None = None,
    lr: float = 0.01,
    averaged_over: int = 1,
    reference_state: nn.Module | None = None,
    context: Callable[[], AbstractContextManager] = nullcontext,
    after_backward: Callable[[], None] | None = None,
    after_step: Callable[[], None] | None = None,
) -> Iterator[list[Quantity]]:
    """Train ``reference`` on ``inputs(step)`` (the full batch, one tensor per positional
    argument) and ``ours`` through ``runner`` (DDP, ThreadedDataParallel, nn.DataParallel;
    default ``ours`` itself) on their ``rows``; yield each step's quantities before the SGD step.

    ``upstream(step, y)`` is dL/dy for the reference's full output ``y`` (default: standard
    normal from the global generator); ours gets its rows. ``averaged_over``: ours' gradients
    are averaged over that many ranks (DDP), so they are compared times it and stepped with
    ``lr`` times it. ``reference_state``: the module whose parameters and buffers match ours'
    (default ``reference``). ``context()`` is entered around both forwards (autocast);
    ``after_backward`` runs after both backwards (a hand-made all_reduce), ``after_step`` after
    both SGD steps.
    """
    runner = ours if runner is None else runner
    reference_state = reference if reference_state is None else reference_state
    optimizers = [
        torch.optim.SGD(params, lr=step_lr)
        for params, step_lr in ((list(reference.parameters()), lr), (list(ours.parameters()), lr * averaged_over))
        if params
    ]
    for step in range(steps):
        full = list(inputs(step))
        ref_inputs = [_leaf(x) for x in full]
        our_inputs = [_leaf(x[rows]) for x in full]
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        with context():
            y_ref = reference(*ref_inputs)
            y_ours = runner(*our_inputs)
        dy = torch.randn_like(y_ref) if upstream is None else upstream(step, y_ref)
        y_ref.backward(dy)
        y_ours.backward(dy[rows])
        if after_backward is not None:
            after_backward()
        yield [
            *_io_quantities(step, y_ref[rows].detach(), y_ours.detach(), ref_inputs, our_inputs, rows),
            *state_quantities(step, reference_state, ours, averaged_over),
        ]
        for optimizer in optimizers:
            optimizer.step()
        if after_step is not None:
            after_step()


def _leaf(x: Tensor) -> Tensor:
    """A copy of ``x`` outside any graph, requiring grad where it is floating (not a mask)."""
    return x.detach().clone().requires_grad_(x.is_floating_point())


def _io_quantities(
    step: int, y_ref: Tensor, y_ours: Tensor, ref_inputs: list[Tensor], our_inputs: list[Tensor], rows: slice
) -> Iterator[Quantity]:
    yield Quantity(step, "model", "output", y_ours, y_ref)
    for i, (x_ref, x_ours) in enumerate(zip(ref_inputs, our_inputs)):
        if not x_ref.is_floating_point():
            continue
        name = "input grad" if len(ref_inputs) == 1 else f"input {i} grad"
        yield Quantity(step, "model", name, x_ours.grad, None if x_ref.grad is None else x_ref.grad[rows])


def state_quantities(step: int, reference: nn.Module, ours: nn.Module, averaged_over: int) -> Iterator[Quantity]:
    """Every parameter's gradient (ours times ``averaged_over``) and every buffer, paired by name."""
    params = list(reference.named_parameters()), list(ours.named_parameters())
    buffers = list(reference.named_buffers()), list(ours.named_buffers())
    if len(params[0]) != len(params[1]) or len(buffers[0]) != len(buffers[1]):
        raise AssertionError("the models differ in structure: other numbers of parameters or buffers")
    pairs = [*(("grad", a, b) for a, b in zip(*params)), *(("buffer", a, b) for a, b in zip(*buffers))]
    for kind, (name, ref_tensor), (our_name, our_tensor) in pairs:
        if name != our_name:
            raise AssertionError(f"the models differ in structure: {name} against {our_name}")
        layer, _, short = name.rpartition(".")
        if kind == "buffer":
            yield Quantity(step, layer, short, our_tensor, ref_tensor)
            continue
        grad = our_tensor.grad
        if grad is not None and averaged_over != 1:
            grad = grad * averaged_over
        yield Quantity(step, layer, f"{short} grad", grad, ref_tensor.grad)


def assert_agree(steps: Iterator[list[Quantity]], atol: float | None = None, rtol: float | None = None) -> None:
    """Every quantity of every step agrees (tolerances None: torch.testing.assert_close's defaults
    for the dtype); a quantity present in one model only fails."""
    for quantities in steps:
        for q in quantities:
            what = f"step {q.step}: {q.layer + '.' if q.layer else ''}{q.name}"
            assert (q.ours is None) == (q.reference is None), f"{what}: present in one model only"
            if q.ours is not None:
                torch.testing.assert_close(q.ours, q.reference, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


class Perturbed(nn.Module):
    """``model`` on its input scaled by ``1 + relative`` (a change of a few units in the last
    place in float64): how far rounding alone moves the model's quantities."""

    def __init__(self, model: nn.Module, relative: float = 1e-15) -> None:
        super().__init__()
        self.model, self.scale = model, 1.0 + relative

    def forward(self, *inputs: Tensor) -> Tensor:
        return self.model(*(x * self.scale for x in inputs))


Key = tuple[int, str, str]


def rounding_spread(steps: Iterator[list[Quantity]]) -> dict[Key, float]:
    """Per quantity (step, layer, name), the largest difference between a model and its
    :class:`Perturbed` twin trained side by side: the model's own sensitivity to rounding."""
    return {
        (q.step, q.layer, q.name): float((q.ours - q.reference).abs().max())
        for quantities in steps
        for q in quantities
        if q.ours is not None and q.reference is not None and q.ours.numel()
    }


def assert_within_spread(steps: Iterator[list[Quantity]], spread: dict[Key, float], factor: float, floor: float) -> None:
    """Every quantity agrees within ``factor`` times its :func:`rounding_spread` (at least
    ``floor``): tolerances that follow from the model, not from one machine's run."""
    for quantities in steps:
        for q in quantities:
            what = f"step {q.step}: {q.layer + '.' if q.layer else ''}{q.name}"
            assert (q.ours is None) == (q.reference is None), f"{what}: present in one model only"
            if q.ours is not None:
                allowed = max(floor, factor * spread.get((q.step, q.layer, q.name), 0.0))
                torch.testing.assert_close(q.ours, q.reference, atol=allowed, rtol=0, msg=lambda m: f"{what} (rounding moves it by {allowed / factor:.2g}): {m}")
