"""The activated layers (modules/inplace_abn.py): ABN, InPlaceABN and InPlaceABNSync against torch's
batch norm with |weight| + eps followed by the activation, alone, under thread replicas (both
replicate() flavours), frozen and in eval; in place (the output is the input's storage, autograd
keeps it alone); inplace_abn's state_dict; bad input; the converter. Across processes:
tests/test_distributed_training.py (test_inplace_abn) and tests/test_distributed_compiled.py
(test_compiled_inplace_abn)."""
from __future__ import annotations

import copy
import pickle
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from helpers import run_threads, stock_replicas
from syncbn import nn as NN
from syncbn.modules.parallel import ThreadedDataParallel

TOL = dict(atol=1e-10, rtol=1e-10)
ACTIVATIONS = [("leaky_relu", 0.01), ("leaky_relu", 0.3), ("elu", 1.0), ("elu", 0.5), ("identity", 0.01)]


class TorchABN(nn.Module):
    """The reference: torch's batch norm whose weight is |w| + eps of ours, then the activation."""

    def __init__(self, ours: NN.ABN, in_place_scale: bool) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(ours.num_features, ours.eps, ours.momentum, ours.affine, ours.track_running_stats, dtype=torch.float64)
        self.bn.load_state_dict(ours.state_dict())
        self.in_place_scale = in_place_scale
        self.activation, self.param = ours.activation, ours.activation_param

    def forward(self, x: Tensor) -> Tensor:
        bn = self.bn
        weight = bn.weight.abs() + bn.eps if (self.in_place_scale and bn.weight is not None) else bn.weight
        training = bn.training or bn.running_mean is None
        if bn.training and bn.track_running_stats:
            bn.num_batches_tracked.add_(1)
        momentum = (1.0 / bn.num_batches_tracked.item()) if bn.momentum is None and bn.training and bn.track_running_stats else (bn.momentum or 0.0)
        y = F.batch_norm(x, bn.running_mean, bn.running_var, weight, bn.bias, training, momentum, bn.eps)
        if self.activation == "leaky_relu":
            return F.leaky_relu(y, self.param)
        if self.activation == "elu":
            return F.elu(y, self.param)
        if self.activation == "relu":
            return F.relu(y)
        return y


def make_pair(cls: type, activation: str, param: float, channels: int = 4, **kwargs) -> tuple[nn.Module, nn.Module]:
    """(reference, ours): ``cls`` with random weight (negative ones too) and bias, in float64."""
    torch.manual_seed(0)
    ours = cls(channels, activation=activation, activation_param=param, **kwargs).double()
    if ours.weight is not None:
        with torch.no_grad():
            ours.weight.copy_(torch.randn(channels, dtype=torch.float64))
            ours.bias.copy_(torch.randn(channels, dtype=torch.float64))
    ref = TorchABN(ours, in_place_scale=cls is not NN.ABN).double()
    return ref, ours


