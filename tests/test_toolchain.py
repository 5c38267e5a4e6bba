"""Our layers in PyTorch's tool chain, side by side with nn.BatchNorm* (or with eager): torch.compile
(fullgraph, one compile per mode, several training steps), torch.export, torch.fx, torch.func
(grad and vmap with functorch's batch-norm recipe), double backward, and ThreadedDataParallel
under torch.compile."""
from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import pytest
import torch
import torch._dynamo
from torch import nn
from torch.func import functional_call, grad, vmap

from helpers import SmallResNet, assert_same_state, randomize_affine, run_threads, stock_replicas
from syncbn import nn as NN
from syncbn.modules.parallel import ThreadedDataParallel
from testkit.local_group import run_local_group


@contextmanager
def no_recompile_after_a_step() -> Iterator[Callable[[], None]]:
    """For a loop over compiled steps: call what it gives at the end of a step, and from then on
    every step must reuse what was compiled (a recompile raises ``RecompileError``); the
    setting is restored on leaving, failures included."""
    with torch._dynamo.config.patch(error_on_recompile=False):
        yield lambda: setattr(torch._dynamo.config, "error_on_recompile", True)


def converted_pair(dtype: torch.dtype = torch.float64) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    theirs = randomize_affine(SmallResNet()).to(dtype)
    return theirs, NN.convert_sync_batchnorm(copy.deepcopy(theirs))


def test_compile_fullgraph_matches_eager_and_compiles_once_per_mode() -> None:
    _, ours = converted_pair()
    eager = copy.deepcopy(ours)
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True, dynamic=False)
    with no_recompile_after_a_step() as step_done:
        for _ in range(4):
            x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
            outputs = []
            for model in (compiled, eager):
                model.zero_grad()
                y = model(x)
                y.square().sum().backward()
                outputs.append(y)
            torch.testing.assert_close(outputs[0], outputs[1], atol=1e-10, rtol=1e-10)
            assert_same_state(ours, eager, atol=1e-10, rtol=1e-10)
            step_done()  # every later step must reuse the first step's graph
    torch._dynamo.reset()
    ours.eval(), eager.eval()
    compiled = torch.compile(ours, fullgraph=True, dynamic=False)
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(compiled(x), eager(x), atol=1e-12, rtol=1e-12)


def test_compile_of_frozen_and_fused_layers() -> None:
    torch.manual_seed(0)
    layer = NN.BatchNorm2d(4, activation="relu").double()
    frozen = NN.BatchNorm2d(4, frozen=True).double()
    x, z = torch.randn(3, 4, 5, 5, dtype=torch.float64), torch.randn(3, 4, 5, 5, dtype=torch.float64)
    for module in (layer, frozen):
        eager = copy.deepcopy(module)
        torch._dynamo.reset()
        y = torch.compile(module, fullgraph=True)(x, z)
        torch.testing.assert_close(y, eager(x, z), atol=1e-12, rtol=1e-12)


def test_export_in_training_and_eval() -> None:
    _, ours = converted_pair()
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    for training in (True, False):
        ours.train(training)
        exported = torch.export.export(copy.deepcopy(ours), (x,))
        reference = copy.deepcopy(ours)
        torch.testing.assert_close(exported.module()(x), reference(x), atol=1e-12, rtol=1e-12)
        names = {str(node.target) for node in exported.graph.nodes}
        if training:
            assert any("syncbn" in name for name in names), names


def test_fx_symbolic_trace_gives_one_node_per_layer() -> None:
    theirs, ours = converted_pair()
    def bn_nodes(model: nn.Module) -> list[tuple[str, str]]:
        graph = torch.fx.symbolic_trace(model).graph
        return [(n.op, n.target) for n in graph.nodes if "bn" in str(n.target)]

    assert bn_nodes(ours) == bn_nodes(theirs) and len(bn_nodes(ours)) == 6
    traced = torch.fx.symbolic_trace(ours)
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(traced(x), copy.deepcopy(ours)(x))
    fused = NN.fuse_bn_act(NN.convert_sync_batchnorm(copy.deepcopy(theirs)))
    assert sum(getattr(m, "activation", None) == "relu" for m in fused.modules()) == 3  # bn, bn1 of each block


def functorch_pair() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    theirs = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2)).double()
    randomize_affine(theirs)
    ours = NN.convert_sync_batchnorm(copy.deepcopy(theirs))
    for model in (theirs, ours):
        torch.func.replace_all_batch_norm_modules_(model)
    return theirs, ours


