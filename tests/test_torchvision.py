"""torchvision's models with our layers (docs/integrations.md): built with
``norm_layer=NN.SyncBatchNorm2d`` or converted, under thread replicas against torchvision's own
model on the whole batch, float64. Skipped where torchvision is not installed (it runs, with timm,
in tools/test_timm.sh's environment)."""
from __future__ import annotations

import copy

import pytest
import torch

torchvision = pytest.importorskip("torchvision")

from syncbn import nn as NN  # noqa: E402
from syncbn.parallel import ThreadedDataParallel  # noqa: E402

F64 = torch.float64
TOL = dict(atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("how", ["norm_layer", "converted"])
def test_a_torchvision_resnet_with_our_layers_equals_torchvisions_on_the_whole_batch(how) -> None:
    torch.manual_seed(0)
    theirs = torchvision.models.resnet18(num_classes=5).to(F64)
    if how == "norm_layer":
        ours = torchvision.models.resnet18(num_classes=5, norm_layer=NN.SyncBatchNorm2d).to(F64)
        ours.load_state_dict(theirs.state_dict(), strict=True)
    else:
        ours = NN.convert_sync_batchnorm(copy.deepcopy(theirs), strict=True)
    assert sum(isinstance(m, NN.SyncBatchNorm2d) for m in ours.modules()) == 20
    replicas = ThreadedDataParallel(ours, ["cpu"] * 2)
    x = torch.randn(5, 3, 32, 32, dtype=F64)  # 3 + 2 rows a replica
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, y_theirs = replicas(x_ours), theirs(x_theirs)
    y_ours.pow(2).sum().backward(), y_theirs.pow(2).sum().backward()
    torch.testing.assert_close(y_ours, y_theirs, **TOL)
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, **TOL)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)
    for (name, a), b in zip(ours.named_buffers(), theirs.buffers(), strict=True):
        torch.testing.assert_close(a, b, **TOL, msg=name)
