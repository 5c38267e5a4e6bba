"""ThreadedDataParallel as a DataParallel: scatter, gather, gradients, grad mode, errors; also
for modules without batch norm."""
from __future__ import annotations

import threading
import time
from collections import namedtuple

import pytest
import torch
from torch import nn

from syncbn import nn as NN
from syncbn.functions import ReplicaSyncError
from syncbn.modules.parallel import ThreadedDataParallel

Pair = namedtuple("Pair", "first second")


class Recorder(nn.Module):
    """Linear layer that records the chunk sizes and threads it ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2).double()
        self.seen: list = []

    def forward(self, x, scale=1.0, *, extra=None):
        self.seen.append((x.size(0), threading.get_ident(), torch.is_grad_enabled()))
        y = self.linear(x) * scale
        return {"y": y, "pair": Pair(y.sum(), y * 2), "extra": extra}


def test_scatter_gather_and_grads_without_batch_norm() -> None:
    module = Recorder()
    model = ThreadedDataParallel(module, ["cpu"] * 4)
    x = torch.randn(10, 3, dtype=torch.float64, requires_grad=True)
    scale = torch.full((10, 1), 3.0, dtype=torch.float64)
    out = model(x, scale, extra="tag")
    assert sorted(size for size, *_ in module.seen) == [1, 3, 3, 3]
    assert out["extra"] == "tag" and out["y"].shape == (10, 2) and out["pair"].first.shape == (4,)
    loss = out["y"].square().sum() + out["pair"].first.sum() + out["pair"].second.sum()
    grads = torch.autograd.grad(loss, [x, module.linear.weight, module.linear.bias])

    x_ref = x.detach().clone().requires_grad_()
    y_ref = module.linear(x_ref) * scale
    loss_ref = y_ref.square().sum() + y_ref.sum() + (y_ref * 2).sum()
    grads_ref = torch.autograd.grad(loss_ref, [x_ref, module.linear.weight, module.linear.bias])
    torch.testing.assert_close(out["y"], y_ref)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref)


def test_forward_and_backward_run_replicas_concurrently() -> None:
    # a barrier that all three replicas must reach together: serial execution would break it.
    # Each backward runs with autograd multithreading off on its replica thread, so the engine
    # runs CUDA nodes there too instead of queueing them on its device thread, which (running
    # the gather's backward, waiting for the replicas) would never take them: the deadlock of
    # replicas on CUDA
    forward_barrier, backward_barrier = threading.Barrier(3, timeout=10), threading.Barrier(3, timeout=10)
    threads: list = []
    multithreading: list = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            threads.append(threading.get_ident())
            multithreading.append(torch._C._is_multithreading_enabled())
            backward_barrier.wait()
            return grad

    class Model(nn.Module):
        def forward(self, x):
            forward_barrier.wait()
            return Spy.apply(x) * 2

    x = torch.randn(6, 2, requires_grad=True)
    ThreadedDataParallel(Model(), ["cpu"] * 3)(x).sum().backward()
    assert len(set(threads)) == 3 and threading.get_ident() not in threads
    assert multithreading == [False] * 3
    assert torch._C._is_multithreading_enabled()  # the caller's own setting is untouched
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


def raises_soon(run, release: threading.Event, pattern: str) -> str:
    """``run()`` raises a ReplicaSyncError matching ``pattern`` within 5 s (its message is
    returned); then the stuck replica is released."""
    start = time.monotonic()
    try:
        with pytest.raises(ReplicaSyncError, match=pattern) as caught:
            run()
        assert time.monotonic() - start < 5
    finally:
        release.set()
    return str(caught.value)


def test_a_replica_stuck_outside_the_exchanges_is_named_after_the_timeout() -> None:
    # without a synchronized layer the wrapper's bound (10 timeouts after the other replica
    # ended) names the stuck replica, with its stack; with one after its hang point, the other
    # replica waits in the layer's round, whose own timeout names the layer first (and, the
    # longer, sets the wrapper's wait after that failure: 3 x 0.2 s)
    release = threading.Event()

    class StuckOnOneRow(nn.Module):
        def forward(self, x):
            if x.size(0) == 1:
                release.wait(30)
            return x * 2

    runner = ThreadedDataParallel(StuckOnOneRow(), ["cpu"] * 2, timeout=0.1)
    message = raises_soon(lambda: runner(torch.randn(3, 2)), release, r"replica\(s\) \[1\] did not finish in time after replicas \[0\]")
    assert "--- replica 1 (thread" in message and "release.wait(30)" in message  # where it hangs
    assert runner(torch.randn(4, 2)).shape == (4, 2)  # the next step runs on fresh workers

    release.clear()
    synced = ThreadedDataParallel(nn.Sequential(StuckOnOneRow(), NN.SyncBatchNorm1d(2, timeout=0.2)), ["cpu"] * 2, timeout=0.1)
    raises_soon(lambda: synced(torch.randn(3, 2)), release, r"'1', forward call 0 .* \[1\] missing")


def test_replicas_that_end_apart_after_the_last_exchange_are_waited_for() -> None:
    # uneven work after the synchronized layers (chunks of 3 and 1 rows, a head per replica) is
    # not a hang: the wrapper waits for the slow replica well past the layers' timeouts
    class SlowTailOnThreeRows(nn.Module):
        def forward(self, x):
            if x.size(0) == 3:
                time.sleep(0.8)
            return x * 2

    model = nn.Sequential(NN.SyncBatchNorm1d(2, timeout=0.1), SlowTailOnThreeRows())
    assert ThreadedDataParallel(model, ["cpu"] * 2, timeout=0.1)(torch.randn(5, 2)).shape == (5, 2)  # 3 + 2 rows


def test_grad_mode_follows_the_caller() -> None:
    module = Recorder()
    model = ThreadedDataParallel(module, ["cpu"] * 2)
    with torch.no_grad():
        out = model(torch.randn(4, 3, dtype=torch.float64, requires_grad=True))
    assert not out["y"].requires_grad and all(not grad for *_, grad in module.seen)


def test_dim_and_output_device_and_single_device() -> None:
    linear = nn.Linear(4, 4)
    x = torch.randn(2, 5, 4)
    for devices in (["cpu"], ["cpu"] * 3):
        model = ThreadedDataParallel(linear, devices, output_device="cpu", dim=1)
        torch.testing.assert_close(model(x), linear(x))


def test_fewer_chunks_than_devices_and_batch_norm_statistics() -> None:
    layer = NN.SyncBatchNorm1d(3).double()
    ref = nn.BatchNorm1d(3).double()
    x = torch.randn(2, 3, dtype=torch.float64)
    torch.testing.assert_close(ThreadedDataParallel(layer, ["cpu"] * 4)(x), ref(x))
    torch.testing.assert_close(layer.running_var, ref.running_var)


def test_replica_error_is_reraised() -> None:
    class Boom(nn.Module):
        def forward(self, x):
            if x.size(0) == 1:
                raise ZeroDivisionError("small chunk")
            return x

    with pytest.raises(ZeroDivisionError, match="small chunk"):
        ThreadedDataParallel(Boom(), ["cpu"] * 3)(torch.randn(5, 2))


def test_needs_devices_and_the_module_on_the_first() -> None:
    with pytest.raises(ValueError):
        ThreadedDataParallel(nn.Linear(2, 2), [])
    model = ThreadedDataParallel(nn.Linear(2, 2, device="meta"), ["cpu"] * 2)
    with pytest.raises(RuntimeError, match=r"devices\[0\] \(cpu\)"):
        model(torch.randn(4, 2))


def test_names_our_layers_for_error_messages() -> None:
    model = nn.Sequential(nn.Sequential(NN.SyncBatchNorm2d(2)))
    ThreadedDataParallel(model, ["cpu"] * 2)
    assert model[0][0].layer_name == "0.0"


def test_backward_runs_under_the_backward_autocast_state() -> None:
    seen: list = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, grad):
            seen.append(torch.is_autocast_enabled("cpu"))
            return grad

    class Model(nn.Module):
        def forward(self, x):
            return Probe.apply(x)

    x = torch.randn(4, 2, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ThreadedDataParallel(Model(), ["cpu"] * 2)(x)
    y.sum().backward()
    assert seen == [False, False]


def test_graph_is_freed_by_backward_and_retained_on_request() -> None:
    model = ThreadedDataParallel(nn.Sequential(nn.Linear(3, 3), nn.Tanh()), ["cpu"] * 2)
    x = torch.randn(4, 3, requires_grad=True)
    y = model(x).pow(3).sum()
    y.backward(retain_graph=True)
    first = x.grad.clone()
    y.backward()
    torch.testing.assert_close(x.grad, 2 * first)
    with pytest.raises(RuntimeError, match="second time"):
        y.backward()


def test_in_place_ops_on_inputs_and_non_differentiable_outputs() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.relu, self.linear = nn.ReLU(inplace=True), nn.Linear(3, 3)

        def forward(self, x):
            return self.linear(self.relu(x)), x.detach() * 2

    a = torch.randn(4, 3, requires_grad=True)
    y, z = ThreadedDataParallel(Model(), ["cpu"] * 2)(a * 1)
    assert y.requires_grad and not z.requires_grad
    y.sum().backward()
    assert a.grad is not None


def test_in_place_ops_on_a_chunk_write_to_the_callers_tensor() -> None:
    # as nn.DataParallel does with the chunk that stays on its device: no copy of the input
    a = torch.randn(8, 3, requires_grad=True)
    x = a * 1
    ThreadedDataParallel(nn.ReLU(inplace=True), ["cpu"] * 4)(x).sum().backward()
    assert x.min() >= 0
    torch.testing.assert_close(a.grad, (a > 0).to(a.dtype))

    # the caller's graph sees the write, as it would without the wrapper
    saved = a.exp()  # exp saves its output
    ThreadedDataParallel(nn.ReLU(inplace=True), ["cpu"] * 4)(saved)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()
    before = a.detach().clone()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        ThreadedDataParallel(nn.ReLU(inplace=True), ["cpu"] * 4)(a)
    assert torch.equal(a, before)  # refused before the write, as torch refuses it

    # the caller writing to an input after the forward: refused, as autograd refuses it
    h = a * 1
    y = ThreadedDataParallel(nn.Linear(3, 2), ["cpu"] * 2)(h)
    h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_rows_of_an_input_that_no_replica_got_have_zero_gradient() -> None:
    # y's 3 rows make 3 chunks, so 3 replicas: x's last chunk (row 9) reaches none
    x = torch.randn(10, 4, requires_grad=True)
    y = torch.randn(3, 4, requires_grad=True)

    class Scale(nn.Module):
        def forward(self, x, y):
            return x * y.sum()

    ThreadedDataParallel(Scale(), ["cpu"] * 4)(x, y).sum().backward()
    assert torch.equal(x.grad[9], torch.zeros(4))
    # replica j got x's rows 3j..3j+2 and y's row j
    torch.testing.assert_close(x.grad[:9], y.detach().sum(1).repeat_interleave(3).unsqueeze(1).expand(9, 4))


class Uses(nn.Module):
    """x twice, y only in replicas with more than one row, and the tensor in a deque (which the
    scatter shares whole with every replica) as a scale."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3).double()

    def forward(self, x, x_again, y, shared):
        out = self.linear(x) * x_again + shared[0]
        return out + y * 3 if y.size(0) > 1 else out


