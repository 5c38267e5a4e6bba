"""The resource check of tools/check_cuda.sh: every CUDA kernel's registers, declared block size,
shared memory, spills and occupancy, for every architecture compiled, read from what nvcc left behind.

Each DIR argument holds one .cu file's compilation: ``ptxas.log``, nvcc's output with
``-Xptxas -v`` (per kernel entry and architecture: registers, static shared memory, spill stores
and loads), and the ``*.ptx`` that ``--keep --keep-dir DIR`` kept (per entry, the block size it
declares with ``__launch_bounds__``: ``.maxntid X, Y, Z``). Prints one line per entry and
architecture, with its resident warps per SM, and fails (exit status 1, one line naming kernel and
architecture per problem) where

- an entry declares no block size (no ``.maxntid``: the kernel has no ``__launch_bounds__``, so
  ptxas may give it more registers than its launch can have);
- its registers, rounded up to the allocation unit (8 a thread), times its declared block size,
  rounded up to whole warps, exceed the 65,536 registers a block may use on every architecture
  we build for (sm_75 to sm_90): its launch fails with "too many resources requested";
- its static shared memory exceeds 48 KiB (the most without an opt-in);
- it spills (spill stores or loads > 0): every kernel here is on a training step's path, and the
  largest ones hold their accumulators in registers, so none may spill;
- it keeps fewer than 24 resident warps per SM on sm_80 or sm_90: every kernel is gated, each
  being a pass over memory whose loads only other resident warps hide (with blocks of 256
  threads: 3 blocks, at most 80 registers a thread).

Resident warps per SM = blocks per SM x warps a block, blocks per SM being the least that each
limit allows (the rules of the toolkit's ``cuda_occupancy.h``, which
``cudaOccupancyMaxActiveBlocksPerMultiprocessor`` follows):

- registers: a warp gets its registers a thread x 32, rounded up to 256; each of an SM's 4
  sub-partitions holds 65,536 / 4 registers, so as many whole warps as fit in 16,384, times 4;
- threads and blocks: the SM's resident threads (in whole blocks) and resident blocks;
- shared memory: the SM's largest carveout over a block's static shared memory plus the 1 KiB
  the driver reserves a block (none on sm_75), rounded up to 128 bytes (256 on sm_75).

The limits per SM (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability"):
65,536 registers on every architecture; resident threads 1,024 (sm_75), 2,048 (sm_80, sm_90),
1,536 (sm_86, sm_87, sm_89); resident blocks 16 (sm_75, sm_86, sm_87), 24 (sm_89), 32 (sm_80,
sm_90); shared memory 64 KiB (sm_75), 100 KiB (sm_86, sm_89), 164 KiB (sm_80, sm_87), 228 KiB
(sm_90). An architecture not in that table gets no occupancy ("-").

    python tools/cuda_resources.py DIR [DIR ...]
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

MAX_BLOCK_REGISTERS = 65536
MAX_STATIC_SMEM = 48 * 1024
MAX_BLOCK_THREADS = 1024
REGISTER_UNIT = 8  # registers are allocated to a thread in multiples of 8 (256 a warp)
SM_REGISTERS = 65536
SUB_PARTITIONS = 4  # an SM's registers are split among 4 schedulers; a warp's stay in one
MIN_RESIDENT_WARPS = 24  # per SM, on the architectures of OCCUPANCY_GATED
OCCUPANCY_GATED = ("sm_80", "sm_90")
NAME_WIDTH = 100
KIB = 1024


@dataclass(frozen=True)
class SM:
    """One architecture's limits per multiprocessor."""

    threads: int  # resident threads
    blocks: int  # resident blocks
    smem: int  # shared memory, its largest carveout (bytes)
    smem_reserved: int  # shared memory the driver takes a block
    smem_unit: int  # a block's shared memory is allocated in multiples of this


SMS = {
    "sm_75": SM(1024, 16, 64 * KIB, 0, 256),
    "sm_80": SM(2048, 32, 164 * KIB, KIB, 128),
    "sm_86": SM(1536, 16, 100 * KIB, KIB, 128),
    "sm_87": SM(1536, 16, 164 * KIB, KIB, 128),
    "sm_89": SM(1536, 24, 100 * KIB, KIB, 128),
    "sm_90": SM(2048, 32, 228 * KIB, KIB, 128),
}

