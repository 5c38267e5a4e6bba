"""Side-by-side check of synchronized batch norm against ``nn.BatchNorm*`` on the full batch.

For every case, two identical small networks are built from the same seed:

* the reference keeps torch's ``nn.BatchNorm1d/2d/3d`` and sees the FULL batch on one device;
* the other is a deep copy converted with ``modules.nn.convert_sync_batchnorm`` and runs as
  replicas, each on a chunk of the batch: under stock ``nn.DataParallel`` over the GPUs when
  ``--device cuda`` and there are 2 or more of them, else under
  ``modules.parallel.ThreadedDataParallel(model, [device] * replicas)``. The default batch of 10
  on 4 replicas gives the uneven chunks 3, 3, 3, 1 (a chunk of one sample: per-replica
  statistics of a 1d layer could not even be taken). With ``--distributed N`` it runs instead
  under ``DistributedDataParallel`` in N local processes (Gloo on loopback, CPU), rank r on
  chunk r (ranks beyond the chunks get an empty batch); every rank runs the reference on the
  full batch and compares its own rows of the outputs and input gradients, its parameter
  gradients times N (DDP averages them; ours train with lr * N to stay in step) and its
  buffers. The table shows the worst difference over all ranks.

Both are trained for a few SGD steps on the same inputs (offset from zero, so that the mean is
not small against the spread) with the same random upstream gradient. After each step the
script compares the outputs, the input gradients and, per layer, the gradient of every
parameter (conv/linear weight, batch norm weight and bias) and every buffer
(running_mean, running_var, num_batches_tracked). Synchronized statistics make the two agree up
to rounding; per-replica statistics change the outputs, every gradient and the running stats.

The cases (``--cases``):

* ``1d``: Linear, BatchNorm1d on (N, C), ReLU, Unflatten, Conv1d, BatchNorm1d on (N, C, L);
* ``2d``: Conv2d, BatchNorm2d, ReLU, Conv2d, BatchNorm2d;
* ``3d``: Conv3d, BatchNorm3d, ReLU, Conv3d, BatchNorm3d;
* ``inplace``: Conv2d, BatchNorm2d, LeakyReLU(0.1), Conv2d, BatchNorm2d, ELU(0.7), made in-place
  activated batch norms (``InPlaceABN``) by ``modules.nn.convert_inplace_abn``;
* ``checkpoint``: the ``2d`` network, its first conv, batch norm and ReLU under
  ``torch.utils.checkpoint`` (non-reentrant) in ours only: their forward runs again in backward,
  and the running statistics and num_batches_tracked must still be those of one forward;
* ``masked``: the ``2d`` network over padded images, every batch norm called with ``mask=`` (the
  statistics of the valid positions; the last sample all padding, so the last replica or rank
  holds none): the reference is ``nn.BatchNorm2d`` taking those statistics in torch ops on the
  full batch.

In each case the first batch norm uses momentum 0.1 and the last one momentum None (the
cumulative average, which depends on num_batches_tracked); batch norm weights and biases start
random, not at 1 and 0, so that they matter in every gradient. The conv/linear layers have
no bias, as usual before a batch norm: its gradient is zero up to rounding noise.

The output is a table with one row per (case, layer, quantity): the largest absolute difference
over all steps, the tolerance (atol + rtol * the largest absolute reference value over all
steps; integer buffers must match exactly) and OK/FAIL. The exit status is 1 when any row
fails, 0 otherwise.

Options:
  --replicas N      replicas (default: 4 threads; all GPUs, or at most N, under nn.DataParallel)
  --device cpu|cuda default: cuda when 2+ GPUs are visible, else cpu
  --steps S         SGD steps per case (default 5)
  --batch B         full batch size (default 10)
  --dtype D         float64 (default) | float32 | bfloat16 | float16; the half dtypes run the
                    float32 models under torch.autocast, so the batch norm layers see half
                    inputs with float32 weights and running stats, as in mixed precision training
  --channels-last   2d and 3d models and inputs in channels_last / channels_last_3d
  --cases C [C ...] subset of 1d 2d 3d inplace checkpoint masked (default: all)
  --seed N          seed of the models, inputs and upstream gradients (default 0)
  --lr LR           SGD learning rate (default 0.01)
  --distributed N   N local processes under DDP (Gloo, CPU) instead of replicas in threads

Usage: ``python test.py [options]`` from the repository root.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from testkit.side_by_side import CASES, DTYPES, TOLERANCES, Config, Row, describe, print_table, run_case, run_distributed


def parse_args(argv: list[str] | None = None) -> tuple[Config, list[str]]:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=None, help="replicas; None: 4 threads, or all GPUs")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if gpus >= 2 else "cpu")
    parser.add_argument("--steps", type=int, default=5, help="SGD steps per case")
    parser.add_argument("--batch", type=int, default=10, help="full batch size")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float64", help="half dtypes: autocast")
    parser.add_argument("--channels-last", action="store_true", help="2d/3d models and inputs channels-last")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--seed", type=int, default=0, help="seed of models, inputs and upstream gradients")
    parser.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    parser.add_argument("--distributed", type=int, default=None, help="N local Gloo processes under DDP")
    args = parser.parse_args(argv)
    if args.distributed is not None and (args.device == "cuda" or args.replicas is not None):
        parser.error("--distributed runs one replica per process, on the CPU")
    for name, least in (("replicas", 1), ("steps", 1), ("batch", 2), ("distributed", 1)):
        if getattr(args, name) is not None and getattr(args, name) < least:
            parser.error(f"--{name} must be at least {least}")
    if args.device == "cuda" and gpus == 0:
        parser.error("--device cuda: no GPU is visible")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    config = Config(
        device,
        DTYPES[args.dtype],
        args.replicas,
        args.steps,
        args.batch,
        args.channels_last,
        args.seed,
        args.lr,
        args.distributed or 1,
    )
    return config, args.cases


def main(argv: list[str] | None = None) -> int:
    config, cases = parse_args(argv)
    if config.device.type == "cuda":
        # TF32 convolutions and matmuls would differ by ~1e-3 between batch sizes; this compares
        # batch norm, not TF32.
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    started = time.perf_counter()
    print(describe(config))
    rows: dict[tuple[str, str, str], Row] = {}
    if config.processes > 1:
        rows = run_distributed(config, cases)
    for name in cases if config.processes == 1 else []:
        run_case(name, CASES[name], config, rows)
    failures = print_table(rows, TOLERANCES[config.dtype])
    elapsed = time.perf_counter() - started
    if failures:
        print(f"FAIL: {failures} of {len(rows)} rows exceed their tolerance ({elapsed:.1f} s)")
    else:
        print(f"OK: all {len(rows)} rows within their tolerance ({elapsed:.1f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
