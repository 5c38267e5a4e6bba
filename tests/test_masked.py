"""``mask=``: batch statistics over the valid positions of a padded batch. Every case is checked
against a float64 reference written with torch ops on the concatenated batch (the valid positions'
values gathered with the mask, their mean and biased variance, autograd for the gradients):
outputs, input gradients, weight and bias gradients, running statistics and num_batches_tracked,
over several steps; on one device (every layout, mask shape and dtype the kernels take), three
uneven ThreadedDataParallel replicas with one all-masked, two Gloo ranks with one all-masked
(eager, and compiled with fullgraph=True), compiled and exported on one device; the kernels
against the reference operators; the errors; and that without a mask nothing changed."""
from __future__ import annotations

import copy
import re

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import Tensor, nn

from syncbn import nn as NN
from syncbn.functions.operators import reference_masked
from syncbn.modules.parallel import ThreadedDataParallel
from testkit.local_group import run_local_group

TOL = dict(atol=1e-10, rtol=1e-10)
CL2, CL3 = torch.channels_last, torch.channels_last_3d
OPS = torch.ops.syncbn


def reference(x: Tensor, mask: Tensor, weight: Tensor, bias: Tensor, eps: float, z: Tensor | None = None,
              relu: bool = False) -> tuple[Tensor, Tensor]:
    """(y, the valid values (V, C)): the statistics of x's valid positions (mask (N, *spatial)),
    every position normalized, in torch ops that autograd differentiates."""
    values = x.movedim(1, -1)[mask]
    mean, var = values.mean(0), values.var(0, unbiased=False)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + eps) * weight.view(shape) + bias.view(shape)
    y = y if z is None else y + z
    return (torch.relu(y) if relu else y), values.detach()


def full_mask(mask: Tensor, x: Tensor) -> Tensor:
    """A mask as the layers take it ((N,), (N, 1, *spatial), ...) as (N, *spatial)."""
    positions = (x.size(0), *x.shape[2:])
    if mask.dim() == x.dim():
        mask = mask.squeeze(1)
    return mask.reshape(mask.shape + (1,) * (len(positions) - mask.dim())).expand(positions)


class Reference:
    """nn.BatchNorm*'s state, stepped by :func:`reference` on the whole batch."""

    def __init__(self, layer: nn.Module) -> None:
        self.weight = layer.weight.detach().double().clone().requires_grad_()
        self.bias = layer.bias.detach().double().clone().requires_grad_()
        self.running_mean = layer.running_mean.double().clone()
        self.running_var = layer.running_var.double().clone()
        self.steps = 0
        self.momentum, self.eps = layer.momentum, layer.eps

    def __call__(self, x: Tensor, mask: Tensor, z: Tensor | None = None, relu: bool = False) -> Tensor:
        y, values = reference(x, full_mask(mask, x), self.weight, self.bias, self.eps, z, relu)
        self.steps += 1
        factor = self.momentum if self.momentum is not None else 1 / self.steps
        self.running_mean.mul_(1 - factor).add_(factor * values.mean(0))
        self.running_var.mul_(1 - factor).add_(factor * values.var(0))
        return y


def step_both(run, layer: nn.Module, ref: Reference, x: Tensor, mask: Tensor, tol: dict, z: Tensor | None = None) -> None:
    """One training step of ``run(x, mask, z)`` (our layer, however it runs) and the reference,
    compared: output, input and residual gradients, weight and bias gradients, running
    statistics and num_batches_tracked."""
    xs = x.detach().clone().requires_grad_()
    xr = x.detach().double().requires_grad_()
    zs = None if z is None else z.detach().clone().requires_grad_()
    zr = None if z is None else z.detach().double().requires_grad_()
    y = run(xs, mask, zs)
    yr = ref(xr, mask, zr, relu=layer.activation == "relu")
    grad = torch.randn(y.shape, dtype=torch.float64)
    y.backward(grad.to(y.dtype))
    yr.backward(grad)
    torch.testing.assert_close(y.double(), yr, **tol)
    torch.testing.assert_close(xs.grad.double(), xr.grad, **tol)
    if z is not None:
        torch.testing.assert_close(zs.grad.double(), zr.grad, **tol)
    torch.testing.assert_close(layer.weight.grad.double(), ref.weight.grad, **tol)
    torch.testing.assert_close(layer.bias.grad.double(), ref.bias.grad, **tol)
    torch.testing.assert_close(layer.running_mean.double(), ref.running_mean, **tol)
    torch.testing.assert_close(layer.running_var.double(), ref.running_var, **tol)
    assert int(layer.num_batches_tracked) == ref.steps
    layer.weight.grad = layer.bias.grad = ref.weight.grad = ref.bias.grad = None
    assert y.is_contiguous(memory_format=_format_of(x))


