"""The Lightning plug-in (modules/lightning.py, imported as syncbn.lightning): a two-process CPU DDP fit on Gloo gives the running
statistics (and weights) of a single-process run on the full batch, with our layers during the
fit and torch's after it; apply and revert on their own; the plug-in with each Lightning package;
the library without Lightning. Skipped where Lightning is not installed."""
from __future__ import annotations

import os
import pickle
import runpy
import signal
import subprocess
import sys

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from testkit.local_group import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FIT = '''
"""Fit a conv-BN net in float64 under Lightning: `python fit.py OUT` runs a two-rank DDP fit with
the plug-in (Lightning's launcher runs this file again for rank 1) and saves each rank's results;
`reference()` is the same fit in one process, unconverted, on the full batches."""
import os
import sys

import lightning.pytorch as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

PER_RANK, WORLD, STEPS = 4, 2, 3


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 2, 1), nn.BatchNorm2d(2)).double()


def data():
    generator = torch.Generator().manual_seed(1)
    n = PER_RANK * WORLD * STEPS
    x = torch.randn(n, 3, 5, 5, generator=generator, dtype=torch.float64) * 2 + 0.5
    return TensorDataset(x, torch.randn(n, 2, 5, 5, generator=generator, dtype=torch.float64))


def loss(model, x, y):
    return (model(x) - y).square().mean()


def optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def batch_norm_types(model):
    return [f"{type(m).__module__}.{type(m).__name__}" for m in model.modules() if "BatchNorm" in type(m).__name__]


def state(model):
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def reference():
    # Fit's sampler deals rank r the items r, r + 2, ...: batch k of the two ranks together is
    # items 8k..8k+7, the full batch k here.
    model = net()
    opt = optimizer(model)
    for x, y in DataLoader(data(), batch_size=PER_RANK * WORLD):
        opt.zero_grad()
        loss(model, x, y).backward()
        opt.step()
    return state(model)


class Fit(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = net()
        self.seen = {}

    def on_train_start(self):
        self.seen = {"types": batch_norm_types(self.net), "backend": dist.get_backend(), "world": dist.get_world_size()}

    def training_step(self, batch, index):
        return loss(self.net, *batch)

    def configure_optimizers(self):
        return optimizer(self.net)

    def train_dataloader(self):
        # Lightning's own sampler shuffles training data: this one keeps the order.
        sampler = DistributedSampler(data(), self.trainer.world_size, self.trainer.global_rank, shuffle=False)
        return DataLoader(data(), batch_size=PER_RANK, sampler=sampler)


if __name__ == "__main__":
    from syncbn.lightning import SyncBatchNormPlugin

    model = Fit()
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy="ddp", plugins=[SyncBatchNormPlugin()],
                        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(model)
    torch.save({**model.seen, "after": batch_norm_types(model.net), "state": state(model.net)},
               f"{sys.argv[1]}/rank{trainer.global_rank}.pt")
    # Gloo's threads can abort the interpreter's teardown ("terminate called without an active
    # exception"): once every rank has saved, the group goes and the process skips the teardown
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
'''

OURS, TORCHS = "syncbn.modules.batchnorm.SyncBatchNorm2d", "torch.nn.modules.batchnorm.BatchNorm2d"


