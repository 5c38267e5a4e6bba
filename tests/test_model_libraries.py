"""Two model libraries' own code on our layers, side by side with the same model on torch's layers
(float64): Ultralytics (a YOLO11n detector: a trainer whose ``get_model`` converts, its trainer's
``freeze=`` path, ``RepConv`` folding, ``initialize_weights``, ``fuse()``, a training step under
``ThreadedDataParallel`` and ``ModelEMA`` after it, reverted and traced) and
segmentation_models_pytorch (a Unet and a DeepLabV3Plus on resnet18: ``freeze_encoder()``, a
training step under ``ThreadedDataParallel``). Their code finds our layers by torch's classes
(``isinstance(m, nn.BatchNorm2d)``, ``_NormBase``). Run by ``tools/test_timm.sh`` in an environment
with both packages; skipped where they are absent."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from syncbn import nn as NN
from syncbn.parallel import ThreadedDataParallel

ultralytics = pytest.importorskip("ultralytics")
smp = pytest.importorskip("segmentation_models_pytorch")
from ultralytics.engine.trainer import BaseTrainer  # noqa: E402
from ultralytics.models.yolo.detect import DetectionTrainer  # noqa: E402
from ultralytics.nn.modules.conv import RepConv  # noqa: E402
from ultralytics.nn.tasks import DetectionModel  # noqa: E402
from ultralytics.utils.torch_utils import ModelEMA, initialize_weights  # noqa: E402

TOL = dict(rtol=1e-9, atol=1e-9)


def drawn_statistics(model: nn.Module) -> nn.Module:
    """Running statistics and affine parameters drawn, so that eval paths and folds are not trivial."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, nn.modules.batchnorm._BatchNorm):
                layer.running_mean.copy_(torch.rand(layer.num_features, generator=generator) - 0.5)
                layer.running_var.copy_(torch.rand(layer.num_features, generator=generator) + 0.5)
                layer.weight.copy_(torch.rand(layer.num_features, generator=generator) + 0.5)
                layer.bias.copy_(torch.rand(layer.num_features, generator=generator) - 0.5)
    return model


def yolo_pair() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    theirs = drawn_statistics(DetectionModel("yolo11n.yaml", nc=3, verbose=False).double())
    return theirs, NN.convert_sync_batchnorm(copy.deepcopy(theirs))


def outputs(result) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for item in (result.values() if isinstance(result, dict) else result) for t in outputs(item)]


def assert_steps_agree(theirs: nn.Module, ours: nn.Module, x: torch.Tensor, replicas: int) -> None:
    """One training forward and backward: torch's layers on the full batch, ours under
    ThreadedDataParallel; outputs, parameter gradients and buffers compared."""
    want = outputs(theirs(x))
    got = outputs(ThreadedDataParallel(ours, ["cpu"] * replicas)(x))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    sum(t.square().mean() for t in want).backward()
    sum(t.square().mean() for t in got).backward()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-8, atol=1e-8, msg=name)
    for (name, a), b in zip(ours.named_buffers(), theirs.buffers(), strict=True):
        torch.testing.assert_close(a, b, **TOL, msg=name)


def test_yolo_converted_trains_as_torchs_layers_on_the_full_batch_and_its_ema_follows() -> None:
    theirs, ours = yolo_pair()
    assert sum(isinstance(m, NN.SyncBatchNorm2d) for m in ours.modules()) == sum(
        type(m) is nn.BatchNorm2d for m in theirs.modules()) > 50
    emas = [ModelEMA(model, decay=0.5, tau=1) for model in (theirs, ours)]  # a copy of ours, running statistics included
    assert_steps_agree(theirs.train(), ours.train(), torch.randn(5, 3, 64, 64, dtype=torch.float64), replicas=2)
    for ema, model in zip(emas, (theirs, ours)):
        ema.update(model)
    assert isinstance(emas[1].ema.model[0].bn, NN.SyncBatchNorm2d)
    for (name, a), b in zip(emas[1].ema.state_dict().items(), emas[0].ema.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, **TOL, msg=name)
    back = NN.revert_sync_batchnorm(emas[1].ema)  # what is exported: torch's layers, Ultralytics' modules kept
    assert [type(m) for m in back.modules()] == [type(m) for m in emas[0].ema.modules()]
    for model in (back, emas[0].ema):
        model.model[-1].export = True  # the head returns one tensor, as Ultralytics' exporter sets it
    x = torch.randn(1, 3, 64, 64, dtype=torch.float64)
    traced = torch.jit.trace(back, x, check_trace=False)
    for a, b in zip(outputs(traced(x)), outputs(emas[0].ema(x)), strict=True):
        torch.testing.assert_close(a, b, **TOL)


class SyncBNDetectionTrainer(DetectionTrainer):
    """The integrations page's recipe: the trainer builds (and loads) its model, then converts it."""

    def get_model(self, cfg=None, weights=None, verbose=True):
        return NN.convert_sync_batchnorm(super().get_model(cfg, weights, verbose))


