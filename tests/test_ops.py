"""The torch.ops.syncbn operators: ``torch.library.opcheck`` (schema, fake implementation, AOT
dispatch with static and dynamic shapes) over every operator, on float64, float32, bfloat16 and
float16; NCHW, channels_last 2d and 3d, (N, C); an empty batch; C = 1; on the CPU (whatever serves
it: the compiled kernels, or the reference under pytest --kernels reference) and on CUDA where a GPU
is visible. Plus the GIL: the kernels run without it."""
from __future__ import annotations


import pytest
import torch

from syncbn.functions.operators import backend
from syncbn.functions.operators import reference as ref
from syncbn.functions.operators.ops import SCHEMAS
from helpers import another_thread_runs_during

OPS = torch.ops.syncbn
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
DTYPES = [torch.float64, torch.float32, *(pytest.param(dtype, marks=pytest.mark.exhaustive) for dtype in (torch.bfloat16, torch.float16))]
LAYOUTS = [
    ((4, 3, 5, 5), torch.contiguous_format),
    ((4, 3, 5, 5), torch.channels_last),
    ((2, 3, 2, 3, 4), torch.channels_last_3d),
    ((6, 5), torch.contiguous_format),
    ((0, 3, 2, 2), torch.contiguous_format),  # an empty batch
    ((5, 1, 7), torch.contiguous_format),  # C = 1
]


def operator_calls(x: torch.Tensor) -> list[tuple[str, tuple]]:
    """One or more calls of every operator on inputs shaped as ``x``."""
    generator = torch.Generator().manual_seed(0)
    C, dtype, device = x.size(1), x.dtype, x.device
    acc = ref.accumulation_dtype(dtype)

    def channel(low: float = 0.0, dtype: torch.dtype = acc) -> torch.Tensor:
        return (torch.rand(C, generator=generator, dtype=torch.float64) + low).to(dtype=dtype, device=device)

    def like_x() -> torch.Tensor:
        return torch.randn(x.shape, generator=generator).to(dtype=dtype, device=device)

    mean, invstd, weight, bias = channel(), channel(0.5), channel(0.5), channel()
    running = acc if dtype == torch.float64 else torch.float32
    stats = lambda: (channel(dtype=running), channel(1.0, running), torch.tensor(3, device=device))  # noqa: E731
    count = max(1, x.numel() // C)
    # an all_gather's rows (header [layer, call, failed, count]), the third rank failed
    heads = torch.tensor([[7.0, 2.0, 0.0, 3.0], [7.0, 2.0, 0.0, 0.0], [7.0, 2.0, 1.0, 4.0]], dtype=torch.float64)
    parts = torch.rand(3, 2 * C, generator=generator, dtype=torch.float64) * heads[:, 3:]
    rows = torch.cat([heads, parts], dim=1).to(device)
    mask = (torch.rand(x.size(0), *x.shape[2:], generator=generator) > 0.3).to(device)  # True: a valid position
    return [
        ("local_stats", (x,)),
        ("merge_stats", (torch.tensor([3.0, 0.0, 4.0], device=device), torch.randn(3, C, dtype=torch.float64, device=device), channel().expand(3, C).contiguous().double())),
        ("elemt_forward", (x, mean, invstd, weight, bias)),
        ("elemt_forward", (x, mean, invstd, None, None, like_x(), 0.1)),
        ("backward_reduce", (like_x(), x, mean)),
        ("backward_elemt", (like_x(), x, mean, invstd, weight, channel(), channel(), count)),
        ("backward_affine_act", (like_x(), x, mean, invstd, weight, bias, like_x(), 0.0, True, True, True)),
        ("backward_affine_act", (like_x(), x, mean, invstd, None, bias, None, None, False, False, True)),
        ("update_running_stats", (*stats(), 0.1, channel(dtype=torch.float64), channel(1.0, torch.float64), 7)),
        ("update_running_stats", (*stats(), None, channel(dtype=torch.float64), channel(1.0, torch.float64), 7)),
        ("merge_gathered_stats", (rows, 4, 2, None, *stats(), 0.1)),
        ("merge_gathered_stats", (rows, 4, 2, 2, *stats(), None)),  # not valid: nothing updates
        ("merge_gathered_stats", (rows, 4, 2, None, None, None, None, None)),
        ("pack_row", ([7.0, 2.0, 0.0, float(count)], mean, invstd)),
        ("pack_row", ([], channel(dtype=torch.float64), channel(dtype=dtype))),
        ("unpack_row", (torch.arange(4.0 + 2 * C, dtype=torch.float64, device=device), 4, acc)),
        ("unpack_row", (torch.arange(2.0 * C, dtype=torch.float64, device=device), 0, dtype)),
        ("batch_norm_train", (x, weight, bias, *stats(), 0.1, 1e-5)),
        ("batch_norm_train", (x, None, None, None, None, None, None, 1e-5, like_x(), 0.0)),
        ("masked_local_stats", (x, mask)),
        ("masked_backward_elemt", (like_x(), x, mean, invstd, weight, channel(), channel(), mask)),
        ("masked_backward_elemt", (like_x(), x, mean, invstd, None, channel(), channel(), mask)),
        ("abn_forward_", (like_x(), mean, invstd, -weight, bias, 1e-5, "leaky_relu", 0.01)),
        ("abn_forward_", (like_x(), mean, invstd, None, None, 1e-5, "elu", 1.0)),
        ("abn_backward_reduce", (like_x().clamp(min=-0.45), like_x(), weight, bias, 1e-5, "elu", 0.5)),  # y > -alpha
        ("abn_backward_elemt", (like_x(), like_x(), invstd, weight, bias, 1e-5, "leaky_relu", 0.1, channel(), channel(), count)),
        ("abn_backward_elemt", (like_x(), like_x(), invstd, None, None, 1e-5, "identity", 0.0, None, None, 0)),
        ("abn_backward_elemt_", (like_x(), like_x(), invstd, weight, bias, 1e-5, "leaky_relu", 0.1, channel(), channel(), count)),
        ("abn_backward_elemt_", (like_x(), like_x().clamp(min=-0.9), invstd, None, None, 1e-5, "elu", 1.0, None, None, 0)),
    ]


def test_every_operator_is_declared_and_checked() -> None:
    checked = {name for name, _ in operator_calls(torch.zeros(2, 3))}
    assert checked == set(SCHEMAS)
    for name in SCHEMAS:
        assert hasattr(OPS, name), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,memory_format", LAYOUTS, ids=lambda v: str(v).replace("torch.", ""))
def test_opcheck(shape, memory_format, dtype, device) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype=dtype, device=device)
    x = x.contiguous(memory_format=memory_format)
    for name, args in operator_calls(x):
        try:
            torch.library.opcheck(getattr(OPS, name).default, args)
        except Exception as error:  # name the failing call
            raise AssertionError(f"opcheck of syncbn::{name} on {tuple(shape)} {dtype}: {error}") from error


