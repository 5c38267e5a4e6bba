"""Fused batch norm + residual + activation, and in-place activated batch norm (less memory).

    python examples/fused_and_inplace.py           # the GPU if there is one, else the CPU
    python examples/fused_and_inplace.py --smoke   # tiny sizes: seconds on a CPU

(a) ``NN.BatchNorm2d(C, activation="relu")`` called as ``bn(x, z)`` computes ``relu(bn(x) + z)``
in the batch norm's own pass, and ``NN.fuse_bn_act(model)`` rewrites a model's BN -> ReLU pairs
into such layers; both are checked against the unfused model (outputs and gradients).
(b) ``NN.convert_inplace_abn(model)`` turns conv -> BN -> LeakyReLU into conv -> ``InPlaceABN``,
which writes its output over its input and keeps only that output for backward. The script
measures what autograd saves for one forward (``torch.autograd.graph.saved_tensors_hooks``, each
storage counted once) for torch's model and for the converted one.
"""
from __future__ import annotations

import argparse
import copy
import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from syncbn import nn as NN


def conv_bn_act(cin: int, cout: int, act: Callable[[], nn.Module]) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), act()]


def max_difference(a: nn.Module, b: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    """Largest differences of the outputs and of the parameters' gradients of two models."""
    outs = [model(x) for model in (a, b)]
    for out in outs:
        out.square().mean().backward()
    out_diff = (outs[0] - outs[1]).abs().max().item()
    grad_diff = max((p.grad - q.grad).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
    return out_diff, grad_diff


def saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes that autograd saves for backward in one forward, each storage counted once."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = tensor.untyped_storage().data_ptr()  # views of one storage count once
        storages[key] = max(storages.get(key, 0), tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = model(x)
    out.sum().backward()  # the saved tensors are still valid: the in-place model can backward
    return sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=16, help="images per step (default: %(default)s)")
    parser.add_argument("--image-size", type=int, default=64, help="height and width of the synthetic images (default: %(default)s)")
    parser.add_argument("--channels", type=int, default=64, help="channels of the network's blocks (default: %(default)s)")
    parser.add_argument("--blocks", type=int, default=8, help="residual blocks of the network (default: %(default)s)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a few seconds on a CPU")
    args = parser.parse_args()
    if args.smoke:
        args.batch_size, args.image_size, args.channels, args.blocks = 4, 16, 16, 4

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    c = args.channels
    x = torch.randn(args.batch_size, c, args.image_size, args.image_size, device=device)
    tolerance = 1e-4 if device.type == "cpu" else 1e-3

    # (a) a residual block's BN + add + ReLU in one layer: relu(bn(conv(x)) + x)
    conv = nn.Conv2d(c, c, 3, padding=1, bias=False).to(device)
    plain_bn = nn.BatchNorm2d(c).to(device)
    fused_bn = NN.BatchNorm2d(c, activation="relu").to(device)
    fused_bn.load_state_dict(plain_bn.state_dict())
    expected, got = F.relu(plain_bn(conv(x)) + x), fused_bn(conv(x), x)
    print(f"(a) bn(x, z) vs relu(bn(x) + z): max difference {(expected - got).abs().max().item():.2e}")
    assert torch.allclose(expected, got, atol=tolerance)

    unfused = nn.Sequential(*[m for _ in range(args.blocks) for m in conv_bn_act(c, c, nn.ReLU)]).to(device)
    fused = NN.fuse_bn_act(copy.deepcopy(unfused))
    count = sum(1 for m in fused.modules() if getattr(m, "activation", None) == "relu")
    out_diff, grad_diff = max_difference(unfused, fused, x)
    print(f"(a) fuse_bn_act: {count} BN -> ReLU pairs fused; output difference {out_diff:.2e}, gradients {grad_diff:.2e}")
    assert out_diff < tolerance and grad_diff < tolerance

    # (b) in-place activated batch norm
    leaky = functools.partial(nn.LeakyReLU, 0.01, inplace=True)
    layers = [m for i in range(args.blocks) for m in conv_bn_act(3 if i == 0 else c, c, leaky)]
    # a pair after a pooling layer: its input is not a fresh convolution output, so it stays as is
    layers += [nn.MaxPool2d(2), nn.BatchNorm2d(c), nn.LeakyReLU(0.01, inplace=True)]
    torch_model = nn.Sequential(*layers).to(device)
    done = NN.convert_inplace_abn(copy.deepcopy(torch_model))
    inplace = done.module
    print(f"(b) convert_inplace_abn: converted {done.converted}; left alone {done.left_alone}")
    image = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    out_diff, grad_diff = max_difference(torch_model, inplace, image)
    print(f"(b) in-place vs torch: output difference {out_diff:.2e}, gradients {grad_diff:.2e}")
    assert out_diff < tolerance and grad_diff < 10 * tolerance

    ours, theirs = saved_bytes(inplace, image), saved_bytes(torch_model, image)
    print(
        f"(b) saved for backward: torch {theirs / 2**20:.2f} MiB, in-place {ours / 2**20:.2f} MiB,"
        f" ratio {ours / theirs:.2f}"
    )


if __name__ == "__main__":
    main()