ENTRY = re.compile(r"Compiling entry function '(?P<name>[^']+)' for '(?P<arch>sm_\w+)'")
SPILLS = re.compile(r"(?P<stores>\d+) bytes spill stores, (?P<loads>\d+) bytes spill loads")
USED = re.compile(r"Used (?P<registers>\d+) registers")
SMEM = re.compile(r"(?P<smem>\d+) bytes smem")
PTX_TARGET = re.compile(r"^\s*\.target\s+(sm_\w+)", re.MULTILINE)
PTX_ENTRY = re.compile(r"\.entry\s+(?P<name>[\w$]+)\s*\(.*?\)(?P<directives>[^{]*)\{", re.DOTALL)
MAXNTID = re.compile(r"\.maxntid\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?")


@dataclass
class Entry:
    source: str
    arch: str
    name: str  # mangled
    registers: int = -1
    smem: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    block: int | None = None  # declared threads a block (.maxntid), None: undeclared

    @property
    def block_registers(self) -> int | None:
        if self.block is None:
            return None
        return round_up(self.registers, REGISTER_UNIT) * round_up(self.block, 32)

    @property
    def resident_warps(self) -> int | None:
        """Warps per SM of blocks of the declared size; None where block or architecture is unknown."""
        sm = SMS.get(self.arch)
        if sm is None or self.block is None or self.registers < 0:
            return None
        warps = round_up(self.block, 32) // 32
        return resident_blocks(sm, self.registers, warps, self.smem) * warps


