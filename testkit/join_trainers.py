"""The trainer recipes of docs/integrations.md, measured: Accelerate's even_batches and
join_uneven_inputs against ``syncbn.parallel.join``, mmengine's Runner with our layer chosen by a
config (and what its ``sync_bn`` does), torchrun restarting from a ``state_dict`` checkpoint.

``python -m testkit.join_trainers`` (from the checkout, in an environment that has Accelerate and
mmengine beside the installed torch and syncbn, e.g. a venv made with --system-site-packages)
launches each case as 2 CPU processes under torchrun (Gloo) and prints what each rank saw. Not
part of the test suite: those packages stay out of its environment."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from syncbn import nn as NN
from syncbn.parallel import join

SAMPLES = 10


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(i)
    return torch.randn(3, 4, 4, generator=gen, dtype=torch.float64) * 3 + 1, torch.randn(4, 4, 4, generator=gen, dtype=torch.float64)


class Indexed(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return (i, *sample(i))


def conv_bn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU()).double()


def accelerate_rank(mode: str) -> None:
    """One rank: batches of 2; ``even`` (Accelerate's default), ``torch_join``
    (``join_uneven_inputs``) or ``ours`` (``even_batches=False`` and syncbn's join)."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs

    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(even_batches=mode == "even"),
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=20))],
    )
    ref = conv_bn()
    model = NN.convert_sync_batchnorm(copy.deepcopy(ref))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(Indexed(), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    context = {"even": nullcontext(), "torch_join": accelerator.join_uneven_inputs([model]), "ours": join(model)}[mode]
    seen, start = [], time.monotonic()
    try:
        with context:
            for index, x, t in loader:
                seen.append(index.tolist())
                loss = (model(x) * t).sum()
                optimizer.zero_grad()
                accelerator.backward(loss)
                optimizer.step()
        outcome = "finished"
    except Exception as error:  # noqa: BLE001 - what the rank saw is the measurement
        outcome = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    print(f"accelerate {mode}, rank {accelerator.process_index}: {outcome} after {time.monotonic() - start:.1f} s, batches {seen}", flush=True)
    if outcome == "finished":
        everyone: list = [None] * accelerator.num_processes
        dist.all_gather_object(everyone, seen)
        if accelerator.process_index == 0:
            off = distance_from_each_sample_once(accelerator.unwrap_model(model), ref, everyone)
            print(f"accelerate {mode}: {off:.3g} off one process stepping on each sample once", flush=True)


def distance_from_each_sample_once(ours: nn.Module, ref: nn.Module, batches: list[list[list[int]]]) -> float:
    """Step ``ref`` on each step's batches of every rank, each sample once (a repeated sample is
    left out), SGD averaged over the ranks as DDP does; the largest difference of the states."""
    optimizer = torch.optim.SGD(ref.parameters(), lr=0.05 / len(batches))
    used: set[int] = set()
    for step in range(max(map(len, batches))):
        indices = [i for rank in batches if step < len(rank) for i in rank[step] if i not in used]
        used.update(indices)
        x, t = (torch.stack(parts) for parts in zip(*map(sample, indices)))
        optimizer.zero_grad()
        (ref(x) * t).sum().backward()
        optimizer.step()
    return max(float((a.double() - b.double()).abs().max()) for a, b in zip(ours.state_dict().values(), ref.state_dict().values()))


def mmengine_rank(sync_bn: str) -> None:
    """One rank of mmengine's Runner: our layer from ``norm_cfg``, lr 0, an epoch of 8 samples in
    batches of 2; ``sync_bn`` is the config's (``none``: not set)."""
    from mmengine.config import Config
    from mmengine.model import BaseModel
    from mmengine.registry import DATASETS, MODELS
    from mmengine.runner import Runner

    MODELS.register_module("SyncBNOurs", module=NN.SyncBatchNorm2d, force=True)

    @DATASETS.register_module(force=True)
    class Images(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict:
            return dict(inputs=sample(i)[0].float())

    @MODELS.register_module(force=True)
    class Net(BaseModel):
        def __init__(self, norm_cfg: dict) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1, bias=False), MODELS.build(dict(norm_cfg, num_features=4))

        def forward(self, inputs: list | torch.Tensor, mode: str = "loss") -> dict:
            return dict(loss=self.bn(self.conv(torch.stack(inputs) if isinstance(inputs, list) else inputs)).square().mean())

    dist.init_process_group("gloo")  # before the Runner, whose own init sets a CUDA device
    cfg = dict(
        model=dict(type="Net", norm_cfg=dict(type="SyncBNOurs")), work_dir=tempfile.mkdtemp(),
        train_dataloader=dict(dataset=dict(type="Images"), sampler=dict(type="DefaultSampler", shuffle=False), batch_size=2, num_workers=0),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.0)), train_cfg=dict(by_epoch=True, max_epochs=1),
        launcher="pytorch", env_cfg=dict(dist_cfg=dict(backend="gloo")), default_hooks=dict(checkpoint=None, logger=None),
        model_wrapper_cfg=dict(type="MMDistributedDataParallel", device_ids=None),
    )
    if sync_bn != "none":
        cfg["sync_bn"] = sync_bn
    try:
        runner = Runner.from_cfg(Config(cfg))
        runner.train()
    except Exception as error:  # noqa: BLE001 - what the rank saw is the measurement
        print(f"mmengine sync_bn={sync_bn}, rank {dist.get_rank()}: {type(error).__name__}: {error}", flush=True)
        return
    inner = runner.model.module
    if dist.get_rank() == 0:
        ref = nn.BatchNorm2d(4)  # DefaultSampler: step s of rank r holds samples 4s + r and 4s + r + 2
        for s in range(2):
            ref(inner.conv(torch.stack([sample(i)[0].float() for i in range(4 * s, 4 * s + 4)])))
        off = max(float((getattr(inner.bn, n) - getattr(ref, n)).abs().max()) for n in ("running_mean", "running_var"))
        print(f"mmengine sync_bn={sync_bn}: {type(inner.bn).__name__}, running statistics {off:.3g} off the global batch's", flush=True)