def _format_of(x: Tensor) -> torch.memory_format:
    for memory_format in (CL2, CL3):
        if x.dim() == (4 if memory_format is CL2 else 5) and x.is_contiguous(memory_format=memory_format) and not x.is_contiguous():
            return memory_format
    return torch.contiguous_format


def make_layer(shape: tuple[int, ...], dtype: torch.dtype = torch.float64, **kwargs) -> nn.Module:
    layer = {2: NN.BatchNorm1d, 3: NN.BatchNorm1d, 4: NN.BatchNorm2d, 5: NN.BatchNorm3d}[len(shape)](shape[1], **kwargs)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5), layer.bias.uniform_(-0.5, 0.5)
    return layer.to(torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype)


def random_mask(shape: tuple[int, ...], kind: str, generator: torch.Generator) -> Tensor:
    """A mask of ``kind``: 'positions' (N, *spatial), 'channel' (N, 1, *spatial), 'samples' (N,),
    'lengths' (N, T) padding after each sample's length; at least two valid positions."""
    n, spatial = shape[0], shape[2:]
    if kind == "samples":
        mask = torch.rand(n, generator=generator) > 0.4
    elif kind == "lengths":
        lengths = torch.randint(0, spatial[-1] + 1, (n,), generator=generator)
        mask = torch.arange(spatial[-1]) < lengths[:, None]
    else:
        mask = torch.rand(n, *spatial, generator=generator) > 0.45
        mask = mask.unsqueeze(1) if kind == "channel" else mask
    flat = mask.view(-1)
    flat[:2] = True
    return mask


CASES = [  # shape, memory format, mask kind
    ((6, 4), torch.contiguous_format, "samples"),
    ((5, 3, 7), torch.contiguous_format, "lengths"),
    ((5, 3, 7), torch.contiguous_format, "channel"),
    ((4, 3, 5, 6), torch.contiguous_format, "positions"),
    ((4, 3, 5, 6), CL2, "positions"),
    ((4, 19, 5, 6), CL2, "samples"),
    ((3, 2, 3, 4, 5), torch.contiguous_format, "positions"),
    ((3, 2, 3, 4, 5), CL3, "channel"),
]


@pytest.mark.parametrize("shape,memory_format,kind", CASES, ids=str)
def test_one_device_every_layout_and_mask_shape(shape, memory_format, kind) -> None:
    generator = torch.Generator().manual_seed(0)
    layer = make_layer(shape)
    ref = Reference(layer)
    for _ in range(3):
        x = (torch.randn(shape, generator=generator, dtype=torch.float64) * 2 + 1).contiguous(memory_format=memory_format)
        mask = random_mask(shape, kind, generator)
        step_both(lambda x, m, z: layer(x, mask=m), layer, ref, x, mask, TOL)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 6e-2), (torch.float16, 2e-2)], ids=str)
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, CL2], ids=str)
def test_one_device_low_precision_against_float64(dtype, tol, memory_format) -> None:
    generator = torch.Generator().manual_seed(1)
    shape = (4, 5, 6, 7)
    layer = make_layer(shape, dtype)
    ref = Reference(layer)
    for _ in range(2):
        x = (torch.randn(shape, generator=generator) * 2 + 1).to(dtype).contiguous(memory_format=memory_format)
        step_both(lambda x, m, z: layer(x, mask=m), layer, ref, x, random_mask(shape, "positions", generator),
                  dict(atol=tol, rtol=tol))


