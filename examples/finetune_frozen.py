"""Fine-tune a new head on a pretrained backbone whose batch norms are frozen.

    python examples/finetune_frozen.py                    # the GPU if there is one, else the CPU
    python examples/finetune_frozen.py --train-bn-affine  # also train the batch norms' weight and bias
    python examples/finetune_frozen.py --smoke            # tiny sizes: seconds on a CPU

``NN.freeze_batchnorm(backbone)`` makes every batch norm of the backbone normalize with its
running statistics in training too and never update them (torchvision's ``FrozenBatchNorm2d``,
MXNet's ``use_global_stats``): the usual setting for detection and segmentation fine-tuning with
a few images per GPU, where batch statistics would be noise. It never communicates either. Here
the "pretrained" backbone is pretrained for a few steps on one task, then frozen, and a new head
learns another task on top of it; at the end the script asserts that no running statistic (nor
``num_batches_tracked``) changed.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from syncbn import nn as NN


def backbone(width: int = 32) -> nn.Sequential:
    def block(cin: int, cout: int) -> list[nn.Module]:
        conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        return [conv, nn.BatchNorm2d(cout), nn.ReLU(inplace=True), nn.MaxPool2d(2)]

    return nn.Sequential(
        *block(3, width), *block(width, 2 * width), *block(2 * width, 4 * width), nn.AdaptiveAvgPool2d(1), nn.Flatten()
    )


def synthetic_batch(
    batch: int, size: int, classes: int, shift: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images whose class sets their mean (per channel: ``shift`` moves the task)."""
    labels = torch.randint(classes, (batch,), device=device)
    offset = torch.stack([labels * 0.3, labels * shift, -labels * 0.2], 1).view(-1, 3, 1, 1)
    return torch.randn(batch, 3, size, size, device=device) + offset, labels


def train(
    model: nn.Module, params: list[nn.Parameter], args: argparse.Namespace, classes: int, shift: float, name: str
) -> None:
    """``args.epochs`` epochs of SGD on ``params``; the mean loss of each epoch."""
    device = next(model.parameters()).device
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9)
    model.train()  # frozen layers stay frozen in train mode
    for epoch in range(args.epochs):
        total = 0.0
        for _ in range(args.steps_per_epoch):
            images, labels = synthetic_batch(args.batch_size, args.image_size, classes, shift, device)
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item()
        print(f"{name} epoch {epoch}: loss {total / args.steps_per_epoch:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=5, help="passes over the synthetic data (default: %(default)s)")
    parser.add_argument("--steps-per-epoch", type=int, default=40, help="training steps per epoch (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16, help="images per step (default: %(default)s)")
    parser.add_argument("--image-size", type=int, default=64, help="height and width of the synthetic images (default: %(default)s)")
    parser.add_argument("--classes", type=int, default=5, help="classes of the new task (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=0.02, help="SGD learning rate (default: %(default)s)")
    parser.add_argument("--train-bn-affine", action="store_true", help="also train the frozen layers' weight and bias")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a few seconds on a CPU")
    args = parser.parse_args()
    if args.smoke:
        args.epochs, args.steps_per_epoch, args.batch_size, args.image_size = 2, 4, 8, 16

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    # "pretraining": torch's own layers on another task (3 classes), batch statistics as usual
    features = backbone().to(device)
    pretraining = nn.Sequential(features, nn.Linear(128, 3)).to(device)
    train(pretraining, list(pretraining.parameters()), args, 3, 0.0, "pretrain")

    features = NN.freeze_batchnorm(features)  # ours, frozen: running statistics in training too
    frozen = [m for m in features.modules() if isinstance(m, NN.SyncBatchNorm)]
    print(f"frozen {len(frozen)} batch norms: {frozen[0]}")
    before = {k: v.clone() for k, v in features.state_dict().items() if "running" in k or "num_batches" in k}

    for p in features.parameters():
        p.requires_grad_(False)  # the convolutions stay as pretrained
    if args.train_bn_affine:
        for layer in frozen:
            layer.weight.requires_grad_(True)
            layer.bias.requires_grad_(True)
    head = nn.Sequential(nn.Linear(128, 64), nn.ReLU(inplace=True), nn.Linear(64, args.classes)).to(device)
    model = nn.Sequential(features, head)
    trained = [p for p in model.parameters() if p.requires_grad]
    print(f"training {sum(p.numel() for p in trained)} of {sum(p.numel() for p in model.parameters())} parameters")
    train(model, trained, args, args.classes, 0.4, "finetune")

    after = features.state_dict()
    changed = [k for k, v in before.items() if not torch.equal(v, after[k])]
    assert not changed, f"running statistics changed: {changed}"
    print(f"running statistics unchanged: {len(before)} buffers checked (running_mean, running_var, num_batches_tracked)")
    print(f"  e.g. layer {frozen[0].layer_name!r}: running_mean[:3] = {frozen[0].running_mean[:3].tolist()}")


if __name__ == "__main__":
    main()
