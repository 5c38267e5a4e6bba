"""torch.compile across ranks (Gloo, CPU): the exchange as functional collectives in the graph,
equal to eager under DDP (fullgraph, inductor, frozen, fused and in-place activated layers,
subgroups) with no recompiles and no graph break beyond DDP's own; the traced path sends the eager
path's rows; replicas inside ranks break the graph; without the compiled module, ranks meet in the
same functional collectives eagerly. Each behaviour runs on every rank (testkit.process_sets)."""
from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Callable, Iterator

import pytest
import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from syncbn.functions.operators import backend
from syncbn import nn as NN
from testkit.ddp_lockstep import CL2, ResidualBlock, conv_abn_2d, conv_bn_2d, gather_all, in_place, linear_bn_1d, train_against_full_batch
from testkit.local_group import run_local_group
from testkit.process_sets import across_processes, process_sets  # noqa: F401 - the fixture of the tests it makes


class GraphRecorder:
    """A torch.compile backend (AOTAutograd, then the graphs run as traced) that keeps the text
    of every forward and backward graph it compiles."""

    def __init__(self) -> None:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        self.forward: list[str] = []
        self.backward: list[str] = []

        def keep(into: list[str]):
            def compiler(gm: torch.fx.GraphModule, example_inputs) -> Callable:
                into.append(str(gm.graph))
                return make_boxed_func(gm.forward)

            return compiler

        self.backend = aot_autograd(fw_compiler=keep(self.forward), bw_compiler=keep(self.backward))


def compile_fullgraph(backend: object = "aot_eager") -> Callable[[nn.Module], nn.Module]:
    return lambda model: torch.compile(model, fullgraph=True, dynamic=False, backend=backend)


@contextmanager
def no_recompiles() -> Iterator[None]:
    """A fresh compile cache, and an error where anything compiles a second time."""
    import torch._dynamo

    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield
    torch._dynamo.reset()


@across_processes(2, 3)
def test_compiled_fullgraph_equals_eager(rank: int, world: int) -> None:
    # DDP(torch.compile(model, fullgraph=True)): the whole model one graph, collectives inside
    recorder = GraphRecorder()
    with no_recompiles():
        train_against_full_batch(conv_bn_2d, [4, 3, 2][:world], (3, 4, 5), compiled=compile_fullgraph(recorder.backend))
    assert len(recorder.forward) == 1 and len(recorder.backward) == 1, (len(recorder.forward), len(recorder.backward))
    assert recorder.forward[0].count("_c10d_functional.all_gather_into_tensor.default") == 2  # one per layer
    assert recorder.backward[0].count("_c10d_functional.all_reduce.default") == 2
    with no_recompiles():  # an empty rank, 1d layers, channels_last
        train_against_full_batch(conv_bn_2d, [5, 0, 3][:world], (3, 3, 3), steps=2, compiled=compile_fullgraph())
    with no_recompiles():
        train_against_full_batch(linear_bn_1d, [3, 4, 2][:world], (6,), steps=2, compiled=compile_fullgraph())
    with no_recompiles():
        train_against_full_batch(conv_bn_2d, [3, 2, 4][:world], (3, 4, 4), steps=2, memory_format=CL2, compiled=compile_fullgraph())


@across_processes(2)
def test_compiled_with_inductor(rank: int, world: int) -> None:
    with no_recompiles():
        train_against_full_batch(conv_bn_2d, [4, 3], (3, 4, 5), compiled=compile_fullgraph("inductor"))


@across_processes(2)
def test_compiled_frozen_fused_and_options(rank: int, world: int) -> None:
    fuse = lambda model: NN.fuse_bn_act(NN.convert_sync_batchnorm(model))  # noqa: E731
    with no_recompiles():
        train_against_full_batch(conv_bn_2d, [4, 3], (3, 4, 5), make_ours=fuse, steps=2, compiled=compile_fullgraph())
    with no_recompiles():
        train_against_full_batch(ResidualBlock, [2, 3], (4, 3, 3), make_ours=ResidualBlock.fused, steps=2, compiled=compile_fullgraph())
    with no_recompiles():
        train_against_full_batch(
            conv_bn_2d, [4, 3], (3, 4, 5), make_ours=NN.freeze_batchnorm, ref_training=False, steps=2, compiled=compile_fullgraph()
        )
    with no_recompiles():
        train_against_full_batch(lambda: conv_bn_2d(affine=False), [3, 2], (3, 3, 3), steps=2, compiled=compile_fullgraph())


@across_processes(2)
def test_compiled_inplace_abn(rank: int, world: int) -> None:
    # the in-place layers meet in the graph too (TracedInPlaceABNFunction), an empty rank included
    with no_recompiles():
        train_against_full_batch(conv_abn_2d, [4, 3], (3, 4, 5), make_ours=in_place, compiled=compile_fullgraph())
    with no_recompiles():
        train_against_full_batch(conv_abn_2d, [5, 0], (3, 3, 3), make_ours=in_place, steps=2, compiled=compile_fullgraph())


