"""Synchronized layers across ranks on CUDA tensors, on a machine with one GPU (a step of
tools/gpu_check.sh): NCCL with one rank (the layer made to sync over its one-rank group, which it
otherwise skips), and Gloo with CUDA tensors in two processes sharing the GPU, with uneven
batches and with an empty rank. Each rank trains on its rows of a global batch, ours against
torch's layers on all of it: outputs, input gradients, weight and bias gradients (summed over
the ranks), running statistics and num_batches_tracked, over three steps, float64.

    python tools/gpu_ranks.py          # prints one line per case; exits non-zero on a mismatch
"""
from __future__ import annotations

import copy
import os
import sys
from datetime import timedelta
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import syncbn.modules.batchnorm as batchnorm  # noqa: E402
from syncbn import nn as NN  # noqa: E402
from testkit.local_group import free_port, run_local_group  # noqa: E402

STEPS = 3
TOLERANCE = dict(atol=1e-10, rtol=1e-10)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 6, 1),
        nn.BatchNorm2d(6, momentum=None),
    ).double().cuda()


def train(sizes: list[int], rank: int) -> None:
    """Ours on this rank's rows of each step's global batch, against torch's layers on all of it."""
    ref = model()
    ours = NN.convert_sync_batchnorm(copy.deepcopy(ref))
    start = sum(sizes[:rank])
    rows = slice(start, start + sizes[rank])
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        x = (torch.randn(sum(sizes), 3, 5, 5, generator=gen, dtype=torch.float64) * 3 + 1).cuda()
        upstream = torch.randn(sum(sizes), 6, 5, 5, generator=gen, dtype=torch.float64).cuda()
        x_ref, x_ours = x.clone().requires_grad_(), x[rows].clone().requires_grad_()
        y_ref, y = ref(x_ref), ours(x_ours)
        (y_ref * upstream).sum().backward()
        (y * upstream[rows]).sum().backward()
        torch.testing.assert_close(y, y_ref[rows], **TOLERANCE)
        torch.testing.assert_close(x_ours.grad, x_ref.grad[rows], **TOLERANCE)
        for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
            grad = p.grad.clone()
            dist.all_reduce(grad)  # each rank's share of the full batch's gradient
            torch.testing.assert_close(grad, q.grad, **TOLERANCE, msg=f"step {step}: {name}.grad")
            p.grad = q.grad = None
        for (name, a), b in zip(ours.named_buffers(), ref.buffers()):
            torch.testing.assert_close(a, b, **TOLERANCE, msg=f"step {step}: {name}")
    torch.cuda.synchronize()


def gloo_case(rank: int, world: int, sizes: list[int]) -> str:
    torch.cuda.set_device(0)
    train(sizes, rank)
    return "ok"


def every_group_syncs(process_group, label):
    """active_process_group, with a group of one rank syncing too (as if it had more)."""
    return dist.group.WORLD if process_group is None else process_group


def nccl_one_rank() -> None:
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    try:
        with mock.patch.object(batchnorm, "active_process_group", every_group_syncs):
            train([7], 0)
    finally:
        dist.destroy_process_group()


def main() -> int:
    failed = 0
    cases = [("nccl, one rank, synced", nccl_one_rank)]
    for sizes in ([3, 5], [0, 6]):
        cases.append((f"gloo, CUDA tensors, 2 ranks of {sizes}", lambda s=sizes: run_local_group(gloo_case, 2, s, timeout_s=60)))
    for name, case in cases:
        try:
            case()
            print(f"{name}: ok", flush=True)
        except Exception as error:  # noqa: BLE001 - every case runs; the exit status says
            failed += 1
            print(f"{name}: FAILED: {type(error).__name__}: {error}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