def test_fused_residual_and_activation_and_cumulative_average() -> None:
    generator = torch.Generator().manual_seed(2)
    shape = (4, 3, 5, 5)
    layer = make_layer(shape, activation="relu", momentum=None)
    ref = Reference(layer)
    for _ in range(3):
        x, z = (torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(2))
        step_both(lambda x, m, z: layer(x, z, mask=m), layer, ref, x, random_mask(shape, "positions", generator), TOL, z)


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(1, 5), c=st.integers(1, 9), t=st.integers(1, 11), density=st.floats(0.0, 1.0),
    channels_last=st.booleans(), seed=st.integers(0, 2**16),
)
def test_drawn_shapes_and_masks(n, c, t, density, channels_last, seed) -> None:
    generator = torch.Generator().manual_seed(seed)
    shape = (n, c, t, 2)
    mask = torch.rand(n, t, 2, generator=generator) < density
    mask.view(-1)[:2] = True
    layer = make_layer(shape)
    x = torch.randn(shape, generator=generator, dtype=torch.float64).contiguous(memory_format=CL2 if channels_last else torch.contiguous_format)
    step_both(lambda x, m, z: layer(x, mask=m), layer, Reference(layer), x, mask, TOL)


def test_an_all_true_mask_is_the_unmasked_layer() -> None:
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    masked, plain, theirs = make_layer(x.shape), make_layer(x.shape), nn.BatchNorm2d(3).double()
    plain.load_state_dict(masked.state_dict()), theirs.load_state_dict(masked.state_dict())
    y = masked(x, mask=torch.ones(4, 5, 5, dtype=torch.bool))
    torch.testing.assert_close(y, plain(x), **TOL)
    torch.testing.assert_close(plain(x), theirs(x), **TOL)


def test_frozen_and_eval_layers_ignore_the_mask() -> None:
    x, mask = torch.randn(4, 3, 5, 5, dtype=torch.float64), torch.rand(4, 5, 5) > 0.5
    frozen, evaluated = make_layer(x.shape, frozen=True), make_layer(x.shape).eval()
    for layer in (frozen, evaluated):
        assert torch.equal(layer(x, mask=mask), layer(x))
        assert int(layer.num_batches_tracked) == 0


