"""What ``test.py`` runs (it parses the options and prints the result): its cases (the networks of
``testkit.networks`` and how our copy of each is made), the tolerances per dtype and kind of
quantity, the rows of worst differences and their table, and one case trained side by side with its
reference (``testkit.lockstep``), ours as replicas in threads, under stock ``nn.DataParallel``, or
under ``DistributedDataParallel`` in local processes (``--distributed``)."""
from __future__ import annotations

import copy
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from syncbn.functions import backend_info
from testkit.local_group import run_local_group
from syncbn import nn as NN
from syncbn.modules.parallel import ThreadedDataParallel
from testkit.lockstep import train_side_by_side
from testkit.networks import (
    MaskedNet, build_1d, build_2d, build_3d, build_inplace, checkpointed, in_place, masked_ours, padded_images_mask,
)


HALF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


DTYPES = {"float64": torch.float64, "float32": torch.float32, **HALF_DTYPES}


@dataclass(frozen=True)
class Case:
    """A small network and the shape of one sample of its input."""

    build: Callable[[], nn.Module]
    sample_shape: tuple[int, ...]
    channels_last: torch.memory_format | None  # the layout --channels-last asks for, if any
    convert: Callable[[nn.Module], nn.Module] = NN.convert_sync_batchnorm
    """How the reference's copy becomes ours."""
    masked: bool = False
    """Whether the network takes a mask of padded images as its second input."""


CASES: dict[str, Case] = {
    "1d": Case(build_1d, (8,), None),
    "2d": Case(build_2d, (3, 8, 8), torch.channels_last),
    "3d": Case(build_3d, (2, 5, 5, 5), torch.channels_last_3d),
    "inplace": Case(build_inplace, (3, 8, 8), torch.channels_last, in_place),
    "checkpoint": Case(build_2d, (3, 8, 8), torch.channels_last, checkpointed),
    "masked": Case(MaskedNet, (3, 8, 8), torch.channels_last, masked_ours, masked=True),
}


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float

    def of(self, reference_scale: float) -> float:
        return self.atol + self.rtol * reference_scale


# Tolerances per dtype and kind of quantity: "output" (the model's output, in the dtype),
# "stat" (running_mean/var, kept in float32 or float64) and "grad". Observed worst
# differences over 12 seeds x {default, --channels-last, --replicas 2, 7 on 3 replicas}:
# float64: exact up to rounding, ~1e-14 absolute; 1e-9 leaves no room for a wrong formula
#   while any reduction order passes.
# float32: one forward is ~1e-6 apart (other reduction orders over the chunks than over the
#   full batch); after a few SGD steps the parameters themselves are ~1e-6 apart. Observed:
#   outputs and running stats up to 4e-6 relative to their scale (running_mean after 5
#   steps), gradients up to 2e-6. Per-replica statistics change all of them by ~1e-1. At
#   the default lr the models stay well conditioned; with a large lr (0.1) a ReLU channel
#   can die and two float32 nn.BatchNorm models that differ only in memory layout diverge.
# bfloat16/float16 (autocast): every activation and activation gradient is rounded to 8/11
#   mantissa bits, and a sum of many rounded terms that nearly cancel (the bias gradient of
#   the first batch norm) is off by far more than one ulp of the sum: against a float64 model,
#   torch's own nn.BatchNorm model is off by up to 17% (bf16) of the largest gradient, and the
#   synchronized one by just as much; the two are observed up to 4% (bf16) and 0.3% (fp16)
#   apart. Outputs differ by an ulp or two. The running stats are float32 and taken in float32
#   (as by torch), observed within 2e-5 relative, so they get float32-like tolerances that
#   still catch a wrong N/(N-1) factor. Parameters are realigned after each step (see
#   realign_parameters).
TOLERANCES: dict[torch.dtype, dict[str, Tolerance]] = {
    torch.float64: dict(output=Tolerance(1e-9, 1e-9), stat=Tolerance(1e-9, 1e-9), grad=Tolerance(1e-9, 1e-9)),
    torch.float32: dict(output=Tolerance(2e-5, 2e-5), stat=Tolerance(2e-5, 2e-5), grad=Tolerance(1e-4, 1e-4)),
    torch.float16: dict(output=Tolerance(2e-3, 2e-3), stat=Tolerance(1e-4, 1e-4), grad=Tolerance(5e-2, 2e-2)),
    torch.bfloat16: dict(output=Tolerance(1e-2, 2e-2), stat=Tolerance(1e-4, 1e-4), grad=Tolerance(5e-1, 1e-1)),
}


EXACT = Tolerance(0.0, 0.0)  # integer buffers (num_batches_tracked)