def test_input_gradients_per_source_tensor() -> None:
    from collections import deque

    module = Uses()
    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    shared = torch.randn(3, dtype=torch.float64, requires_grad=True)
    out = ThreadedDataParallel(module, ["cpu"] * 4)(x, x, y, deque([shared]))  # rows 2, 2, 2, 1
    grads = torch.autograd.grad(out.pow(2).sum(), [x, y, shared])

    rows = [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 7)]
    expected = torch.cat([module(x[r], x[r], y[r], [shared]) for r in rows])
    expected_grads = torch.autograd.grad(expected.pow(2).sum(), [x, y, shared])
    torch.testing.assert_close(out, expected)
    for g, g_ref in zip(grads, expected_grads):
        torch.testing.assert_close(g, g_ref)
    assert (grads[1][6] == 0).all()  # the last replica never used y


def test_input_gradient_keeps_the_channels_last_layout() -> None:
    x = torch.randn(4, 3, 2, 2).contiguous(memory_format=torch.channels_last).requires_grad_()
    (grad,) = torch.autograd.grad(ThreadedDataParallel(nn.Identity(), ["cpu"] * 2)(x * 1).sum() * 2, x)
    assert grad.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(grad, torch.full_like(x, 2.0))


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(9, 5, 3, dtype=torch.float64).transpose(1, 2),  # dense, not contiguous: (N, L, C) fed as (N, C, L)
        lambda: torch.randn(9, 6, 5, dtype=torch.float64)[:, ::2],  # not dense
        lambda: torch.randn(9, 6, 10, 3, dtype=torch.float64).permute(0, 3, 1, 2)[..., ::2],  # not dense, channels_last-like
    ],
    ids=["transposed", "strided", "strided-channels-last"],
)
def test_input_gradient_of_a_strided_input_is_exact_and_laid_out_as_empty_like(make) -> None:
    x = make().requires_grad_()
    weight = torch.randn(x.size(-1), dtype=torch.float64)
    out = ThreadedDataParallel(nn.Identity(), ["cpu"] * 4)(x)
    (grad,) = torch.autograd.grad((out * weight).square().sum(), x)
    (expected,) = torch.autograd.grad((x * weight).square().sum(), x)
    torch.testing.assert_close(grad, expected, rtol=0, atol=0)
    assert grad.stride() == torch.empty_like(x).stride()


