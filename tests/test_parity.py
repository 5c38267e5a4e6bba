"""Parity with nn.BatchNorm* on the full batch: outputs, input grads, parameter grads and
buffers over several SGD steps, for 1 to 4 replicas and every configuration."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from syncbn.functions.operators import backend
from helpers import randomize_affine, train_in_lockstep
from syncbn import nn as NN
from syncbn.modules.parallel import ThreadedDataParallel

CL2, CL3 = torch.channels_last, torch.channels_last_3d


def conv_bn_2d(**bn_args) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4, **bn_args), nn.ReLU(), nn.Conv2d(4, 5, 1), nn.BatchNorm2d(5, **bn_args))


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [10, 7, 2])
def test_2d_network_uneven_chunks(replicas: int, batch: int) -> None:
    # batch 10 on 4 replicas is 3,3,3,1; batch 2 on 3 or 4 replicas gives fewer chunks than devices
    train_in_lockstep(conv_bn_2d, (batch, 3, 5, 6), replicas)


@pytest.mark.parametrize(
    "make, shape, memory_format",
    [
        (lambda: nn.BatchNorm1d(6), (10, 6), torch.contiguous_format),
        (lambda: nn.BatchNorm1d(6), (10, 6, 7), torch.contiguous_format),
        (lambda: nn.BatchNorm2d(6), (10, 6, 4, 3), torch.contiguous_format),
        (lambda: nn.BatchNorm2d(6), (10, 6, 4, 3), CL2),
        (lambda: nn.BatchNorm3d(6), (10, 6, 3, 2, 4), torch.contiguous_format),
        (lambda: nn.BatchNorm3d(6), (10, 6, 3, 2, 4), CL3),
        (lambda: nn.SyncBatchNorm(6), (10, 6, 3, 2, 2, 2), torch.contiguous_format),
    ],
    ids=["1d-NC", "1d-NCL", "2d", "2d-channels-last", "3d", "3d-channels-last", "rank6"],
)
@pytest.mark.parametrize("replicas", [1, 4])
def test_ranks_and_layouts(make, shape, memory_format, replicas: int) -> None:
    train_in_lockstep(make, shape, replicas, memory_format=memory_format)


def test_channels_last_network() -> None:
    train_in_lockstep(conv_bn_2d, (10, 3, 5, 6), 4, memory_format=CL2)


@pytest.mark.parametrize(
    "bn_args",
    [
        dict(affine=False),
        dict(bias=False),
        dict(momentum=None),
        dict(momentum=0.5, eps=1e-3),
        dict(track_running_stats=False),
        dict(affine=False, track_running_stats=False, momentum=None),
    ],
    ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()),
)
@pytest.mark.parametrize("replicas", [1, 3])
def test_layer_options(bn_args: dict, replicas: int) -> None:
    train_in_lockstep(lambda: conv_bn_2d(**bn_args), (10, 3, 4, 4), replicas, steps=4)


def test_eval_mode() -> None:
    # eval with running stats normalizes with them, on every replica alike
    track_running_stats = True
    def make() -> nn.Module:
        model = conv_bn_2d(track_running_stats=track_running_stats, momentum=0.3)
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d) and m.running_mean is not None:
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
        return model

    train_in_lockstep(make, (10, 3, 4, 4), 4, training=False)


# float32: the conv bias before a batch norm has a gradient of exactly 0 in exact arithmetic;
# both float32 runs carry ~1e-4 of absolute noise there (gradients elsewhere are ~1e2), hence
# atol 1e-3; after SGD steps the two float32 trajectories drift apart by ~1e-4 relative,
# hence rtol 1e-3. test_float32_accuracy_on_par_with_torch checks the error against float64 itself.
F32_TOL = dict(atol=1e-3, rtol=1e-3)


def test_float32_network() -> None:
    train_in_lockstep(conv_bn_2d, (10, 3, 5, 6), 4, dtype=torch.float32, **F32_TOL)


def test_float32_channels_last_network() -> None:
    train_in_lockstep(conv_bn_2d, (10, 3, 5, 6), 3, dtype=torch.float32, memory_format=CL2, **F32_TOL)


def test_float32_accuracy_on_par_with_torch() -> None:
    """Against float64 truth, our float32 gradients are as accurate as nn.BatchNorm2d's."""
    torch.manual_seed(0)
    truth = randomize_affine(conv_bn_2d()).double()
    torch32 = copy.deepcopy(truth).float()
    ours32 = NN.convert_sync_batchnorm(copy.deepcopy(torch32))
    x = torch.randn(10, 3, 5, 6, dtype=torch.float64) * 3 + 1
    probe = torch.randn(10, 5, 5, 6, dtype=torch.float64)
    for model, dtype in [(truth, torch.float64), (torch32, torch.float32), (ThreadedDataParallel(ours32, ["cpu"] * 4), torch.float32)]:
        (model(x.to(dtype)) * probe.to(dtype)).sum().backward()
    # errors are measured against the largest gradient in the model: the conv biases before a
    # batch norm have a true gradient of 0, so their own scale means nothing
    scale = max(p.grad.abs().max().item() for p in truth.parameters())
    for (name, p64), (_, pt), (_, po) in zip(truth.named_parameters(), torch32.named_parameters(), ours32.named_parameters()):
        torch_error = (pt.grad.double() - p64.grad).abs().max().item()
        our_error = (po.grad.double() - p64.grad).abs().max().item()
        assert our_error <= 3 * torch_error + 3 * torch.finfo(torch.float32).eps * scale, (name, our_error, torch_error)


def test_shared_layer_called_twice() -> None:
    # one layer used twice per forward syncs each call separately, and backward meets the right call
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)
            self.bn = nn.BatchNorm2d(4)

        def forward(self, x):
            return self.bn(self.conv(self.bn(x)).relu() * 2 + 1)

    train_in_lockstep(Twice, (10, 4, 3, 3), 4)


@pytest.mark.skipif(backend.SERVING["cpu"] != "compiled", reason="the reference serves merge_stats: other arithmetic, other bits")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_native_merge_of_host_replicas_has_the_merge_operators_bits(dtype: torch.dtype) -> None:
    # CPU replicas merge in two loops over the channels (src/sync_batch_norm.cpp), not through
    # the merge_stats operator: the same arithmetic, so with momentum 1 the running statistics
    # are the operator's mean and unbiased variance, bit for bit (rounded once to the dtype)
    torch.manual_seed(0)
    layer = NN.SyncBatchNorm2d(6, momentum=1.0, dtype=dtype)
    x = torch.randn(10, 6, 3, 2, dtype=dtype) * 3 + 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the local statistics' bits depend on how many threads reduce
    try:
        ThreadedDataParallel(layer, ["cpu"] * 3)(x)  # chunks of 4, 4 and 2, a thread each
        chunks = x.split(4)
        stats = [torch.ops.syncbn.local_stats(chunk) for chunk in chunks]
    finally:
        torch.set_num_threads(threads)
    counts = torch.tensor([chunk.numel() / 6 for chunk in chunks], dtype=torch.float64)
    mean, var = torch.ops.syncbn.merge_stats(counts, torch.stack([m for m, _ in stats]), torch.stack([s for _, s in stats]))
    total = x.numel() // 6
    assert torch.equal(layer.running_mean, mean.to(dtype))
    assert torch.equal(layer.running_var, (var * (total / (total - 1))).to(dtype))
    assert layer.num_batches_tracked.item() == 1