@dataclass
class Row:
    """The worst difference of one quantity over all steps."""

    max_diff: float = 0.0
    max_ref: float = 0.0
    exact: bool = False

    def update(self, ours: Tensor | None, ref: Tensor | None) -> None:
        """Fold in one step. A missing tensor, another shape or dtype, or a NaN is inf apart."""
        self.exact = self.exact or (ref is not None and not ref.is_floating_point())
        if ours is None and ref is None:
            return
        if ours is None or ref is None or (ours.shape, ours.dtype) != (ref.shape, ref.dtype):
            self.max_diff = float("inf")
            return
        if ref.numel() == 0:
            return
        ours64, ref64 = ours.detach().double().cpu(), ref.detach().double().cpu()
        diff = (ours64 - ref64).abs().nan_to_num(nan=float("inf")).max().item()
        self.max_diff = max(self.max_diff, diff)
        self.max_ref = max(self.max_ref, ref64.abs().nan_to_num(nan=0.0).max().item())

    def tolerance(self, tolerance: Tolerance) -> float:
        return (EXACT if self.exact else tolerance).of(self.max_ref)


@dataclass(frozen=True)
class Config:
    device: torch.device
    dtype: torch.dtype
    replicas: int | None
    steps: int
    batch: int
    channels_last: bool
    seed: int
    lr: float
    processes: int = 1  # --distributed

    @property
    def mixed(self) -> bool:
        """Half dtypes run float32 models under autocast."""
        return self.dtype in HALF_DTYPES.values()

    @property
    def model_dtype(self) -> torch.dtype:
        """The dtype of the parameters, buffers and input."""
        return torch.float32 if self.mixed else self.dtype


def replica_plan(config: Config) -> tuple[bool, int]:
    """(nn.DataParallel or threads, how many replicas): DataParallel over 2+ GPUs, else threads."""
    gpus = torch.cuda.device_count() if config.device.type == "cuda" else 0
    if gpus >= 2:
        return True, min(config.replicas or gpus, gpus)
    return False, config.replicas or 4


def parallelize(model: nn.Module, config: Config) -> nn.Module:
    """The converted model under DDP (--distributed), else as replicas as :func:`replica_plan` says."""
    if config.processes > 1:
        return DistributedDataParallel(model, forward_sync_buffers=False)
    data_parallel, replicas = replica_plan(config)
    if data_parallel:
        return nn.DataParallel(model, device_ids=list(range(replicas)))
    return ThreadedDataParallel(model, [config.device] * replicas)


def rank_rows(config: Config, rank: int) -> slice:
    """The rows of the batch that ``rank`` of ``config.processes`` takes: its chunk, as the
    replicas would have it, or none."""
    sizes = [len(c) for c in torch.arange(config.batch).chunk(config.processes)]
    sizes += [0] * (config.processes - len(sizes))
    return slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))


def describe(config: Config) -> str:
    data_parallel, replicas = replica_plan(config)
    if config.processes > 1:
        how = f"DistributedDataParallel over {config.processes} local Gloo processes"
        replicas = config.processes
    elif data_parallel:
        how = f"nn.DataParallel on cuda:0..{replicas - 1}"
    else:
        how = f"ThreadedDataParallel on {replicas} x {config.device}"
    chunks = [len(c) for c in torch.arange(config.batch).chunk(replicas)]
    dtype = str(config.dtype).removeprefix("torch.")
    mixed = " (autocast, float32 weights)" if config.mixed else ""
    return (
        f"sync batch norm vs nn.BatchNorm on the full batch: {dtype}{mixed}, batch {config.batch} in "
        f"chunks {chunks}, {how}, {config.steps} SGD steps (lr {config.lr}), "
        f"channels_last={config.channels_last}, seed {config.seed}, kernels {backend_info()}"
    )


def randomize_batch_norms(model: nn.Module, generator: torch.Generator) -> None:
    """Batch norm weights in [0.5, 1.5) and biases in [-0.5, 0.5), not the default 1 and 0."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.weight.copy_(torch.rand(module.weight.shape, generator=generator) + 0.5)
                module.bias.copy_(torch.rand(module.bias.shape, generator=generator) - 0.5)


def build_pair(case: Case, config: Config) -> tuple[nn.Module, nn.Module]:
    """The reference and the converted model (bare, not yet wrapped), identical to start with."""
    torch.manual_seed(config.seed)
    reference = case.build()
    randomize_batch_norms(reference, torch.Generator().manual_seed(config.seed))
    reference.to(config.device, config.model_dtype)
    if config.channels_last and case.channels_last is not None:
        reference.to(memory_format=case.channels_last)
    return reference, case.convert(copy.deepcopy(reference))


def make_input(case: Case, config: Config, step: int) -> Tensor:
    """The step's input: mean 2 and std 3, so that the mean is not small against the spread."""
    generator = torch.Generator().manual_seed(config.seed * 1000 + step)
    x = 2.0 + 3.0 * torch.randn((config.batch, *case.sample_shape), generator=generator, dtype=torch.float64)
    x = x.to(config.device, config.model_dtype)
    if config.channels_last and case.channels_last is not None:
        x = x.contiguous(memory_format=case.channels_last)
    return x


def make_inputs(case: Case, config: Config, step: int) -> list[Tensor]:
    """The step's inputs: x, and for a masked case the mask of padded images (the last sample's
    all padding)."""
    if not case.masked:
        return [make_input(case, config, step)]
    generator = torch.Generator().manual_seed(config.seed * 1000 + 700 + step)
    mask = padded_images_mask(config.batch, case.sample_shape[-1], generator).to(config.device)
    return [make_input(case, config, step), mask]


