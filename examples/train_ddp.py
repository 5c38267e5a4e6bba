"""Train a small conv net with synchronized batch norm under DistributedDataParallel.

    torchrun --nproc_per_node=2 examples/train_ddp.py            # CPU: Gloo
    torchrun --nproc_per_node=4 examples/train_ddp.py --steps 50 # GPUs: NCCL, one GPU per process
    python examples/train_ddp.py                                 # starts its own local processes
    python examples/train_ddp.py --smoke                         # tiny sizes: seconds on a CPU

Launched by torchrun (``RANK`` and ``WORLD_SIZE`` in the environment) it is one of torchrun's
processes. Run directly, it starts ``--nprocs`` processes itself (default: one per GPU, else 2)
with ``torch.multiprocessing.spawn``, joined on 127.0.0.1 at a free port. Either way every rank
destroys its process group before it exits.

The backend is NCCL when CUDA is available (each process on GPU ``LOCAL_RANK``), else Gloo on
the CPU. Every rank draws its own synthetic batch (a 4-class problem whose classes differ in the
mean of their images); the batch norm statistics are taken over all ranks' batches together, so
``--batch-per-rank 2`` on 8 GPUs normalizes like a batch of 16 on one GPU. Collectives (ours and
DDP's) give up after ``--timeout`` seconds when a rank stops taking part.
"""
from __future__ import annotations

import argparse
import gc
import inspect
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from syncbn import nn as NN  # noqa: E402  (pip install --no-build-isolation -e . at the repository)


def build_model(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, classes),
    )


def synthetic_batch(batch: int, classes: int, generator: torch.Generator, device: torch.device):
    labels = torch.randint(classes, (batch,), generator=generator)
    images = torch.randn(batch, 3, 16, 16, generator=generator) + labels.view(-1, 1, 1, 1) * 0.5
    return images.to(device), labels.to(device)


def train(args: argparse.Namespace) -> None:
    """One rank's training; the process group comes from the environment (torchrun's or ours)."""
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    # the timeout applies to every collective of the group, our batch norm's included
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout))
    try:
        run(args, device, local_rank if cuda else None)
    finally:
        gc.collect()  # DDP's reducer lets go of the group before the group goes
        dist.destroy_process_group()


def run(args: argparse.Namespace, device: torch.device, device_id: int | None) -> None:
    """Train under DDP, then evaluate; rank 0 prints the loss over all ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model everywhere (DDP broadcasts rank 0's anyway)
    model = NN.convert_sync_batchnorm(build_model(args.classes)).to(device)
    # running statistics are identical on every rank, so DDP need not broadcast buffers each step
    no_buffer_sync = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        else {"broadcast_buffers": False}
    )
    model = DistributedDataParallel(model, device_ids=None if device_id is None else [device_id], **no_buffer_sync)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    generator = torch.Generator().manual_seed(1 + rank)  # each rank its own data

    for step in range(args.steps):
        images, labels = synthetic_batch(args.batch_per_rank, args.classes, generator, device)
        loss = nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {total.item() / world:.4f}  ({world} ranks, {dist.get_backend()})", flush=True)

    model.eval()  # eval with running statistics: no communication
    with torch.no_grad():
        images, labels = synthetic_batch(64, args.classes, generator, device)
        accuracy = (model(images).argmax(1) == labels).float().mean()
    dist.all_reduce(accuracy)
    # the running statistics come out the same on every rank: compare each rank's with rank 0's
    mean = model.module[1].running_mean
    reference = mean.clone()
    dist.broadcast(reference, 0)
    same = torch.tensor(float(torch.equal(mean, reference)), device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if rank == 0:
        identical = bool(same.item())
        print(f"eval accuracy {accuracy.item() / world:.2f}; running statistics identical on all {world} ranks: {identical}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawned(local_rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    """A process started by :func:`main` without torchrun: set what torchrun would, then train."""
    rank = str(local_rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=str(world))
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the processes share the cores
    train(args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps (default: %(default)s)")
    parser.add_argument("--batch-per-rank", type=int, default=4, help="images per rank and step (default: %(default)s)")
    parser.add_argument("--classes", type=int, default=4, help="classes of the synthetic problem (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=0.02, help="SGD learning rate (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a collective gives up (default: %(default)s)")
    parser.add_argument("--nprocs", type=int, default=None, help="processes to start without torchrun (default: GPUs, else 2)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a few seconds on a CPU")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.batch_per_rank, args.timeout = 4, 2, 30.0

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun (or another launcher) started us
        train(args)
        return
    world = args.nprocs or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    print(f"not under torchrun: starting {world} local processes", flush=True)
    mp.spawn(spawned, args=(world, free_port(), args), nprocs=world, join=True)


if __name__ == "__main__":
    main()