def restart_rank(checkpoint: str, fail: str) -> None:
    """One rank of 6 DDP steps, a checkpoint after each; with ``fail``, rank 1 raises at step 5 of
    the first attempt and torchrun restarts both from the checkpoint."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 5, 1), nn.BatchNorm2d(5))
    model = nn.parallel.DistributedDataParallel(NN.convert_sync_batchnorm(net.double()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    if os.path.exists(checkpoint):
        state = torch.load(checkpoint, map_location="cpu")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    for step in range(start, 6):
        if fail == "fail" and step == 4 and rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            raise RuntimeError("a worker fails")
        x = torch.randn(3 + rank, 3, 4, 4, generator=torch.Generator().manual_seed(10 * step + rank), dtype=torch.float64)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        if rank == 0:
            torch.save(dict(model=model.module.state_dict(), optimizer=optimizer.state_dict(), step=step + 1), checkpoint + ".tmp")
            os.replace(checkpoint + ".tmp", checkpoint)
        dist.barrier()
    if rank == 0:
        torch.save(model.module.state_dict(), checkpoint + ".final")


def torchrun(*args: str, restarts: int = 0, standalone: bool = True) -> str:
    """Launch this module's ``args`` case on 2 local processes; what the ranks printed."""
    rendezvous = ["--standalone"] if standalone else ["--master_port=29731"]
    command = [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc_per_node=2",
               f"--max-restarts={restarts}", "-m", "testkit.join_trainers", *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        lines = (done.stdout + done.stderr).splitlines()
    except subprocess.TimeoutExpired:
        lines = ["(no end within 120 s)"]
    return "\n".join(line for line in lines if line.startswith(("accelerate ", "mmengine ", "(no end"))) or f"exit {done.returncode}"


def main() -> None:
    for mode in ("even", "torch_join", "ours"):
        print(torchrun("accelerate", mode))
    for sync_bn in ("none", "torch"):
        print(torchrun("mmengine", sync_bn))
    print("torchrun --standalone, a worker failing at step 5:", ", ".join(restart_outcome() for _ in range(5)))


def restart_outcome() -> str:
    """One restarted run against an uninterrupted one."""
    with tempfile.TemporaryDirectory() as folder:
        once, restarted = os.path.join(folder, "once.pt"), os.path.join(folder, "restarted.pt")
        torchrun("restart", once, "no")
        torchrun("restart", restarted, "fail", restarts=1)
        if not os.path.exists(restarted + ".final"):
            return "the restarted workers failed"
        a, b = torch.load(once + ".final"), torch.load(restarted + ".final")
        return "resumed, bitwise equal" if all(torch.equal(a[k], b[k]) for k in a) else "resumed, different"

if __name__ == "__main__":
    if len(sys.argv) == 1:
        main()
    else:
        {"accelerate": accelerate_rank, "mmengine": mmengine_rank, "restart": restart_rank}[sys.argv[1]](*sys.argv[2:])