def squared_error(model: nn.Module):
    def loss(params: dict, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (functional_call(model, params, (x,)) - target).square().sum()

    return loss


def test_func_grad_and_per_sample_vmap_match_torch() -> None:
    theirs, ours = functorch_pair()
    x, target = torch.randn(5, 3, 6, 6, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    results = []
    for model in (theirs, ours):
        params = {k: v.detach() for k, v in model.named_parameters()}
        whole = grad(squared_error(model))(params, x, target)
        per_sample = vmap(grad(squared_error(model)), in_dims=(None, 0, 0))(params, x.unsqueeze(1), target.unsqueeze(1))
        results.append((whole, per_sample))
    for (whole_t, per_t), (whole_o, per_o) in [results]:
        for key in whole_t:
            torch.testing.assert_close(whole_o[key], whole_t[key], atol=1e-10, rtol=1e-10)
            torch.testing.assert_close(per_o[key], per_t[key], atol=1e-10, rtol=1e-10)


def test_vmap_over_the_functional_forms() -> None:
    from syncbn.functions import frozen_batch_norm, sync_batch_norm

    x = torch.randn(5, 2, 3, 4, 4, dtype=torch.float64)
    weight, mean, var = torch.rand(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64), torch.rand(3, dtype=torch.float64) + 1
    y = vmap(lambda v: sync_batch_norm(v, None, None, weight, None))(x)
    expected = torch.stack([nn.functional.batch_norm(v, None, None, weight, None, True) for v in x])
    torch.testing.assert_close(y, expected, atol=1e-12, rtol=1e-12)
    y = vmap(lambda v: frozen_batch_norm(v, mean, var, weight, None, 1e-5, v, 0.0))(x)
    expected = torch.relu(nn.functional.batch_norm(x.flatten(0, 1), mean, var, weight, None, False) + x.flatten(0, 1))
    torch.testing.assert_close(y, expected.view_as(y), atol=1e-12, rtol=1e-12)
    running = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="not vmapped"):
        vmap(lambda v: sync_batch_norm(v, running, running.clone(), weight, None))(x)


@pytest.mark.parametrize("kind", ["training", "fused", "frozen"])
def test_double_backward_matches_torch(kind: str) -> None:
    # a gradient penalty: the gradient of a function of the input gradient
    torch.manual_seed(0)
    theirs = randomize_affine(nn.BatchNorm2d(3)).double()
    ours = NN.convert_sync_batchnorm(copy.deepcopy(theirs))
    if kind == "frozen":
        theirs.eval(), ours.freeze()
    if kind == "fused":
        ours.activation = "relu"
    x = torch.randn(4, 3, 3, 3, dtype=torch.float64)
    z = torch.randn(4, 3, 3, 3, dtype=torch.float64)
    grads = []
    for model in (theirs, ours):
        xs, zs = x.clone().requires_grad_(), z.clone().requires_grad_()
        y = torch.relu(model(xs) + zs) if model is theirs and kind == "fused" else model(xs, zs) if kind == "fused" else model(xs)
        gx, = torch.autograd.grad(y.pow(3).sum(), xs, create_graph=True)
        gx.square().sum().backward()
        grads.append([xs.grad, model.weight.grad, model.bias.grad] + ([zs.grad] if kind == "fused" else []))
    for got, expected in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)


def test_double_backward_across_replicas_raises_naming_the_layer() -> None:
    layer = NN.SyncBatchNorm2d(3).double()
    layer.layer_name = "encoder.bn1"
    replicas = stock_replicas(layer, 2)
    chunks = [torch.randn(n, 3, 2, 2, dtype=torch.float64, requires_grad=True) for n in (2, 3)]
    outputs = run_threads([lambda r=r, c=c: r(c) for r, c in zip(replicas, chunks)])
    results = run_threads(
        [lambda o=o, c=c: torch.autograd.grad(o.pow(3).sum(), c, create_graph=True) for o, c in zip(outputs, chunks)]
    )
    assert all(isinstance(r, RuntimeError) for r in results), results
    assert any("encoder.bn1" in str(r) and "double backward" in str(r) for r in results), results


TRANSFORMS = {
    "grad": lambda f, x: grad(lambda v: f(v).square().sum())(x),
    "vjp-of-input": lambda f, x: torch.func.vjp(f, x)[1](torch.ones_like(x)),
    "jvp": lambda f, x: torch.func.jvp(f, (x,), (torch.ones_like(x),)),
    "vmap": lambda f, x: vmap(f)(x.unsqueeze(1)),
}


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_a_transform_over_synchronized_replicas_raises_naming_the_layer(transform: str) -> None:
    # every replica raises at once (the one under the transform says why; the others are released)
    layer = NN.SyncBatchNorm2d(3, timeout=30).double()
    layer.layer_name = "encoder.bn1"
    replicas = stock_replicas(layer, 2)
    chunks = [torch.randn(n, 3, 2, 2, dtype=torch.float64) for n in (2, 3)]
    start = time.monotonic()
    results = run_threads([lambda r=r, c=c: TRANSFORMS[transform](r, c) for r, c in zip(replicas, chunks)])
    assert time.monotonic() - start < 30 / 2  # at once: well within the 30 s timeout it guards
    assert all(isinstance(r, RuntimeError) for r in results), results
    assert any("encoder.bn1" in str(r) and "torch.func transforms" in str(r) and "torch.autograd" in str(r)
               for r in results), results
    assert int(layer.num_batches_tracked) == 0


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_a_transform_over_threaded_data_parallel_raises_naming_it(transform: str) -> None:
    # refused before its replicas are made: their threads would run outside the transform
    model = ThreadedDataParallel(NN.SyncBatchNorm2d(3).double(), ["cpu"] * 2)
    with pytest.raises(RuntimeError, match=r"^ThreadedDataParallel: torch\.func transforms .*torch\.autograd"):
        TRANSFORMS[transform](model, torch.randn(4, 3, 2, 2, dtype=torch.float64))
    assert int(model.module.num_batches_tracked) == 0
    model(torch.randn(4, 3, 2, 2, dtype=torch.float64)).sum().backward()  # then it runs as usual