class Then(nn.Module):
    """A linear step before the layer, so that the layer's input is not a leaf (in place)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x * 2.0)


def train_pair(ref: nn.Module, ours: nn.Module, shape, runner=None, steps: int = 3, memory_format=torch.contiguous_format):
    """Both models side by side over ``steps`` steps without an optimizer (the weights'
    parametrizations differ): outputs, input gradients, weight and bias gradients, and every
    buffer."""
    ref, ours = Then(ref), Then(ours)
    runner = Then(runner) if runner is not None else ours
    for step in range(steps):
        x = (torch.randn(*shape, dtype=torch.float64) * 3 + 1).contiguous(memory_format=memory_format)
        x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_ref, y_ours = ref(x_ref), runner(x_ours)
        dy = torch.randn_like(y_ref)
        y_ref.backward(dy)
        y_ours.backward(dy)
        torch.testing.assert_close(y_ours, y_ref, **TOL)
        torch.testing.assert_close(x_ours.grad, x_ref.grad, **TOL)
        if ours.layer.weight is not None:  # the reference differentiates |w| + eps: its sign too
            torch.testing.assert_close(ours.layer.weight.grad, ref.layer.bn.weight.grad, **TOL)
        if ours.layer.bias is not None:
            torch.testing.assert_close(ours.layer.bias.grad, ref.layer.bn.bias.grad, **TOL)
        for name, buffer in ours.layer.named_buffers():
            torch.testing.assert_close(buffer, getattr(ref.layer.bn, name), atol=1e-12, rtol=1e-12, msg=lambda m: f"step {step} {name}: {m}")
        for module in (ref, ours):
            module.zero_grad(set_to_none=True)


@pytest.mark.parametrize("activation,param", ACTIVATIONS)
@pytest.mark.parametrize("cls", [NN.InPlaceABN, NN.InPlaceABNSync, NN.ABN])
def test_alone_equals_torch(cls, activation, param):
    ref, ours = make_pair(cls, activation, param)
    train_pair(ref, ours, (5, 4, 3, 3))
    ref.eval(), ours.eval()
    train_pair(ref, ours, (2, 4, 3, 3), steps=1)


@pytest.mark.parametrize("options", [dict(momentum=None), dict(affine=False), dict(track_running_stats=False)])
def test_options(options):
    ref, ours = make_pair(NN.InPlaceABN, "leaky_relu", 0.1, **options)
    train_pair(ref, ours, (4, 4, 2, 3))
    ref.eval(), ours.eval()
    train_pair(ref, ours, (3, 4, 2, 3), steps=1)


@pytest.mark.parametrize("shape,memory_format", [
    ((6, 4), torch.contiguous_format), ((3, 4, 5), torch.contiguous_format),
    ((2, 4, 3, 5), torch.channels_last), ((2, 4, 2, 3, 2), torch.channels_last_3d),
])
def test_shapes_and_layouts(shape, memory_format):
    ref, ours = make_pair(NN.InPlaceABN, "elu", 1.0)
    train_pair(ref, ours, shape, memory_format=memory_format)


def test_relu_abn():
    ref, ours = make_pair(NN.ABN, "relu", 0.0)
    train_pair(ref, ours, (5, 4, 3, 3))


def test_frozen():
    ref, ours = make_pair(NN.InPlaceABN, "leaky_relu", 0.01, frozen=True)
    with torch.no_grad():
        for layer in (ours, ref.bn):
            layer.running_mean.copy_(torch.linspace(-1, 1, 4))
            layer.running_var.copy_(torch.linspace(0.5, 2, 4))
    ref.eval()  # frozen: eval-mode batch norm in training
    train_pair(ref, ours, (3, 4, 2, 2))
    assert int(ours.num_batches_tracked) == 0


@pytest.mark.parametrize("activation,param", [("leaky_relu", 0.01), ("elu", 1.0)])
@pytest.mark.parametrize("replicate", ["threaded", "stock"])
def test_thread_replicas_uneven(activation, param, replicate):
    """Statistics over 3 replicas of uneven batches (7 = 3 + 3 + 1) equal the full batch's."""
    ref, ours = make_pair(NN.InPlaceABN, activation, param)
    if replicate == "threaded":
        runner = ThreadedDataParallel(ours, ["cpu"] * 3)
        train_pair(ref, ours, (7, 4, 3, 3), runner=runner)
        return
    for step in range(2):  # torch's replicate(), the replicas run in threads (as nn.DataParallel)
        ours.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)
        x = torch.randn(7, 4, 3, 3, dtype=torch.float64)
        dy = torch.randn_like(x)
        replicas = stock_replicas(ours, 3)
        x_ref = x.clone().requires_grad_()
        y_ref = ref(x_ref * 1.0)
        y_ref.backward(dy)
        parts = [p.clone().requires_grad_() for p in x.split([3, 3, 1])]
        outs = run_threads([lambda r=r, p=p: r(p * 1.0) for r, p in zip(replicas, parts)])
        # each replica's backward on its own thread, as the engine's device threads run them on GPUs
        errors = run_threads([lambda o=o, d=d: o.backward(d) for o, d in zip(outs, dy.split([3, 3, 1]))])
        assert errors == [None] * 3, errors
        torch.testing.assert_close(torch.cat(outs), y_ref, **TOL)
        torch.testing.assert_close(torch.cat([p.grad for p in parts]), x_ref.grad, **TOL)
        torch.testing.assert_close(ours.running_var, ref.bn.running_var, **TOL)


