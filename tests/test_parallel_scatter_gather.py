"""ThreadedDataParallel as a DataParallel: scatter and gather of arguments and outputs of every
container type, gradients (per source tensor, of rows no replica got, laid out as the input), grad
mode, dim, output device and a single device, fewer chunks than devices, in-place ops on the
chunks and the caller's tensors; also for modules without batch norm. The replicas' threads:
tests/test_parallel_threads.py."""
from __future__ import annotations

import threading
from collections import namedtuple

import pytest
import torch
from torch import nn

from syncbn import nn as NN
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


def test_a_tensor_argument_that_is_neither_batch_sized_nor_broadcast_raises_naming_it() -> None:
    # nn.DataParallel would cut y into 3 chunks and run 3 replicas, leaving x's last rows to none
    x = torch.randn(10, 4, requires_grad=True)
    y = torch.randn(3, 4, requires_grad=True)

    class Scale(nn.Module):
        def forward(self, x, y):
            return x * y.sum()

    with pytest.raises(ValueError, match=r"argument 1 has size 3 along dim 0, but the batch has 10"):
        ThreadedDataParallel(Scale(), ["cpu"] * 4)(x, y)


def test_a_size_one_tensor_argument_reaches_every_replica_whole() -> None:
    # a broadcast mask or scale: each replica gets it whole, as the layer broadcasts it over its rows
    x = torch.randn(6, 4, requires_grad=True)
    scale = torch.randn(1, 4, requires_grad=True)

    class Scale(nn.Module):
        def forward(self, x, *, scale):
            return x * scale

    out = ThreadedDataParallel(Scale(), ["cpu"] * 3)(x, scale=scale)
    torch.testing.assert_close(out, x * scale)
    out.sum().backward()
    torch.testing.assert_close(scale.grad, x.detach().sum(0, keepdim=True))


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
