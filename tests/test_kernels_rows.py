"""The kernels that merge the parts of replicas and ranks, and the rows that ranks exchange, on every
device against the pure-PyTorch reference: merge_stats, merge_gathered_stats over valid, failed,
disagreeing and malformed rows (and its bits against merge_stats with update_running_stats),
pack_row and unpack_row, and what they refuse."""
from __future__ import annotations

import pytest
import torch

from syncbn.functions.operators import reference as ref
from testkit.kernel_cases import DEVICES, OPS, needs_compiled


@pytest.mark.parametrize("device", DEVICES)
def test_merge_stats_matches_reference(device) -> None:
    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([3.0, 0.0, 7.0, 1.0], dtype=torch.float64)
    means = torch.randn(4, 6, generator=generator, dtype=torch.float64) * 100
    m2s = torch.rand(4, 6, generator=generator, dtype=torch.float64) * counts.unsqueeze(1)
    means[1], m2s[1] = 0, 0  # an empty part carries zeros
    got = OPS.merge_stats(counts.to(device), means.to(device), m2s.to(device))
    for a, b in zip(got, ref.merge_stats(counts, means, m2s)):
        assert a.device.type == device
        torch.testing.assert_close(a.cpu(), b, atol=1e-10, rtol=1e-13)


def gathered_rows(counts: list[float], channels: int, heads: list[list[float]] | None = None) -> torch.Tensor:
    """Rows as an all_gather over ranks brings them: header [layer, call, failed, count], mean
    and M2 per rank (an empty rank carries zeros)."""
    generator = torch.Generator().manual_seed(len(counts) * 100 + channels)
    n = torch.tensor(counts, dtype=torch.float64).unsqueeze(1)
    means = torch.randn(len(counts), channels, generator=generator, dtype=torch.float64) * 100 * (n > 0)
    m2s = torch.rand(len(counts), channels, generator=generator, dtype=torch.float64) * n
    head = torch.tensor(heads if heads is not None else [[7.0, 2.0, 0.0]] * len(counts), dtype=torch.float64)
    return torch.cat([head, n, means, m2s], dim=1)


GATHERED_CASES = {  # rows, and whether they are valid (agreeing: the first 2 columns, flag: column 2)
    "valid": (gathered_rows([3.0, 0.0, 7.0, 1.0], 6), True),
    "all empty": (gathered_rows([0.0, 0.0], 5), True),
    "one value in all": (gathered_rows([0.0, 1.0, 0.0], 4), False),
    "ranks at other calls": (gathered_rows([2.0, 2.0], 3, [[7.0, 2.0, 0.0], [7.0, 3.0, 0.0]]), False),
    "a rank failed": (gathered_rows([2.0, 0.0, 2.0], 3, [[7.0, 2.0, 0.0], [7.0, 2.0, 1.0], [7.0, 2.0, 0.0]]), False),
    "no channels": (gathered_rows([2.0, 3.0], 0), True),
    # malformed counts (no rank sends these): not valid, so nothing updates (mean and variance
    # are not specified)
    "a fractional total": (gathered_rows([2.5, 1.0], 3), False),
    "a negative total": (gathered_rows([-3.0, 0.0], 3), False),
    "a NaN count": (gathered_rows([float("nan"), 2.0], 3), False),
}


MALFORMED = {"a fractional total", "a negative total", "a NaN count"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(GATHERED_CASES))
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("running_dtype", [torch.float64, torch.float32, torch.float16], ids=str)
def test_merge_gathered_stats_matches_reference(device, case, momentum, running_dtype) -> None:
    rows, valid = GATHERED_CASES[case]
    channels = (rows.size(1) - 4) // 2
    ours = [torch.linspace(-1, 1, channels, dtype=running_dtype), torch.linspace(1, 2, channels, dtype=running_dtype), torch.tensor(4)]
    theirs = [t.clone() for t in ours]
    ours = [t.to(device) for t in ours]
    got = OPS.merge_gathered_stats(rows.to(device), 4, 2, 2, *ours, momentum)
    expected = ref.merge_gathered_stats(rows, 4, 2, 2, *theirs, momentum)
    assert [t.device.type for t in got] == [device] * 4
    assert bool(got[3]) == bool(expected[3]) == valid
    torch.testing.assert_close(got[0].cpu(), expected[0], equal_nan=True)
    if valid or case not in MALFORMED:
        for a, b in zip(got[1:3], expected[1:3]):
            torch.testing.assert_close(a.cpu(), b, atol=1e-10, rtol=1e-13)
    tolerance = {"atol": 1e-3, "rtol": 1e-3} if running_dtype == torch.float16 else {"atol": 1e-6, "rtol": 1e-6}
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.cpu(), b, **tolerance)
    assert ours[2].item() == theirs[2].item() == 4 + valid


