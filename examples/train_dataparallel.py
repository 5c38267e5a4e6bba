"""Train a small segmentation net with synchronized batch norm over data-parallel replicas.

    python examples/train_dataparallel.py             # 2+ GPUs: nn.DataParallel; else CPU replicas
    python examples/train_dataparallel.py --smoke     # tiny sizes, a few seconds on a laptop CPU

The net (conv/BN/ReLU encoder-decoder with a residual add, one class per pixel) is built with
torch's ``nn.BatchNorm2d`` and converted with ``NN.convert_sync_batchnorm``, so each layer
normalizes with the statistics of the whole batch, not of each replica's slice of it. With two or
more GPUs it runs under stock ``nn.DataParallel``; otherwise under
``ThreadedDataParallel(model, ["cpu"] * replicas)`` (threads on the CPU), which runs the same
multi-replica path with no GPU. The data are synthetic: random images whose per-pixel class
depends on the pixel's 5x5 neighbourhood, so the loss can fall.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import syncbn
from syncbn import nn as NN
from syncbn.parallel import ThreadedDataParallel

try:
    from tqdm import tqdm
except ImportError:  # tqdm is optional: a plain line per batch instead
    tqdm = None


def conv_bn_relu(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class SegNet(nn.Module):
    """Encoder (full and half resolution), decoder upsampling back with a residual add."""

    def __init__(self, classes: int, width: int = 32) -> None:
        super().__init__()
        self.stem = conv_bn_relu(3, width)
        self.down = nn.Sequential(conv_bn_relu(width, 2 * width, stride=2), conv_bn_relu(2 * width, 2 * width))
        self.up = nn.Sequential(nn.ConvTranspose2d(2 * width, width, 2, stride=2, bias=False), nn.BatchNorm2d(width))
        self.fuse = conv_bn_relu(width, width)
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.stem(x)
        x = F.relu(self.up(self.down(skip)) + skip)  # the residual add
        return self.head(self.fuse(x))


def synthetic_batch(
    batch: int, size: int, projection: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images, and masks: the class whose fixed projection of the 5x5-blurred pixel is largest."""
    images = torch.randn(batch, 3, size, size, generator=generator)
    blurred = F.avg_pool2d(images, 5, stride=1, padding=2)
    masks = torch.einsum("kc,nchw->nkhw", projection, blurred).argmax(1)
    return images, masks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=5, help="passes over the synthetic data (default: %(default)s)")
    parser.add_argument("--steps-per-epoch", type=int, default=50, help="training steps per epoch (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16, help="the whole batch, split over the replicas (default: %(default)s)")
    parser.add_argument("--image-size", type=int, default=256, help="height and width of the synthetic images (default: %(default)s)")
    parser.add_argument("--classes", type=int, default=3, help="classes of the synthetic segmentation task (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default: %(default)s)")
    parser.add_argument("--replicas", type=int, default=2, help="CPU replicas when there are not 2+ GPUs (default: %(default)s)")
    parser.add_argument("--cpu", action="store_true", help="use CPU replicas even where there are GPUs")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a few seconds on a CPU")
    args = parser.parse_args()
    if args.smoke:
        args.epochs, args.steps_per_epoch, args.batch_size, args.image_size = 2, 4, 8, 24

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    projection = torch.randn(args.classes, 3, generator=generator)
    model = NN.convert_sync_batchnorm(SegNet(args.classes))
    gpus = 0 if args.cpu else torch.cuda.device_count()
    device = torch.device("cuda" if gpus >= 2 else "cpu")
    if gpus >= 2:
        parallel: nn.Module = nn.DataParallel(model.to(device))  # stock DataParallel, every GPU
        print(f"path: nn.DataParallel over {gpus} GPUs")
    else:
        parallel = ThreadedDataParallel(model, ["cpu"] * args.replicas)
        print(f"path: ThreadedDataParallel over {args.replicas} CPU replicas ({gpus} GPU(s) seen)")
    print(f"backend: {syncbn.backend_info()}")
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)

    parallel.train()
    for epoch in range(args.epochs):
        start, total = time.perf_counter(), 0.0
        steps = range(args.steps_per_epoch)
        # a bar where a person watches a terminal; a plain line per batch in a log
        bar = tqdm(steps, desc=f"epoch {epoch}", leave=False) if tqdm is not None and sys.stderr.isatty() else None
        for step in bar if bar is not None else steps:
            images, masks = synthetic_batch(args.batch_size, args.image_size, projection, generator)
            loss = F.cross_entropy(parallel(images.to(device)), masks.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item()
            if bar is not None:
                bar.set_postfix(loss=f"{loss.item():.4f}")
            else:
                print(f"  epoch {epoch} batch {step + 1}/{args.steps_per_epoch}  loss {loss.item():.4f}")
        seconds = time.perf_counter() - start
        print(f"epoch {epoch}: loss {total / args.steps_per_epoch:.4f}  ({seconds:.1f} s)")

    parallel.eval()  # eval: running statistics, no communication
    with torch.no_grad():
        images, masks = synthetic_batch(args.batch_size, args.image_size, projection, generator)
        accuracy = (parallel(images.to(device)).argmax(1) == masks.to(device)).float().mean().item()
    print(f"eval pixel accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