def test_in_place_and_saved_tensors():
    """The output is the input's storage (version moved); autograd keeps one full-size tensor."""
    layer = NN.InPlaceABN(8)
    x = torch.randn(4, 8, 16, 16, requires_grad=True)
    h = x * 1.0
    version = h._version
    saved: list[Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(h)
    assert y.data_ptr() == h.data_ptr() and h._version > version
    full = sum(t.numel() for t in saved) / h.numel()
    assert full <= 1.1, full
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        nn.LeakyReLU()(nn.BatchNorm2d(8)(x * 1.0))
    assert sum(t.numel() for t in saved) / h.numel() >= 2  # torch's: input and output
    y.sum().backward()


def test_stale_use_raises():
    layer = NN.InPlaceABN(3)
    x = torch.randn(4, 3, 2, 2, requires_grad=True)
    h = x.exp()
    y = layer(h)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_bad_input():
    with pytest.raises(ValueError, match="InPlaceABN\\(4\\): activation 'relu' cannot run in place.*leaky_relu"):
        NN.InPlaceABN(4, activation="relu")
    with pytest.raises(ValueError, match="slope \\(activation_param\\) must be positive"):
        NN.InPlaceABN(4, activation="leaky_relu", activation_param=0.0)
    with pytest.raises(ValueError, match="alpha \\(activation_param\\) must be positive"):
        NN.InPlaceABNSync(4, activation="elu", activation_param=-1.0)
    with pytest.raises(ValueError, match="activation must be one of"):
        NN.ABN(4, activation="gelu")
    layer = NN.InPlaceABN(4)
    with pytest.raises(RuntimeError, match="InPlaceABN\\(4\\): the input is a leaf tensor that requires grad"):
        layer(torch.randn(2, 4, 3, requires_grad=True))
    with pytest.raises(RuntimeError, match="cannot be written in place: its elements overlap"):
        layer(torch.randn(1, 4, 1).expand(2, 4, 3))
    with pytest.raises(RuntimeError, match="expected 4 channels"):
        layer(torch.randn(2, 3, 3))
    with pytest.raises(RuntimeError, match="floating point"):
        layer(torch.ones(2, 4, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        layer(torch.randn(1, 4))
    with pytest.raises(TypeError, match="takes no residual"):
        layer(torch.randn(2, 4, 3), torch.randn(2, 4, 3))
    with torch.no_grad():  # a leaf is written over where no graph is recorded, as torch allows
        x = torch.randn(2, 4, 3, requires_grad=True)
        y = layer(x)
        assert y.data_ptr() == x.data_ptr() and torch.equal(y, x)


def test_double_backward_refused():
    layer = NN.InPlaceABN(3)
    x = torch.randn(4, 3, 2, requires_grad=True)
    y = layer(x * 1.0)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


def test_non_contiguous_input_is_written_over():
    ref, ours = make_pair(NN.InPlaceABN, "leaky_relu", 0.2)
    base = torch.randn(3, 5, 4, 4, dtype=torch.float64)
    x = base.transpose(2, 3)[:, :4]  # neither contiguous nor channels_last
    expected = ref(x.clone())
    y = ours(x)
    assert y is x
    torch.testing.assert_close(x, expected, **TOL)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2), (torch.float16, 1e-2)])
@pytest.mark.parametrize("activation,param", [("leaky_relu", 0.01), ("elu", 1.0)])
def test_reduced_precision_reconstruction(dtype, tol, activation, param):
    """The backward recovers the input from the output: the gradients of reduced-precision
    inputs stay within the dtype's error of the float64 computation."""
    ref, ours = make_pair(NN.InPlaceABN, activation, param, channels=8)
    x = torch.randn(8, 8, 6, 6, dtype=torch.float64) * 2 + 0.5
    dy = torch.randn_like(x)
    x64 = x.clone().requires_grad_()
    ref(x64 * 1.0).backward(dy)
    low = copy.deepcopy(ours).to(dtype if dtype == torch.float32 else torch.float32)
    xl = x.to(dtype).requires_grad_()
    low(xl * 1.0).backward(dy.to(dtype))
    scale = x64.grad.abs().max()
    assert (xl.grad.double() - x64.grad).abs().max() / scale < tol