@needs_compiled
@pytest.mark.parametrize("momentum", [0.1, None])
def test_merge_gathered_stats_has_the_bits_of_merge_stats_and_update_running_stats(momentum) -> None:
    """On the CPU, checks read at once (merge_stats, then update_running_stats with the host
    count) and deferred (merge_gathered_stats) give every rank the same bits."""
    rows = gathered_rows([3.0, 0.0, 7.0, 5.0], 9)
    heads, means, m2s = rows.split([4, 9, 9], dim=1)
    ours = [torch.rand(9, dtype=torch.float32), torch.rand(9, dtype=torch.float32) + 1, torch.tensor(2)]
    theirs = [t.clone() for t in ours]
    total, mean, var, _ = OPS.merge_gathered_stats(rows, 4, 2, 2, *ours, momentum)
    expected_mean, expected_var = OPS.merge_stats(heads[:, 3], means, m2s)
    OPS.update_running_stats(*theirs, momentum, expected_mean, expected_var, 15)
    assert total.item() == 15
    for a, b in zip([mean, var, *ours], [expected_mean, expected_var, *theirs]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", [(torch.float64, torch.float64), (torch.float32, torch.float16), (torch.bfloat16, torch.float32)], ids=str)
@pytest.mark.parametrize("head", [[7.0, 2.0**52 + 1, -0.5, 3], []], ids=["head", "no head"])
def test_pack_row_matches_reference(device, dtypes, head) -> None:
    a = torch.randn(5, dtype=torch.float64).to(dtypes[0])
    b = torch.randn(9, dtype=torch.float64)[::3].to(dtypes[1])  # not contiguous
    got = OPS.pack_row(head, a.to(device), b.to(device))
    expected = ref.pack_row(head, a, b)
    assert got.device.type == device and got.dtype == torch.float64 and got.shape == (len(head) + 5 + 3,)
    assert torch.equal(got.cpu(), expected)
    assert expected[: len(head)].tolist() == [float(v) for v in head]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16], ids=str)
def test_unpack_row_is_pack_rows_inverse(device, dtype) -> None:
    a, b = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    row = ref.pack_row([3.0, 9.0], a, b).to(device)
    got = OPS.unpack_row(row, 2, dtype)
    expected = ref.unpack_row(row.cpu(), 2, dtype)
    for g, e, original in zip(got, expected, (a, b)):
        assert g.device.type == device and g.dtype == dtype and torch.equal(g.cpu(), e)
        assert torch.equal(e, original.to(dtype))
    got[0].fill_(0)  # new tensors, not views of the row
    assert torch.equal(row[2:8].cpu(), a)


@pytest.mark.parametrize("unpack_row", [OPS.unpack_row, ref.unpack_row], ids=["dispatched", "reference"])
def test_unpack_row_refuses_what_is_no_row(unpack_row) -> None:
    with pytest.raises(RuntimeError, match="expected a 1-D float64 row"):
        unpack_row(torch.zeros(6), 2, torch.float32)
    with pytest.raises(RuntimeError, match="two halves of equal size"):
        unpack_row(torch.zeros(7, dtype=torch.float64), 2, torch.float32)
    with pytest.raises(RuntimeError, match="expected a floating dtype"):
        unpack_row(torch.zeros(6, dtype=torch.float64), 2, torch.int32)


@pytest.mark.parametrize("pack_row", [OPS.pack_row, ref.pack_row], ids=["dispatched", "reference"])
def test_pack_row_refuses_what_is_no_row(pack_row) -> None:
    with pytest.raises(RuntimeError, match="expected 1-D a and b"):
        pack_row([1.0], torch.zeros(2, 2), torch.zeros(2))
    with pytest.raises(RuntimeError, match="expected floating a and b"):
        pack_row([1.0], torch.zeros(2), torch.zeros(2, dtype=torch.int64))
    # the dispatcher sends a meta tensor to the fake implementation: only a GPU mixes two real devices
    other = "cuda" if torch.cuda.is_available() else "meta" if pack_row is ref.pack_row else None
    if other is not None:
        with pytest.raises(RuntimeError, match="expected a and b on one device"):
            pack_row([1.0], torch.zeros(2), torch.zeros(2, device=other))