def test_double_backward_differentiates_the_masked_definition() -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(3, 2, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.rand(2, dtype=torch.float64, generator=generator).add(0.5).requires_grad_()
    bias = torch.randn(2, dtype=torch.float64, generator=generator, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    from syncbn.functional import sync_batch_norm

    ours = lambda x, w, b: sync_batch_norm(x, None, None, w, b, mask=mask)  # noqa: E731
    torch.autograd.gradgradcheck(ours, (x, weight, bias))
    torch.testing.assert_close(ours(x, weight, bias), reference(x, mask, weight, bias, 1e-5)[0], **TOL)


def test_errors_name_the_layer() -> None:
    layer = make_layer((4, 3, 5, 5))
    layer.layer_name = "backbone.bn1"
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"backbone.bn1.*more than 1 value per channel.*0 valid positions"):
        layer(x, mask=torch.zeros(4, 5, 5, dtype=torch.bool))
    one = torch.zeros(4, 5, 5, dtype=torch.bool)
    one[2, 1, 1] = True
    with pytest.raises(ValueError, match=r"backbone.bn1.*1 valid position "):
        layer(x, mask=one)
    assert int(layer.num_batches_tracked) == 0  # checked before any state changed
    with pytest.raises(TypeError, match=r"backbone.bn1.*bool"):
        layer(x, mask=torch.ones(4, 5, 5))
    with pytest.raises(RuntimeError, match=r"backbone.bn1.*mask of size \(4, 3\).*positions \(4, 5, 5\)"):
        layer(x, mask=torch.ones(4, 3, dtype=torch.bool))
    inplace = NN.InPlaceABN(3).double()
    with pytest.raises(NotImplementedError, match=r"InPlaceABN.*mask=.*use ABN"):
        inplace(x.clone(), mask=torch.ones(4, 5, 5, dtype=torch.bool))


def test_abn_takes_the_mask_with_its_activation() -> None:
    x, mask = torch.randn(4, 3, 5, 5, dtype=torch.float64), torch.rand(4, 5, 5) > 0.3
    abn = NN.ABN(3, activation="leaky_relu", activation_param=0.1).double()
    plain = make_layer(x.shape)
    plain.load_state_dict(abn.state_dict())
    torch.testing.assert_close(abn(x, mask=mask), torch.nn.functional.leaky_relu(plain(x, mask=mask), 0.1), **TOL)


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


def test_kernels_against_the_reference_operators() -> None:
    generator = torch.Generator().manual_seed(5)
    for shape, memory_format in [((4, 5, 6, 7), torch.contiguous_format), ((4, 19, 6, 7), CL2), ((3, 2, 3, 4, 5), CL3),
                                 ((9, 33), torch.contiguous_format), ((3, 4, 37), torch.contiguous_format)]:
        for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
            x = (torch.randn(shape, generator=generator) * 3 + 5).to(dtype).contiguous(memory_format=memory_format)
            mask = torch.rand(shape[0], *shape[2:], generator=generator) > 0.4
            exact = reference_masked.masked_local_stats(x.double(), mask)
            got = OPS.masked_local_stats(x, mask)
            tol = dict(atol=1e-12, rtol=1e-12) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)
            for ours, truth in zip(got, exact):
                torch.testing.assert_close(ours, truth, **tol)
            acc = torch.float64 if dtype == torch.float64 else torch.float32
            per_channel = [torch.rand(shape[1], generator=generator, dtype=torch.float64).to(acc) + 0.5 for _ in range(5)]
            mean, invstd, weight, mean_dy, mean_dy_xmu = per_channel
            dy = torch.randn(shape, generator=generator).to(dtype).contiguous(memory_format=memory_format)
            args = (dy, x, mean, invstd, weight.to(dtype), mean_dy, mean_dy_xmu, mask)
            dx = OPS.masked_backward_elemt(*args)
            expected = reference_masked.masked_backward_elemt(*args)
            assert dx.is_contiguous(memory_format=memory_format) or x.dim() < 4
            tol = TOL if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(dx, expected, **tol)


def test_padding_may_hold_inf_and_nan() -> None:
    x = torch.randn(4, 3, 6, dtype=torch.float64)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[:, 4:] = False
    clean, dirty = make_layer(x.shape), make_layer(x.shape)
    dirty.load_state_dict(clean.state_dict())
    noisy = x.clone()
    noisy[:, 0, 4], noisy[:, 1, 5] = float("inf"), float("nan")
    valid = mask.unsqueeze(1).expand_as(x)
    torch.testing.assert_close(dirty(noisy, mask=mask)[valid], clean(x, mask=mask)[valid], **TOL)
    torch.testing.assert_close(dirty.running_var, clean.running_var, **TOL)