def test_output_containers_keep_their_types() -> None:
    from collections import OrderedDict

    class Model(nn.Module):
        def forward(self, x):
            return (x, 2 * x), OrderedDict()

    (a, b), empty = ThreadedDataParallel(Model(), ["cpu"] * 2)(torch.arange(4.0))
    assert type(empty) is OrderedDict and not empty
    torch.testing.assert_close(b, 2 * a)


def test_small_batch_with_non_tensor_keyword_arguments() -> None:
    class Model(nn.Module):
        def forward(self, x, scale=1.0):
            return x * scale

    x = torch.randn(2, 3)
    torch.testing.assert_close(ThreadedDataParallel(Model(), ["cpu"] * 4)(x, scale=2.0), x * 2)


class _ThreadsSeenInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, seen: list) -> torch.Tensor:  # type: ignore[override]
        ctx.seen = seen
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ctx.seen.append(("backward", torch.get_num_threads()))
        return grad, None


class ThreadsSeen(nn.Module):
    """Records the intra-op threads that torch's kernels get in the replica's thread."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(("forward", torch.get_num_threads()))
        return _ThreadsSeenInBackward.apply(x, self.seen)


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_cpu_replicas_share_the_callers_intra_op_threads(replicas: int) -> None:
    # R replica threads, each starting a team of all the caller's threads, would put R x threads
    # on the cores; each takes its share instead, and the caller's own setting stays as it was
    from syncbn.functions.operators import backend

    if backend.EXTENSION is None:
        pytest.skip("the per-thread setting needs the compiled module")
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        probe = ThreadsSeen()
        runner = ThreadedDataParallel(probe, ["cpu"] * replicas)
        x = torch.randn(2 * replicas, 3, requires_grad=True)
        runner(x).sum().backward()
        share = max(1, 4 // replicas)
        assert sorted(probe.seen) == sorted([("forward", share)] * replicas + [("backward", share)] * replicas)
        assert torch.get_num_threads() == 4
        seen_elsewhere: list[int] = []
        thread = threading.Thread(target=lambda: seen_elsewhere.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert seen_elsewhere == [4]  # a new thread starts from the process-wide value, untouched
    finally:
        torch.set_num_threads(before)
