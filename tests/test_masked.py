"""``mask=`` on one device: batch statistics over the valid positions of a padded batch, against a
float64 reference written with torch ops on the batch (``testkit.masking``: the valid positions'
values gathered with the mask, their mean and biased variance, autograd for the gradients):
outputs, input gradients, weight and bias gradients, running statistics and num_batches_tracked,
over several steps, in every layout, mask shape and dtype the kernels take (hypothesis draws
shapes and masks too); the kernels against the reference operators; compiled and exported;
``update_bn`` with masks; the errors. Replicas and ranks: ``tests/test_masked_sync.py``."""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import Tensor, nn

from syncbn import nn as NN
from syncbn.functions.operators import reference_masked
from testkit.masking import CL2, CL3, TOL, Reference, make_layer, random_mask, reference, step_both

OPS = torch.ops.syncbn

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


def test_frozen_and_eval_layers_check_the_mask_then_ignore_it() -> None:
    x, mask = torch.randn(4, 3, 5, 5, dtype=torch.float64), torch.rand(4, 5, 5) > 0.5
    frozen, evaluated = make_layer(x.shape, frozen=True), make_layer(x.shape).eval()
    for layer in (frozen, evaluated):
        assert torch.equal(layer(x, mask=mask), layer(x))
        assert int(layer.num_batches_tracked) == 0
        with pytest.raises(RuntimeError, match=r"SyncBatchNorm2d\(3\): mask of size \(5, 2\) does not match"):
            layer(x, mask=torch.ones(5, 2, dtype=torch.bool))  # the call that raises in training
        with pytest.raises(TypeError, match=r"SyncBatchNorm2d\(3\): mask must be a bool Tensor"):
            layer(x, mask=mask.float())


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


@pytest.mark.parametrize("device", ["cpu", *(["cuda"] if torch.cuda.is_available() else [])])
def test_kernels_against_the_reference_operators(device: str) -> None:
    """Whatever serves the masked operators on ``device`` (compiled kernels, or the reference)
    against the reference on the CPU in float64."""
    generator = torch.Generator().manual_seed(5)
    for shape, memory_format in [((4, 5, 6, 7), torch.contiguous_format), ((4, 19, 6, 7), CL2), ((3, 2, 3, 4, 5), CL3),
                                 ((9, 33), torch.contiguous_format), ((3, 4, 37), torch.contiguous_format)]:
        for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
            x = (torch.randn(shape, generator=generator) * 3 + 5).to(dtype).contiguous(memory_format=memory_format)
            mask = torch.rand(shape[0], *shape[2:], generator=generator) > 0.4
            exact = reference_masked.masked_local_stats(x.double(), mask)
            got = OPS.masked_local_stats(x.to(device), mask.to(device))
            tol = dict(atol=1e-12, rtol=1e-12) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)
            for ours, truth in zip(got, exact):
                torch.testing.assert_close(ours.cpu(), truth, **tol)
            acc = torch.float64 if dtype == torch.float64 else torch.float32
            per_channel = [torch.rand(shape[1], generator=generator, dtype=torch.float64).to(acc) + 0.5 for _ in range(5)]
            mean, invstd, weight, mean_dy, mean_dy_xmu = per_channel
            dy = torch.randn(shape, generator=generator).to(dtype).contiguous(memory_format=memory_format)
            args = (dy, x, mean, invstd, weight.to(dtype), mean_dy, mean_dy_xmu, mask)
            dx = OPS.masked_backward_elemt(*(a.to(device) for a in args)).cpu()
            expected = reference_masked.masked_backward_elemt(*args)
            assert dx.is_contiguous(memory_format=memory_format) or x.dim() < 4
            tol = TOL if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(dx, expected, **tol)


def test_inf_and_nan_in_the_padding_leave_the_statistics_alone() -> None:
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


class MaskedConvNet(nn.Module):
    """A conv-BN-ReLU-conv-BN net over padded images: ``forward(x, mask)``, the mask (N, H, W)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1), NN.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 2, 3, padding=1), NN.BatchNorm2d(2)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x), mask=mask))), mask=mask)


class PositionalMaskNet(MaskedConvNet):
    """The same net passing the mask third in place: ``bn(x, None, mask)``."""

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x), None, mask))), None, mask)


@pytest.mark.parametrize("form", ["tuple", "dict", "call", "positional"])
def test_update_bn_takes_the_masks_from_the_loader(form: str) -> None:
    generator = torch.Generator().manual_seed(8)
    model = (PositionalMaskNet if form == "positional" else MaskedConvNet)().double()
    batches = [(torch.randn(n, 3, 5, 5, generator=generator, dtype=torch.float64), random_mask((n, 3, 5, 5), "positions", generator))
               for n in (3, 4, 2)]
    loader = {"tuple": batches, "positional": batches, "dict": [{"x": x, "mask": m} for x, m in batches],
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