class ConvBN(nn.Module):
    """A convolution module over padded sequences: Conv1d, then our batch norm over the valid frames."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv1d(channels, channels, 3, padding=1), make_layer((1, channels, 1))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.bn(self.conv(x), mask=mask)


def test_compiled_fullgraph_and_exported_on_one_device() -> None:
    generator = torch.Generator().manual_seed(6)
    shape = (5, 4, 9)
    eager = ConvBN(4).double()
    ours = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True, dynamic=False, backend="aot_eager")
    for _ in range(2):
        x = torch.randn(shape, generator=generator, dtype=torch.float64)
        mask = random_mask(shape, "lengths", generator)
        outputs = []
        for model in (compiled, eager):
            model.zero_grad()
            y = model(x, mask)
            y.square().sum().backward()
            outputs.append(y)
        torch.testing.assert_close(outputs[0], outputs[1], **TOL)
        torch.testing.assert_close(ours.bn.running_var, eager.bn.running_var, **TOL)
        torch.testing.assert_close(ours.conv.weight.grad, eager.conv.weight.grad, **TOL)
    exported = torch.export.export(copy.deepcopy(eager), (x, mask))
    assert any("masked_local_stats" in str(node.target) for node in exported.graph.nodes)
    torch.testing.assert_close(exported.module()(x, mask), copy.deepcopy(eager)(x, mask), **TOL)
    torch._dynamo.reset()


def test_compiled_checks_the_valid_count_on_the_device() -> None:
    layer = make_layer((4, 3, 5))
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match="at most 1 valid position"):
        compiled(torch.randn(4, 3, 5, dtype=torch.float64), mask=torch.zeros(4, 5, dtype=torch.bool))
    torch._dynamo.reset()


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


class MaskedConvNet(nn.Module):
    """A conv-BN-ReLU-conv-BN net over padded images: ``forward(x, mask)``, the mask (N, H, W)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1), NN.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 2, 3, padding=1), NN.BatchNorm2d(2)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x), mask=mask))), mask=mask)


@pytest.mark.parametrize("form", ["tuple", "dict", "call"])
def test_update_bn_takes_the_masks_from_the_loader(form: str) -> None:
    generator = torch.Generator().manual_seed(8)
    model = MaskedConvNet().double()
    batches = [(torch.randn(n, 3, 5, 5, generator=generator, dtype=torch.float64), random_mask((n, 3, 5, 5), "positions", generator))
               for n in (3, 4, 2)]
    loader = {"tuple": batches, "dict": [{"x": x, "mask": m} for x, m in batches],
              "call": [{"images": x, "padding": ~m} for x, m in batches]}[form]
    call = (lambda model, batch: model(batch["images"], ~batch["padding"])) if form == "call" else None
    NN.update_bn(loader, model, call=call)
    # the population: every batch's valid positions, each layer's input in the pass
    inputs: dict[str, list[Tensor]] = {"bn1": [], "bn2": []}
    with torch.no_grad():
        for x, mask in batches:
            h1 = model.conv1(x)
            inputs["bn1"].append(h1.movedim(1, -1)[mask])
            y1, _ = reference(h1, mask, model.bn1.weight, model.bn1.bias, model.bn1.eps)  # batch statistics in the pass
            inputs["bn2"].append(model.conv2(torch.relu(y1)).movedim(1, -1)[mask])
    for name, parts in inputs.items():
        values = torch.cat(parts)
        layer = getattr(model, name)
        torch.testing.assert_close(layer.running_mean, values.mean(0), **TOL)
        torch.testing.assert_close(layer.running_var, values.var(0), **TOL)
        assert int(layer.num_batches_tracked) == 3


def test_a_replica_with_a_bad_mask_fails_the_others_at_once() -> None:
    import time

    from helpers import run_threads, stock_replicas
    from syncbn.functions import ReplicaSyncError

    layer = make_layer((4, 3, 5, 5), timeout=30)
    x = torch.randn(8, 3, 5, 5, dtype=torch.float64)
    masks = [torch.ones(4, 5, 5, dtype=torch.bool), torch.ones(4, 5, dtype=torch.float32)]  # replica 1's is not bool
    replicas = stock_replicas(layer, 2)
    start = time.monotonic()
    with torch.no_grad():
        errors = run_threads([lambda i=i: replicas[i](x[4 * i: 4 * i + 4], mask=masks[i]) for i in range(2)])
    assert time.monotonic() - start < 10, "a replica waited for one that had failed"
    assert isinstance(errors[1], TypeError) and "bool" in str(errors[1])
    assert isinstance(errors[0], ReplicaSyncError) and "replica 1 failed" in str(errors[0])
