"""tools/cuda_resources.py, the resource check of tools/check_cuda.sh, on a synthetic ``-Xptxas -v``
log and kept PTX (no nvcc needed): its occupancy arithmetic (resident warps per SM) and its gate of
24 resident warps per SM on sm_80 and sm_90."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_tool():
    spec = importlib.util.spec_from_file_location("cuda_resources", ROOT / "tools" / "cuda_resources.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


cuda_resources = load_tool()


@pytest.mark.parametrize(
    "arch, registers, threads, smem, blocks",
    [
        ("sm_80", 101, 512, 0, 1),  # 104 x 32 a warp: 4 warps a sub-partition, 16 an SM
        ("sm_90", 101, 512, 0, 1),
        ("sm_80", 76, 256, 0, 3),  # 80 x 32 a warp: 6 warps a sub-partition, 24 an SM
        ("sm_90", 80, 256, 0, 3),
        ("sm_80", 81, 256, 0, 2),  # 88 x 32: 5 a sub-partition, 20 an SM, 2 blocks of 8 warps
        ("sm_80", 64, 256, 16384, 4),  # registers: 32 warps
        ("sm_80", 200, 96, 0, 2),  # 6400 a warp: 2 a sub-partition, 8 an SM: 2 blocks of 3 warps
        ("sm_80", 16, 32, 0, 32),  # the SM's 32 blocks
        ("sm_87", 32, 1024, 0, 1),  # 1,536 threads
        ("sm_75", 32, 512, 0, 2),  # 1,024 threads
        ("sm_80", 32, 128, 40 * 1024, 4),  # 164 KiB over 41 KiB (its 1 KiB reserved)
        ("sm_90", 32, 128, 40 * 1024, 5),  # 228 KiB over 41 KiB
        ("sm_80", 0, 256, 0, 8),  # no registers: the threads limit
    ],
)
def test_resident_blocks_follow_the_occupancy_rules(arch, registers, threads, smem, blocks) -> None:
    warps = -(-threads // 32)
    assert cuda_resources.resident_blocks(cuda_resources.SMS[arch], registers, warps, smem) == blocks
    entry = cuda_resources.Entry("k.cu", arch, "_Z1kv", registers=registers, smem=smem, block=threads)
    assert entry.resident_warps == blocks * warps


def test_an_architecture_without_limits_or_a_kernel_without_a_block_size_has_no_occupancy() -> None:
    assert cuda_resources.Entry("k.cu", "sm_100", "_Z1kv", registers=32, block=256).resident_warps is None
    assert cuda_resources.Entry("k.cu", "sm_80", "_Z1kv", registers=32).resident_warps is None


def kernel_log(name: str, arch: str, registers: int, smem: int = 0, spills: int = 0) -> str:
    return (
        f"ptxas info    : Compiling entry function '{name}' for '{arch}'\n"
        f"ptxas info    : Function properties for {name}\n"
        f"    0 bytes stack frame, {spills} bytes spill stores, {spills} bytes spill loads\n"
        f"ptxas info    : Used {registers} registers, used 1 barriers, {smem} bytes smem, 380 bytes cmem[0]\n"
    )


def kernel_ptx(name: str, threads: int) -> str:
    return f".visible .entry {name}(\n\t.param .u64 {name}_param_0\n)\n.maxntid {threads}, 1, 1\n{{\n\tret;\n}}\n"


# (mangled name, registers, threads a block) on every architecture below
KERNELS = [
    ("_Z5statsPf", 101, 512),  # 16 resident warps on sm_80 and sm_90
    ("_Z4sumsPf", 76, 256),  # 24
    ("_Z4wideRf", 200, 512),  # cannot launch at all
]
ARCHS = ["sm_75", "sm_80", "sm_87", "sm_90", "sm_100"]


def compiled(tmp_path: Path) -> Path:
    """A directory as tools/check_cuda.sh leaves one .cu file's compilation: ptxas.log, a PTX per arch."""
    kernels = tmp_path / "reductions.cu"
    kernels.mkdir()
    log = ""
    for arch in ARCHS:
        log += "".join(kernel_log(name, arch, registers) for name, registers, _ in KERNELS)
        ptx = "".join(kernel_ptx(name, threads) for name, _, threads in KERNELS)
        (kernels / f"reductions.compute_{arch[3:]}.ptx").write_text(f".version 8.0\n.target {arch}\n{ptx}")
    (kernels / "ptxas.log").write_text(log)
    return kernels


def test_the_gate_fails_under_24_resident_warps_on_sm_80_and_sm_90_only(tmp_path, capsys) -> None:
    assert cuda_resources.main([str(compiled(tmp_path))]) == 1
    out, err = capsys.readouterr()
    failed = [line for line in err.splitlines() if "FAILED" in line]
    occupancy = [line for line in failed if "resident warps per SM < 24" in line]
    assert len(occupancy) == 2, err
    for arch in ("sm_80", "sm_90"):
        assert any(f" {arch} " in line and "stats" in line and "16 resident warps" in line for line in occupancy)
    assert not any("sums" in line for line in failed), err
    # the kernel that cannot launch fails for that, once an architecture, not for its occupancy too
    assert len([line for line in failed if "wide" in line]) == len(ARCHS), err
    assert all("its launch fails" in line for line in failed if "wide" in line), err
    # each line leads with the resident warps per SM: "-" where the architecture has no limits here
    lines = {tuple(line.split()[:3]): line for line in out.splitlines() if line.split()[-1:] == ["(reductions.cu)"]}
    assert ("16", "sm_80", "101") in lines and ("16", "sm_90", "101") in lines, out
    assert ("24", "sm_80", "76") in lines and ("24", "sm_90", "76") in lines, out
    assert ("16", "sm_75", "101") in lines and ("24", "sm_75", "76") in lines, out  # shown, not gated
    assert ("0", "sm_90", "200") in lines and ("-", "sm_100", "76") in lines, out
    assert "cuda_resources: sm_80: 3 kernels" in out and "fewest resident warps per SM 0 (wide)" in out


def test_kernels_that_keep_24_resident_warps_pass(tmp_path, capsys) -> None:
    kernels = tmp_path / "elementwise.cu"
    kernels.mkdir()
    (kernels / "ptxas.log").write_text(
        kernel_log("_Z4sumsPf", "sm_80", 80, smem=4096) + kernel_log("_Z4sumsPf", "sm_90", 76, smem=4096)
    )
    for arch in ("sm_80", "sm_90"):
        (kernels / f"elementwise.compute_{arch[3:]}.ptx").write_text(
            f".version 8.0\n.target {arch}\n{kernel_ptx('_Z4sumsPf', 256)}"
        )
    assert cuda_resources.main([str(kernels)]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "fewest resident warps per SM 24" in out