def round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def resident_blocks(sm: SM, registers: int, warps: int, smem: int) -> int:
    """Blocks of `warps` warps, `registers` a thread and `smem` static shared memory bytes an SM holds."""
    limits = [sm.blocks, sm.threads // 32 // warps]
    if registers > 0:
        warp_registers = round_up(registers, REGISTER_UNIT) * 32
        limits.append((SM_REGISTERS // SUB_PARTITIONS // warp_registers) * SUB_PARTITIONS // warps)
    if smem + sm.smem_reserved > 0:
        limits.append(sm.smem // round_up(smem + sm.smem_reserved, sm.smem_unit))
    return min(limits)


def ptxas_entries(source: str, log: str) -> list[Entry]:
    """The kernel entries of one nvcc -Xptxas -v log, with their resources."""
    entries: list[Entry] = []
    for line in log.splitlines():
        found = ENTRY.search(line)
        if found:
            entries.append(Entry(source, found["arch"], found["name"]))
            continue
        if not entries:
            continue
        if spills := SPILLS.search(line):
            entries[-1].spill_stores = int(spills["stores"])
            entries[-1].spill_loads = int(spills["loads"])
        if used := USED.search(line):
            entries[-1].registers = int(used["registers"])
            smem = SMEM.search(line)
            entries[-1].smem = int(smem["smem"]) if smem else 0
    return entries


def declared_blocks(ptx_files: list[Path]) -> dict[tuple[str, str], int | None]:
    """(arch, mangled entry) -> threads a block its .maxntid declares, None where it has none."""
    blocks: dict[tuple[str, str], int | None] = {}
    for path in ptx_files:
        text = path.read_text()
        target = PTX_TARGET.search(text)
        if target is None:
            continue
        for entry in PTX_ENTRY.finditer(text):
            ntid = MAXNTID.search(entry["directives"])
            block = None
            if ntid:
                block = 1
                for size in ntid.groups():
                    block *= int(size or 1)
            blocks[(target.group(1), entry["name"])] = block
    return blocks


def demangler() -> list[str] | None:
    """cu++filt (CUDA toolkit), else c++filt (binutils): both read the names CUDA mangles."""
    for tool in ("cu++filt", "c++filt"):
        if shutil.which(tool):
            return [tool]
    return None


def readable_names(mangled: list[str]) -> dict[str, str]:
    """Demangled names without their namespaces and parameters, shortened if very long."""
    tool = demangler()
    plain = mangled
    if tool and mangled:
        out = subprocess.run(tool, input="\n".join(mangled) + "\n", capture_output=True, text=True, check=False).stdout
        lines = out.splitlines()
        if len(lines) == len(mangled):
            plain = lines
    names = {}
    for name, text in zip(mangled, plain):
        text = re.sub(r"^void |syncbn::cuda::|\(anonymous namespace\)::|c10::", "", text)
        text = re.sub(r"\((?:[^()]|\([^()]*\))*\)$", "", text)  # the parameter list
        names[name] = text if len(text) <= NAME_WIDTH else text[: NAME_WIDTH - 3] + "..."
    return names


def problems(entry: Entry, name: str) -> list[str]:
    where = f"{entry.arch} {name} ({entry.source})"
    if entry.registers < 0:
        return [f"{where}: no register count in the ptxas log"]
    found = []
    if entry.spill_stores or entry.spill_loads:
        found.append(f"{where}: spills ({entry.spill_stores} bytes stored, {entry.spill_loads} loaded)")
    if entry.smem > MAX_STATIC_SMEM:
        found.append(f"{where}: {entry.smem} bytes of static shared memory > {MAX_STATIC_SMEM}")
    if entry.block is None:
        return [f"{where}: declares no block size (no __launch_bounds__, no .maxntid in its PTX)", *found]
    if entry.block > MAX_BLOCK_THREADS:
        found.append(f"{where}: declares {entry.block} threads a block, more than {MAX_BLOCK_THREADS}")
    if entry.block_registers > MAX_BLOCK_REGISTERS:
        found.append(
            f"{where}: {entry.registers} registers x {entry.block} threads = {entry.block_registers} "
            f"(allocated) > {MAX_BLOCK_REGISTERS}: its launch fails"
        )
    elif entry.arch in OCCUPANCY_GATED and entry.resident_warps < MIN_RESIDENT_WARPS:
        found.append(
            f"{where}: {entry.resident_warps} resident warps per SM < {MIN_RESIDENT_WARPS} "
            f"({entry.registers} registers x {entry.block} threads, {entry.smem} bytes of shared memory)"
        )
    return found


def shown(value: int | None) -> str:
    return "-" if value is None else str(value)


def summary(arch: str, mine: list[Entry], names: dict[str, str]) -> str:
    """One architecture's line: its kernels, the most registers a block, the fewest resident warps, spills."""
    line = f"cuda_resources: {arch}: {len(mine)} kernels"
    declared = [e for e in mine if e.block is not None]
    if declared:
        worst = max(declared, key=lambda e: e.block_registers)
        line += f", most registers a block {worst.block_registers} of {MAX_BLOCK_REGISTERS} ({names[worst.name]})"
    known = [e for e in declared if e.resident_warps is not None]
    if known:
        fewest = min(known, key=lambda e: e.resident_warps)
        line += f", fewest resident warps per SM {fewest.resident_warps} ({names[fewest.name]})"
    return line + f", spills {sum(e.spill_stores + e.spill_loads for e in mine)} bytes"


def main(directories: list[str]) -> int:
    entries: list[Entry] = []
    for directory in map(Path, directories):
        source = directory.name
        found = ptxas_entries(source, (directory / "ptxas.log").read_text())
        blocks = declared_blocks(sorted(directory.glob("*.ptx")))
        if found and not blocks:
            print(f"cuda_resources: FAILED {source}: no PTX kept in {directory} (--keep-dir)", file=sys.stderr)
            return 1
        for entry in found:
            entry.block = blocks.get((entry.arch, entry.name))
        entries += found
    if not entries:
        print("cuda_resources: no kernel entries in the ptxas logs (was -Xptxas -v given?)", file=sys.stderr)
        return 1
    names = readable_names(sorted({e.name for e in entries}))
    entries.sort(key=lambda e: (e.source, e.arch, names[e.name]))
    # resident warps lead the line: the columns after keep their order (tests/test_build.py reads them)
    print(
        f"{'warps':>5} {'arch':6} {'regs':>4} {'block':>5} {'regs*block':>10} {'smem':>6} {'spill st/ld':>11}  "
        "kernel (source)"
    )
    failures = []
    for e in entries:
        name = names[e.name]
        spills = f"{e.spill_stores}/{e.spill_loads}"
        print(
            f"{shown(e.resident_warps):>5} {e.arch:6} {e.registers:>4} {shown(e.block):>5} "
            f"{shown(e.block_registers):>10} {e.smem:>6} {spills:>11}  {name} ({e.source})"
        )
        failures += problems(e, name)
    for arch in sorted({e.arch for e in entries}):
        print(summary(arch, [e for e in entries if e.arch == arch], names))
    for failure in failures:
        print(f"cuda_resources: FAILED {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 else 2)
    sys.exit(main(sys.argv[1:]))