@across_processes(2)
def test_compiled_ranks_judge_the_eager_rows(rank: int, world: int) -> None:
    # the traced path sends the eager path's row (functions.synchronization.distributed.stats_header): a rank at
    # another layer, or with another dtype, fails the device's check and updates nothing
    from syncbn.functions.synchronization import distributed, traced_ranks

    x = torch.randn(3, 4, dtype=torch.float64)
    row = traced_ranks._rank_row(x, "layer")
    header = distributed.stats_header(distributed.layer_key("layer"), 0, x.dtype, False, x.shape, 3)
    assert row[: distributed.HEADER_SIZE].tolist() == [float(v) for v in header]
    first, second = NN.SyncBatchNorm1d(4).double(), NN.SyncBatchNorm1d(4).double()
    first.layer_name, second.layer_name = "first", "second"
    layer = torch.compile(first if rank == 0 else second, fullgraph=True, backend="eager")
    with pytest.raises(RuntimeError, match="the ranks disagree on the layer, its dtype"):
        layer(x)
    assert int(first.num_batches_tracked) == int(second.num_batches_tracked) == 0
    torch._dynamo.reset()


@across_processes(4)
def test_compiled_subgroups(rank: int, world: int) -> None:
    group = NN.consecutive_rank_groups(2)
    with no_recompiles():
        ours = train_against_full_batch(conv_bn_2d, [3, 2] if rank < 2 else [2, 4], (3, 3, 3), group=group, steps=2, compiled=compile_fullgraph())
    means = gather_all(ours[1].running_mean)
    assert torch.equal(means[0], means[1]) and torch.equal(means[2], means[3]) and not torch.allclose(means[0], means[2])


class HeadedResidualNet(nn.Module):
    """Conv, BN, ReLU, a residual block, and a BatchNorm1d head: a model of the user's own (the
    compiler starts frames in it, not in torch.nn's containers)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU())
        self.block = ResidualBlock()
        self.head = nn.BatchNorm1d(4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(self.stem(x)).mean((2, 3)))


def graph_breaks(model: nn.Module, x: Tensor, steps: int = 2) -> int:
    """Graph breaks of ``steps`` training steps of ``torch.compile(model)``."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    for _ in range(steps):
        compiled(x).sum().backward()
    breaks = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    return breaks


@across_processes(2)
def test_compiled_ddp_adds_no_graph_break(rank: int, world: int) -> None:
    # torch.compile(DDP(model)): DDP's own breaks, and none of ours beyond them
    torch.manual_seed(0)
    theirs = HeadedResidualNet().double()
    ours = NN.convert_sync_batchnorm(copy.deepcopy(theirs))
    x = torch.randn(3 + rank, 3, 4, 4, dtype=torch.float64)
    torch_breaks = graph_breaks(DistributedDataParallel(theirs), x)
    assert torch_breaks > 0  # DDP's own
    assert graph_breaks(DistributedDataParallel(ours), x) == torch_breaks


@across_processes(2)
def test_compiled_replicas_inside_ranks_break_the_graph(rank: int, world: int) -> None:
    # two levels: replicas of one process meet eagerly, so there the layer is a graph break
    # (fullgraph refuses, at trace time: nothing waits for the other replica)
    import torch._dynamo

    from helpers import stock_replicas

    torch._dynamo.reset()
    replica = stock_replicas(NN.convert_sync_batchnorm(conv_bn_2d().double()), 2)[0]
    with pytest.raises(torch._dynamo.exc.Unsupported, match="disable"):
        torch.compile(replica, fullgraph=True, backend="aot_eager")(torch.randn(2, 3, 3, 3, dtype=torch.float64))
    torch._dynamo.reset()


def _ranks_without_the_compiled_module(rank: int, world: int) -> list:
    # ranks alone meet in the traced path's functional collectives, eagerly
    backend.NATIVE_ROUNDS = None  # this process only
    torch.manual_seed(0)
    full = torch.randn(7, 3, 4, 4, dtype=torch.float64)
    ours = NN.SyncBatchNorm2d(3).double()
    x = (full[:3] if rank == 0 else full[3:]).clone().requires_grad_()
    y = ours(x)
    (y * torch.arange(y.numel(), dtype=torch.float64).view_as(y)).sum().backward()
    return [y.detach(), x.grad, ours.running_mean, ours.running_var]


def test_ranks_without_the_compiled_module_meet_in_functional_collectives() -> None:
    torch.manual_seed(0)
    full = torch.randn(7, 3, 4, 4, dtype=torch.float64)
    ref = nn.BatchNorm2d(3).double()
    xr = full.clone().requires_grad_()
    y0 = ref(xr)
    yr = torch.cat([y0[:3], y0[3:]])
    weights = torch.cat([torch.arange(3 * 48, dtype=torch.float64).view(3, 3, 4, 4),
                         torch.arange(4 * 48, dtype=torch.float64).view(4, 3, 4, 4)])
    (yr * weights).sum().backward()
    results = run_local_group(_ranks_without_the_compiled_module, 2)
    torch.testing.assert_close(torch.cat([results[0][0], results[1][0]]), y0.detach(), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(torch.cat([results[0][1], results[1][1]]), xr.grad, atol=1e-10, rtol=1e-10)
    for rank in range(2):
        torch.testing.assert_close(results[rank][2], ref.running_mean, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(results[rank][3], ref.running_var, atol=1e-12, rtol=1e-12)