def test_state_dict_as_inplace_abn():
    """inplace_abn 1.1's state_dict is nn.BatchNorm's (weight, bias, running_mean, running_var,
    num_batches_tracked; version 2): it loads strictly, and back; an older one (version 1, no
    num_batches_tracked) loads too."""
    source = nn.BatchNorm2d(5)
    source.running_mean.normal_()
    state = source.state_dict()
    for cls in (NN.ABN, NN.InPlaceABN, NN.InPlaceABNSync):
        layer = cls(5)
        layer.load_state_dict(state, strict=True)
        assert torch.equal(layer.running_mean, source.running_mean)
        back = nn.BatchNorm2d(5)
        back.load_state_dict(layer.state_dict(), strict=True)
    old = OrderedDict((k, v) for k, v in state.items() if k != "num_batches_tracked")
    old._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    NN.InPlaceABN(5).load_state_dict(old, strict=True)


def test_copy_pickle_repr():
    layer = NN.InPlaceABNSync(6, activation="elu", activation_param=0.5)
    again = pickle.loads(pickle.dumps(layer))
    assert isinstance(again, NN.InPlaceABNSync) and again.activation == "elu" and again.activation_param == 0.5
    assert "activation=elu[0.5]" in repr(copy.deepcopy(layer))
    assert NN.ABN is not NN.InPlaceABN and issubclass(NN.InPlaceABNSync, NN.InPlaceABN)


def test_compile_fullgraph_one_device():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), NN.InPlaceABN(4), nn.Conv2d(4, 4, 1), NN.InPlaceABN(4, activation="elu", activation_param=1.0))
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    for _ in range(2):
        x = torch.randn(2, 3, 5, 5)
        y, y_eager = compiled(x), eager(x)
        torch.testing.assert_close(y, y_eager)
        y.sum().backward(), y_eager.sum().backward()
        torch.testing.assert_close(model[0].weight.grad, eager[0].weight.grad)
        torch.testing.assert_close(model[1].running_var, eager[1].running_var)


def test_convert_inplace_abn():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.bn, self.act = nn.BatchNorm2d(4), nn.LeakyReLU(0.1)
            self.seq = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.ELU(), nn.BatchNorm2d(4), nn.LeakyReLU(), nn.BatchNorm2d(4), nn.ReLU())

        def forward(self, x):
            y = self.act(self.bn(self.conv(x)))
            return self.seq(y)

    torch.manual_seed(0)
    model = Net().double()
    ref = copy.deepcopy(model)
    weight = model.seq[1].weight
    done = NN.convert_inplace_abn(model)
    assert sorted(done.converted) == ["bn", "seq.1"]
    assert "seq.3" in done.left_alone and "input may be used elsewhere" in done.left_alone["seq.3"]
    converted = done.module.get_submodule("seq.1")
    assert isinstance(converted, NN.InPlaceABN) and converted.weight is weight
    x = torch.randn(3, 3, 5, 5, dtype=torch.float64)
    torch.testing.assert_close(done.module(x), ref(x), **TOL)
    negative = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.LeakyReLU())
    with torch.no_grad():
        negative[1].weight[0] = -1.0
    assert "weight below eps" in NN.convert_inplace_abn(negative).left_alone["1"]


def test_input_gradient_takes_the_output_gradients_storage_only_where_it_is_the_backwards_alone(monkeypatch):
    """The backward writes dx over dy where nothing else holds dy (one full-size tensor less at
    its peak), and leaves a gradient that a hook, ``retain_grad`` or the caller holds as it is."""
    import importlib

    module = importlib.import_module("syncbn.functions.inplace_abn")  # the package exports a function of that name
    written_over = []
    original = module.OVERLOADS.abn_backward_elemt_
    monkeypatch.setattr(module.OVERLOADS, "abn_backward_elemt_", lambda *args: written_over.append(1) or original(*args))
    layer = NN.InPlaceABN(3).double()
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    ref, ours = make_pair(NN.InPlaceABN, "leaky_relu", 0.01, channels=3)
    x_ref = x.detach().clone().requires_grad_()
    (ref(x_ref * 1.0) * 2).sum().backward()
    (ours(x * 1.0) * 2).sum().backward()
    assert written_over == [1]
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    kept: list[Tensor] = []
    y = layer(x * 1.0)
    y.register_hook(lambda g: kept.append(g))
    (y * 2).sum().backward()
    assert torch.equal(kept[0], torch.full_like(kept[0], 2.0))
    given = torch.full((4, 3, 5, 5), 2.0, dtype=torch.float64)
    layer(x * 1.0).backward(given)
    assert torch.equal(given, torch.full_like(given, 2.0))