def test_batch_norm_train_is_the_three_operators() -> None:
    x = torch.randn(6, 4, 3, 3, dtype=torch.float64) * 3 + 2
    weight, bias = torch.rand(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    ours = [torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64), torch.tensor(0)]
    theirs = [t.clone() for t in ours]
    y, mean, invstd = OPS.batch_norm_train(x, weight, bias, *ours, None, 1e-5)
    expected = torch.nn.functional.batch_norm(x, theirs[0], theirs[1], weight, bias, True, 1.0, 1e-5)  # momentum None, 1st step
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-12, atol=1e-12)
    assert ours[2].item() == 1
    torch.testing.assert_close(mean, x.mean((0, 2, 3)))
    torch.testing.assert_close(invstd, torch.rsqrt(x.var((0, 2, 3), correction=0) + 1e-5))


@pytest.mark.skipif(not backend.serves_single_device(torch.device("cpu")), reason="the compiled CPU kernels are not loaded")
def test_kernels_release_the_gil() -> None:
    x = torch.randn(128, 64, 56, 56)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert another_thread_runs_during(lambda: OPS.local_stats(x))
        ones = torch.ones(64)
        assert another_thread_runs_during(lambda: OPS.elemt_forward(x, ones - 1, ones, None, None, None, None))
    finally:
        torch.set_num_threads(threads)
    assert not another_thread_runs_during(lambda: sum(range(3_000_000)))  # a C call that holds the GIL


