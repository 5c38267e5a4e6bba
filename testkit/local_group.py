"""Running a function in a few local processes joined in a Gloo group."""
from __future__ import annotations

import gc
import os
import socket
import sys
import tempfile
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _local_worker(
    rank: int, world_size: int, port: int, timeout_s: float, threads: int | None, out_dir: str, fn: Callable, args: tuple
) -> None:
    if threads is not None:
        torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    torch.save(fn(rank, world_size, *args), os.path.join(out_dir, f"{rank}.pt"))
    gc.collect()  # DDP reducers and their groups go before the default group does
    dist.destroy_process_group()
    # Gloo's threads can abort the interpreter's teardown ("terminate called without an active
    # exception", seen about once in 10 runs here): the work is done and saved, so skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_local_group(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 30.0, threads: int | None = 1
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes joined in a Gloo
    group on loopback (a free port; collectives time out after ``timeout_s``; ``threads`` intra-op
    threads each, None for torch's default); returns what they returned, in rank order. ``fn``
    must be importable (module level) and its result picklable by ``torch.save``. An error in a
    process is re-raised here (``torch.multiprocessing.ProcessRaisedException``)."""
    with tempfile.TemporaryDirectory() as out_dir:
        torch.multiprocessing.spawn(
            _local_worker,
            (world_size, free_port(), timeout_s, threads, out_dir, fn, args),
            nprocs=world_size,
            join=True,
        )
        return [torch.load(os.path.join(out_dir, f"{rank}.pt"), weights_only=False) for rank in range(world_size)]
