"""The private parts of torch.utils.checkpoint that the library reads (functions/torch_internals.py):
the error that stops a recomputation, a non-reentrant region's frame in every run and the end of its
first run, a reentrant region's node in both runs, and a selective recomputation told apart; each
still means, on the installed torch, what the library reads it as."""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from syncbn.functions import torch_internals


def test_checkpoint_stops_its_recomputation_with_the_error_we_recognise() -> None:
    errors: list = []

    class Watch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    def block(x):
        y = Watch.apply(x).sin()
        try:
            return y.cos().exp()
        except BaseException as error:  # the stop, raised in the recomputation once enough was recomputed
            errors.append(error)
            raise

    x = torch.randn(3, requires_grad=True)
    checkpoint(block, x, use_reentrant=False).sum().backward()
    assert errors and all(torch_internals.is_checkpoint_stop(error) for error in errors)
    assert not torch_internals.is_checkpoint_stop(RuntimeError("other"))


def test_a_nonreentrant_checkpoint_region_is_its_frame_in_every_run() -> None:
    # the first run and each recomputation (twice: retain_graph) name the same frame, with the
    # run (the first, or the backward pass that recomputes), under no_grad too; other
    # saved-tensor hooks, or none, give None
    regions: list = []

    def region(x: torch.Tensor) -> torch.Tensor:
        regions.append(torch_internals.nonreentrant_checkpoint_region())
        with torch.no_grad():
            regions.append(torch_internals.nonreentrant_checkpoint_region())
        return x.sin()

    assert torch_internals.nonreentrant_checkpoint_region() is None
    x = torch.randn(4, requires_grad=True)
    y = checkpoint(region, x, use_reentrant=False)
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    frame = regions[0][0]
    assert all(found[0] is frame for found in regions)
    runs = [found[1] for found in regions]
    assert runs[:2] == [torch_internals.FIRST_RUN] * 2
    assert runs[2] == runs[3] != runs[4] == runs[5] and torch_internals.FIRST_RUN not in runs[2:]
    with torch.autograd.graph.save_on_cpu():
        assert torch_internals.nonreentrant_checkpoint_region() is None
    regions.clear()
    checkpoint(region, x, use_reentrant=True).sum().backward()  # reentrant: no saved-tensor hooks
    assert regions == [None] * 4


def test_a_reentrant_checkpoint_region_is_its_node_in_both_runs() -> None:
    # the first run (CheckpointFunction.forward among the callers) and the recomputation (its
    # backward) name the node, whatever the grad mode, with the run: the first, or the backward
    # pass; the innermost of nested regions; elsewhere None
    regions: list = []

    def region(x: torch.Tensor) -> torch.Tensor:
        regions.append(torch_internals.reentrant_checkpoint_region())
        with torch.no_grad():
            regions.append(torch_internals.reentrant_checkpoint_region())
        return x.sin()

    x = torch.randn(4, requires_grad=True)
    y = checkpoint(region, x, use_reentrant=True)
    assert type(y.grad_fn).__name__ == "CheckpointFunctionBackward"
    y.sum().backward()
    first, recomputation = torch_internals.FIRST_RUN, regions[2][1]
    assert regions == [(y.grad_fn, first)] * 2 + [(y.grad_fn, recomputation)] * 2
    assert isinstance(recomputation, int) and recomputation != -1
    regions.clear()
    outer = checkpoint(lambda x: checkpoint(region, x, use_reentrant=True), x, use_reentrant=True)
    inner_node = regions[0][0]
    assert inner_node is not outer.grad_fn and type(inner_node).__name__ == "CheckpointFunctionBackward"
    regions.clear()
    checkpoint(region, x, use_reentrant=False).sum().backward()
    with torch.no_grad():
        region(x)
    assert regions == [None] * 6


def test_a_selective_recomputation_is_told_apart() -> None:
    # only the recomputation of a region under create_selective_checkpoint_contexts, whose cached
    # mode expects the first run's ops again, one for one
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    seen: list = []

    def region(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch_internals.in_selective_recomputation())
        return x.sin()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE

    x = torch.randn(3, requires_grad=True)
    context = functools.partial(create_selective_checkpoint_contexts, policy)
    checkpoint(region, x, use_reentrant=False, context_fn=context).sum().backward()
    checkpoint(region, x, use_reentrant=False).sum().backward()
    assert seen == [False, True, False, False]
    with torch_internals.outside_dispatch_modes():
        assert not torch.utils._python_dispatch._get_current_dispatch_mode_stack()


def test_a_nonreentrant_regions_first_run_is_seen_to_end() -> None:
    # open while the region's first run runs, ended after it; anything else is never ended
    seen: list = []

    def region(x: torch.Tensor) -> torch.Tensor:
        frame = torch_internals.nonreentrant_checkpoint_region()[0]
        seen.append((frame, torch_internals.checkpoint_first_run_ended(frame)))
        return x.sin()

    checkpoint(region, torch.randn(3, requires_grad=True), use_reentrant=False)
    frame, during = seen[0]
    assert not during and torch_internals.checkpoint_first_run_ended(frame)
    assert not torch_internals.checkpoint_first_run_ended(object())