def test_a_trainer_whose_get_model_converts_gives_ours_with_initialize_weights_settings() -> None:
    trainer = object.__new__(SyncBNDetectionTrainer)  # only what get_model reads: building a trainer reads a dataset
    trainer.args, trainer.data = SimpleNamespace(), {"nc": 3, "channels": 3, "names": {0: "a", 1: "b", 2: "c"}}
    model = trainer.get_model("yolo11n.yaml", verbose=False)
    layers = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert layers and all(type(m) is NN.SyncBatchNorm2d and (m.eps, m.momentum) == (1e-3, 0.03) for m in layers)


def test_the_trainers_freeze_puts_our_frozen_layers_in_eval_and_keeps_their_statistics() -> None:
    theirs, ours = yolo_pair()
    frozen = ["model.0.", "model.1.", "model.2."]
    for model in (theirs, ours):
        BaseTrainer._model_train(SimpleNamespace(model=model, freeze_layer_names=frozen))
    in_eval = [name for name, m in ours.named_modules() if isinstance(m, nn.BatchNorm2d) and not m.training]
    assert in_eval == [name for name, m in theirs.named_modules() if isinstance(m, nn.BatchNorm2d) and not m.training]
    assert len(in_eval) >= 4 and all(name.startswith(tuple(frozen)) for name in in_eval)
    before = {name: b.clone() for name, b in ours.named_buffers()}
    assert_steps_agree(theirs, ours, torch.randn(4, 3, 64, 64, dtype=torch.float64), replicas=2)
    for name, buffer in ours.named_buffers():
        if name.startswith(tuple(frozen)):
            torch.testing.assert_close(buffer, before[name], rtol=0, atol=0, msg=name)


def test_repconv_folds_our_batch_norms_as_torchs() -> None:
    torch.manual_seed(0)
    theirs = drawn_statistics(RepConv(4, 4, bn=True).double()).eval()
    ours = NN.convert_sync_batchnorm(copy.deepcopy(theirs)).eval()
    assert isinstance(ours.bn, NN.SyncBatchNorm2d)
    x = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    unfused = ours(x)
    torch.testing.assert_close(unfused, theirs(x), **TOL)
    ours.fuse_convs(), theirs.fuse_convs()
    torch.testing.assert_close(ours.forward_fuse(x), unfused, rtol=1e-6, atol=1e-6)  # its identity kernel is float32
    torch.testing.assert_close(ours.forward_fuse(x), theirs.forward_fuse(x), rtol=0, atol=0)


def test_initialize_weights_settings_survive_conversion_and_fuse_folds_ours() -> None:
    theirs, ours = yolo_pair()
    layers = [m for m in ours.modules() if isinstance(m, NN.SyncBatchNorm2d)]
    assert all(m.eps == 1e-3 and m.momentum == 0.03 for m in layers)  # what initialize_weights set on torch's
    # It asks for the exact class (type(m) is nn.BatchNorm2d), so it passes ours by: convert after building.
    fresh = NN.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(4)))
    initialize_weights(fresh)
    assert (fresh[0].eps, fresh[0].momentum) == (1e-5, 0.1)
    theirs.eval(), ours.eval()
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    unfused = outputs(ours(x))
    ours.fuse(verbose=False), theirs.fuse(verbose=False)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in ours.modules())
    for a, b, c in zip(outputs(ours(x)), unfused, outputs(theirs(x)), strict=True):
        torch.testing.assert_close(a, b, **TOL)
        torch.testing.assert_close(a, c, rtol=0, atol=0)


@pytest.mark.parametrize("architecture", ["Unet", "DeepLabV3Plus"])
def test_smp_freeze_encoder_and_a_training_step_as_torchs(architecture: str) -> None:
    torch.manual_seed(0)
    theirs = drawn_statistics(getattr(smp, architecture)("resnet18", encoder_weights=None, classes=2).double())
    for layer in theirs.modules():
        if isinstance(layer, nn.Dropout):
            layer.p = 0.0  # DeepLabV3Plus's ASPP: each replica would draw its own dropout mask
    ours = NN.convert_sync_batchnorm(copy.deepcopy(theirs))
    for model in (theirs, ours):
        model.freeze_encoder()
        model.train()  # as a loop does each epoch: smp's train() leaves the frozen encoder's norms in eval
    encoder = [name for name, m in ours.encoder.named_modules() if isinstance(m, NN.SyncBatchNorm2d)]
    assert encoder and not any(m.training for m in ours.encoder.modules() if isinstance(m, NN.SyncBatchNorm2d))
    before = {name: b.clone() for name, b in ours.encoder.named_buffers()}
    assert_steps_agree(theirs, ours, torch.randn(4, 3, 64, 64, dtype=torch.float64), replicas=2)
    for name, buffer in ours.encoder.named_buffers():
        torch.testing.assert_close(buffer, before[name], rtol=0, atol=0, msg=name)
    decoder_layers = [m for m in ours.decoder.modules() if isinstance(m, NN.SyncBatchNorm2d)]
    assert decoder_layers and all(int(m.num_batches_tracked) == 1 for m in decoder_layers)
    ours.unfreeze_encoder()
    assert all(m.training for m in ours.encoder.modules() if isinstance(m, NN.SyncBatchNorm2d))