def upstream_gradient(output: Tensor, config: Config, step: int) -> Tensor:
    """dL/dy of the step for the full batch's ``output``: random, the same for both models (a
    fresh generator every call)."""
    generator = torch.Generator().manual_seed(config.seed * 1000 + 500 + step)
    grad = torch.randn(output.shape, generator=generator, dtype=torch.float64)
    return grad.to(output.device, output.dtype)


def autocast(config: Config) -> AbstractContextManager:
    """Mixed precision for the half dtypes (float32 weights, half activations), else nothing."""
    if config.mixed:
        return torch.autocast(config.device.type, dtype=config.dtype)
    return nullcontext()


def realign_parameters(model: nn.Module, reference: nn.Module) -> None:
    """Copy the reference's parameters (not its buffers) into ``model``.

    For the half dtypes only: torch's half convolutions round their weight gradient once per
    call, so the sum of the replicas' gradients and the full batch's one differ by ~0.3% (bf16)
    of their scale whatever the batch norm does, and SGD would compound that into diverging
    models. Realigned, every step compares the batch norms on the same parameters again, while
    the running statistics still accumulate on their own.
    """
    with torch.no_grad():
        for ours, theirs in zip(model.parameters(), reference.parameters()):
            ours.copy_(theirs)
        for layer in model.modules():  # their scale is |weight| + eps (convert_inplace_abn)
            if isinstance(layer, NN.InPlaceABN) and layer.weight is not None:
                layer.weight.sub_(layer.eps)


def run_case(name: str, case: Case, config: Config, rows: dict[tuple[str, str, str], Row], rank: int = 0) -> None:
    """Train both models side by side (``testkit.lockstep``); fold each step's differences into
    ``rows``.

    Layers are named by the reference's index and type. Under --distributed this runs on every
    rank, ours on the rank's rows of the batch (DDP averages the gradients over the ranks).
    """
    reference, converted = build_pair(case, config)
    types = {layer: f"{layer} {type(module).__name__}" for layer, module in reference.named_modules()}
    steps = train_side_by_side(
        reference,
        converted,
        lambda step: make_inputs(case, config, step),
        config.steps,
        runner=parallelize(converted, config),
        rows=rank_rows(config, rank),
        upstream=lambda step, y: upstream_gradient(y, config, step),
        lr=config.lr,
        averaged_over=config.processes,
        context=lambda: autocast(config),
        after_step=(lambda: realign_parameters(converted, reference)) if config.mixed else None,
    )
    for quantities in steps:
        for q in quantities:
            rows.setdefault((name, types.get(q.layer, q.layer), q.name), Row()).update(q.ours, q.reference)


def kind_of(quantity: str) -> str:
    """Which tolerance a quantity gets: "grad", "stat" (running stats) or "output"."""
    if quantity.endswith("grad"):
        return "grad"
    return "stat" if quantity.startswith("running_") else "output"


def print_table(rows: dict[tuple[str, str, str], Row], tolerances: dict[str, Tolerance]) -> int:
    """Print one line per row; return the number of failed rows."""
    # each column as wide as its longest entry (case names such as "checkpoint" included)
    widths = [max([len(title), *(len(key[column]) for key in rows)]) for column, title in enumerate(("case", "layer", "quantity"))]
    case_w, layer_w, quantity_w = widths
    header = f"{'case':<{case_w}} {'layer':<{layer_w}} {'quantity':<{quantity_w}} {'max |diff|':>11} {'tolerance':>11}  status"
    print(header)
    print("-" * len(header))
    failures = 0
    for (case, layer, quantity), row in rows.items():
        tolerance = row.tolerance(tolerances[kind_of(quantity)])
        ok = row.max_diff <= tolerance
        failures += not ok
        status = "OK" if ok else "FAIL"
        print(f"{case:<{case_w}} {layer:<{layer_w}} {quantity:<{quantity_w}} {row.max_diff:>11.3e} {tolerance:>11.3e}  {status}")
    return failures


def run_rank(rank: int, world: int, config: Config, cases: list[str]) -> dict[tuple[str, str, str], tuple]:
    """One process of --distributed: every case on this rank; its rows as plain tuples."""
    rows: dict[tuple[str, str, str], Row] = {}
    for name in cases:
        run_case(name, CASES[name], config, rows, rank)
    return {key: (row.max_diff, row.max_ref, row.exact) for key, row in rows.items()}


def run_distributed(config: Config, cases: list[str]) -> dict[tuple[str, str, str], Row]:
    """The worst of every rank's rows."""
    rows: dict[tuple[str, str, str], Row] = {}
    for per_rank in run_local_group(run_rank, config.processes, config, cases, timeout_s=60):
        for key, (max_diff, max_ref, exact) in per_rank.items():
            row = rows.setdefault(key, Row())
            row.max_diff, row.max_ref = max(row.max_diff, max_diff), max(row.max_ref, max_ref)
            row.exact = row.exact or exact
    return rows
