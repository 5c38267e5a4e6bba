"""One device (a laptop, a Jetson, one GPU): train with our layers, export plain torch for inference.

    python examples/one_device.py                 # the GPU if there is one, else the CPU
    python examples/one_device.py --smoke         # tiny sizes: seconds on a CPU
    python examples/one_device.py --out model.pt2 # keep the exported program

On one device in one process there is nothing to synchronize, so a converted layer is an
ordinary fast batch norm (torch's kernel or ours, whichever measured faster there): the same
model code trains on a laptop and on a cluster. For deployment, ``NN.revert_sync_batchnorm``
turns the layers back into torch's ``nn.BatchNorm2d`` (same parameters and buffers), and the
eval-mode model is exported with ``torch.export.export``, saved with ``torch.export.save``,
loaded back and checked against the model.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

import syncbn
from syncbn import nn as NN


def small_cnn(classes: int) -> nn.Sequential:
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

    return nn.Sequential(
        *block(3, 32), nn.MaxPool2d(2), *block(32, 64), nn.MaxPool2d(2), *block(64, 128),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, classes),
    )


def synthetic_batch(batch: int, size: int, classes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A `classes`-way problem whose classes differ in the mean of their images."""
    labels = torch.randint(classes, (batch,), device=device)
    images = torch.randn(batch, 3, size, size, device=device) + labels.view(-1, 1, 1, 1) * 0.3
    return images, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=32, help="images per step (default: %(default)s)")
    parser.add_argument("--image-size", type=int, default=64, help="height and width of the synthetic images (default: %(default)s)")
    parser.add_argument("--classes", type=int, default=4, help="classes of the synthetic problem (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default: %(default)s)")
    parser.add_argument("--out", default=None, help="where to save the exported program (default: a temporary directory)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a few seconds on a CPU")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.batch_size, args.image_size = 6, 8, 16

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device: {device}, backend: {syncbn.backend_info()}")
    model = NN.convert_sync_batchnorm(small_cnn(args.classes)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    model.train()
    every = max(1, args.steps // 5)
    for step in range(args.steps):
        images, labels = synthetic_batch(args.batch_size, args.image_size, args.classes, device)
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % every == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")

    model = NN.revert_sync_batchnorm(model).eval()  # plain torch layers, running statistics
    kinds = sorted({f"{type(m).__module__}.{type(m).__name__}" for m in model.modules() if "BatchNorm" in type(m).__name__})
    print(f"reverted: batch norms are now {kinds}")

    example = synthetic_batch(args.batch_size, args.image_size, args.classes, device)[0]
    exported = torch.export.export(model, (example,))
    with tempfile.TemporaryDirectory() as scratch:
        path = args.out or os.path.join(scratch, "model.pt2")
        torch.export.save(exported, path)
        loaded = torch.export.load(path).module()
        where = path if args.out else "a temporary directory (--out to keep it)"
        print(f"exported and saved to {where}: {os.path.getsize(path) / 2**10:.0f} KiB; loaded back")

    images, labels = synthetic_batch(args.batch_size, args.image_size, args.classes, device)
    with torch.no_grad():
        expected, got = model(images), loaded(images)
    difference = (expected - got).abs().max().item()
    accuracy = (got.argmax(1) == labels).float().mean().item()
    print(f"exported vs eager: max abs difference {difference:.3g}; exported accuracy {accuracy:.2f}")
    if difference > 1e-4:
        raise SystemExit("the exported program does not match the model")


if __name__ == "__main__":
    main()