def run_script(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``python *args`` in its own process group, all of which is killed if it outlives ``timeout``
    (Lightning's launcher starts rank 1 as a child: a hung fit leaves no rank behind)."""
    process = subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"the fit ran past {timeout} s:\n{output[-4000:]}")
    return subprocess.CompletedProcess(args, process.returncode, output, "")


def test_a_two_rank_ddp_fit_gives_the_full_batch_statistics(tmp_path) -> None:
    script = tmp_path / "fit.py"
    script.write_text(FIT)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    run = run_script([str(script), str(tmp_path)], env, timeout=180)
    assert run.returncode == 0, run.stdout[-4000:]
    expected = runpy.run_path(str(script), run_name="fit_reference")["reference"]()
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert (result["backend"], result["world"]) == ("gloo", 2), result
        assert result["types"] == [OURS, OURS], f"rank {rank}: not ours during the fit: {result['types']}"
        assert result["after"] == [TORCHS, TORCHS], f"rank {rank}: not reverted at teardown: {result['after']}"
        assert result["state"].keys() == expected.keys()
        for name, value in expected.items():
            if name.endswith("num_batches_tracked"):
                assert int(result["state"][name]) == int(value) == 3, (rank, name)
            else:
                assert torch.allclose(result["state"][name], value, rtol=0, atol=1e-10), (rank, name)


def model_of_every_kind() -> tuple[nn.Module, nn.Module, nn.Module]:
    """A model with a layer held twice, torch's four kinds, and a frozen layer of ours."""
    from syncbn import nn as NN

    shared, frozen = nn.BatchNorm2d(3), NN.freeze_batchnorm(NN.BatchNorm2d(3))
    inner = nn.Sequential(shared, frozen, nn.SyncBatchNorm(3), nn.BatchNorm3d(2))
    return nn.Sequential(nn.Conv2d(3, 3, 1), shared, inner, nn.BatchNorm1d(2)), shared, frozen


def test_apply_converts_and_revert_undoes_it() -> None:
    from syncbn.lightning import SyncBatchNormPlugin
    from syncbn.modules.batchnorm import SyncBatchNorm

    model, shared, frozen = model_of_every_kind()
    classes = [type(m) for m in model.modules()]
    parameters = list(model.parameters())
    group, calls = torch.distributed.ProcessGroup(torch.distributed.HashStore(), 0, 1), []
    plugin = SyncBatchNormPlugin(lambda: calls.append(1) or group)  # stands in for a process group

    assert plugin.apply(model) is model and calls == [1]
    layers = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert all(isinstance(m, SyncBatchNorm) and m.process_group is group for m in layers)
    assert model[1] is model[2][0] and model[2][1] is frozen and list(model.parameters()) == parameters

    assert plugin.revert(model) is model
    assert [type(m) for m in model.modules()] == classes
    assert model[1] is model[2][0] and list(model.parameters()) == parameters
    assert model[2][1] is frozen and frozen.frozen and frozen.process_group is None  # ours before: kept
    assert model[2][2].process_group is None  # torch's SyncBatchNorm gets its own group back
    assert len(plugin._applied) == 0


def test_a_batch_norm_model_itself_is_converted_and_reverted() -> None:
    from syncbn.lightning import SyncBatchNormPlugin

    plugin, layer = SyncBatchNormPlugin(), nn.BatchNorm1d(5)
    ours = plugin.apply(layer)
    assert type(ours).__name__ == "SyncBatchNorm1d" and ours.weight is layer.weight
    assert len(plugin._applied) == 1 and len(pickle.loads(pickle.dumps(plugin))._applied) == 0  # as ddp_spawn copies it
    back = plugin.revert(ours)
    assert type(back) is nn.BatchNorm1d and back.weight is layer.weight


def test_lightning_refuses_the_plugin_with_sync_batchnorm_true() -> None:
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch import Trainer

    from syncbn.lightning import SyncBatchNormPlugin

    plugin = SyncBatchNormPlugin()
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", plugins=[plugin], logger=False)
    assert trainer.strategy._layer_sync is plugin
    with pytest.raises(MisconfigurationException, match="sync_batchnorm"):
        Trainer(accelerator="cpu", devices=2, strategy="ddp", plugins=[plugin], sync_batchnorm=True, logger=False)


def test_the_older_pytorch_lightning_package_takes_the_plugin() -> None:
    pl = pytest.importorskip("pytorch_lightning")
    from syncbn.lightning import SyncBatchNormPlugin

    plugin = SyncBatchNormPlugin()
    assert isinstance(plugin, pl.plugins.LayerSync)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", plugins=[plugin], logger=False)
    assert trainer.strategy._layer_sync is plugin


WITHOUT_LIGHTNING = """
import sys
import syncbn, syncbn.nn, syncbn.parallel, syncbn.functional
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric"))
assert not loaded, loaded
sys.modules["lightning"] = sys.modules["pytorch_lightning"] = None  # as if not installed
try:
    import syncbn.lightning
except ImportError as error:
    print(error)
"""


def test_the_library_imports_no_lightning_and_the_plugin_says_what_to_install() -> None:
    run = subprocess.run([sys.executable, "-c", WITHOUT_LIGHTNING], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "pip install lightning" in run.stdout, run.stdout