def _transform_across_ranks(rank: int, world: int) -> list[str]:
    layer = NN.SyncBatchNorm2d(3).double()
    x = torch.randn(2 + rank, 3, 2, 2, dtype=torch.float64)
    seen = []
    for transform in TRANSFORMS.values():
        try:
            transform(layer, x)
            seen.append("no error")
        except RuntimeError as error:
            seen.append(str(error))
    y = layer(x)  # the ranks' calls stay paired: the next call meets as usual
    y.sum().backward()
    return seen


def test_a_transform_across_ranks_raises_naming_the_layer_on_every_rank() -> None:
    for seen in run_local_group(_transform_across_ranks, 2, timeout_s=20):
        assert all("SyncBatchNorm2d(3)" in s and "torch.func transforms" in s for s in seen), seen


def test_threaded_data_parallel_under_compile() -> None:
    # the threaded step runs eagerly (Dynamo cannot trace threads, and the replicas are new
    # modules at every step): one graph break, there, and no recompile over the steps
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    theirs, ours = converted_pair()
    parallel = ThreadedDataParallel(ours, ["cpu"] * 3)
    compiled = torch.compile(parallel)
    with no_recompile_after_a_step() as step_done:
        for step in range(3):
            x = torch.randn(7, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
            for model, inp in ((theirs, x.clone().requires_grad_()), (compiled, x.clone().requires_grad_())):
                model(inp).square().sum().backward()
            assert_same_state(theirs, ours, atol=1e-9, rtol=1e-9)
            step_done()
    breaks = dict(counters["graph_break"])
    assert breaks and all("_forward_in_threads" in reason for reason in breaks), breaks


def compiled_ddp_worker(rank: int, world_size: int) -> tuple[list[float], int, list[str]]:
    """Eager DDP and compiled DDP of the same model, 3 steps on this rank's rows of the batch
    (a recompile after the first step raises): the largest differences of grads and buffers per
    step, the graph breaks at our layers and the other breaks' reasons."""
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = NN.convert_sync_batchnorm(SmallResNet()).double()
    eager, inner = DDP(copy.deepcopy(base), broadcast_buffers=False), DDP(copy.deepcopy(base), broadcast_buffers=False)
    compiled = torch.compile(inner)
    differences = []
    with no_recompile_after_a_step() as step_done:
        for step in range(3):
            x = torch.randn(6, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
            for model in (eager, compiled):
                model.zero_grad()
                model(x[rank * 3 : (rank + 1) * 3]).square().sum().backward()
            differences.append(max((p.grad - q.grad).abs().max().item() for p, q in zip(eager.parameters(), inner.parameters())))
            differences.append(max((p - q).abs().max().item() for p, q in zip(eager.buffers(), inner.buffers())))
            step_done()
    ours = sum(n for reason, n in counters["graph_break"].items() if "_forward_synced" in reason)
    others = [reason for reason in counters["graph_break"] if "_forward_synced" not in reason]
    return differences, ours, others


# where compiled DDP breaks the graph itself, whatever the layers (torch 2.13): its forward's
# bookkeeping, which Dynamo skips
DDP_OWN_BREAKS = ("DistributedDataParallel._inside_ddp_forward", "set_runtime_stats_and_log")


@pytest.mark.exhaustive  # tests/test_distributed_compiled.py compiles across ranks in the quick suite
def test_ddp_under_compile_matches_eager_with_no_break_at_our_layers() -> None:
    # torch.compile(DDP(model)): the exchange across ranks is in the graph (functions/synchronization/traced_ranks.py)
    from testkit.local_group import run_local_group

    for differences, breaks_at_ours, others in run_local_group(compiled_ddp_worker, 2, timeout_s=60):
        assert max(differences) < 1e-10, differences
        assert breaks_at_ours == 0, breaks_at_ours
        assert all(any(own in reason for own in DDP_OWN_BREAKS) for reason in others), others
