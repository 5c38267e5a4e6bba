"""Pictures of the main benchmark figures, drawn from the tables in ``benchmarks/RESULTS.md``.

Each benchmark script writes its section of RESULTS.md between markers such as
``<!-- bench_memory: begin -->`` and ``<!-- bench_memory: end -->`` (older sections spell them
``<!-- bench_cpu:begin -->``; ``bench_sync_overhead`` keeps one section per CPU capability,
``<!-- bench_sync_overhead:avx2:begin -->``, and the first one is drawn). This script reads the
tables of these sections and writes one PNG per figure into ``docs/img/`` (shown by
``docs/performance.md``):

- ``sync_overhead.png``: what synchronizing adds per layer, thread replicas, one native call per
  layer against the autograd Function (``bench_sync_overhead``);
- ``memory.png``: a training step's peak memory over resting, in-place activated batch norm
  against torch's batch norm + LeakyReLU (``bench_memory``);
- ``compile_ranks.png``: a step under DDP over 2 Gloo ranks, eager against compiled
  (``bench_compile_ranks``);
- ``cpu_layers.png``: forward + backward against ``nn.BatchNorm*``, ours on one replica and under
  ``ThreadedDataParallel`` (``bench_cpu``).

A section that is missing is skipped with a line; the machine line of each section is kept in the
picture's caption. Needs matplotlib (``pip install matplotlib``); without it the script says so
and exits 0, as nothing else depends on the pictures.

    python benchmarks/plots.py [--results benchmarks/RESULTS.md] [--out docs/img]
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!--\s*([\w:.-]+?)\s*:\s*(begin|end)\s*-->")


def sections(text: str) -> dict[str, str]:
    """The text between each ``<!-- name: begin -->`` and its ``<!-- name: end -->``."""
    found: dict[str, str] = {}
    opened: dict[str, int] = {}
    for match in MARKER.finditer(text):
        name, edge = match.group(1), match.group(2)
        if edge == "begin":
            opened[name] = match.end()
        elif name in opened:
            found[name] = text[opened.pop(name):match.start()]
    return found


def first_section(found: dict[str, str], name: str) -> str | None:
    """The section ``name``, or the first of its keyed ones (``bench_sync_overhead:avx2``: one per
    CPU capability), or None."""
    return next((text for key, text in found.items() if key == name or key.startswith(name + ":")), None)


def tables(section: str) -> list[list[dict[str, str]]]:
    """Every markdown table of a section, as rows of {header: cell}."""
    result: list[list[dict[str, str]]] = []
    lines = section.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-| :]+\|$", lines[i + 1]):
            header = [cell.strip() for cell in lines[i].strip("|").split("|")]
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = [cell.strip() for cell in lines[i].strip("|").split("|")]
                rows.append(dict(zip(header, cells)))
                i += 1
            result.append(rows)
        else:
            i += 1
    return result


def machine(section: str) -> str:
    """The section's machine line, shortened to its first sentence."""
    for line in section.splitlines():
        if line.startswith("Machine:"):
            first = line[len("Machine:"):].strip().split(". ")[0].rstrip(".")
            return "; ".join(part for part in first.split("; ") if not part.startswith("backends"))
    return ""


def number(cell: str) -> float:
    """The first number of a cell: ``'2159, of which ...'`` -> 2159.0, ``'3.48 (0.42x)'`` -> 3.48."""
    match = re.search(r"-?\d+(?:\.\d+)?", cell)
    if match is None:
        raise ValueError(f"no number in {cell!r}")
    return float(match.group())


def ratio(cell: str) -> float:
    """The ratio in a cell: ``'7.71 (0.58x)'`` -> 0.58, ``'0.85x'`` -> 0.85."""
    match = re.search(r"(-?\d+(?:\.\d+)?)x", cell)
    if match is None:
        raise ValueError(f"no ratio in {cell!r}")
    return float(match.group(1))


def caption(fig, text: str) -> None:
    fig.text(0.01, 0.01, text, fontsize=7, color="0.35", ha="left", va="bottom")


def plot_sync_overhead(plt, section: str, out: Path) -> Path:
    rows = tables(section)[0]
    replicas = [2, 4, 8]
    series = {"native call (default)": [], "autograd Function": []}
    # the rows' names before and since the Function path met natively too
    names = {"native call (default)": ("native call", "native meeting"), "autograd Function": ("autograd Function", "Python exchange")}
    for r in replicas:
        for label, keys in names.items():
            paths = [f"ThreadedDataParallel, {r} CPU replicas, {key}" for key in keys]
            row = next(row for row in rows if row["path"] in paths)
            series[label].append(number(row["synchronizing adds"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for k, (label, values) in enumerate(series.items()):
        xs = [i + (k - 0.5) * width for i in range(len(replicas))]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.axhline(0, color="0.5", linewidth=0.8)
    ax.set_xticks(range(len(replicas)), [f"{r} replicas" for r in replicas])
    ax.set_ylabel("microseconds per layer, forward + backward")
    ax.set_title("What synchronizing adds per layer (ThreadedDataParallel, CPU)\nover torch's unsynced nn.BatchNorm2d in the same wrapper")
    ax.legend()
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    caption(fig, f"bench_sync_overhead.py; {machine(section)}")
    path = out / "sync_overhead.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_memory(plt, section: str, out: Path) -> Path:
    rows = tables(section)[0]
    layouts = ["contiguous", "channels_last"]
    contenders = ["torch", "ours-fused", "ours-inplace"]
    labels = {
        "torch": "torch: BatchNorm2d + LeakyReLU(inplace)",
        "ours-fused": "ours: SyncBatchNorm2d(activation=...)",
        "ours-inplace": "ours: InPlaceABN",
    }
    budget = {}
    for match in re.finditer(r"^- (\S+), (\S+): (\d+)$", section, re.M):
        budget[(match.group(1), match.group(2))] = int(match.group(3))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.27
    for k, contender in enumerate(contenders):
        values = [
            number(next(r for r in rows if r["layout"] == layout and r["contender"] == contender)["step peak over resting (MiB)"])
            for layout in layouts
        ]
        xs = [i + (k - 1) * width for i in range(len(layouts))]
        bars = ax.bar(xs, values, width, label=labels[contender])
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ticks = []
    for layout in layouts:
        fits = [f"{c.split('-')[-1]} {budget[(layout, c)]}" for c in ("torch", "ours-inplace") if (layout, c) in budget]
        ticks.append(layout + ("\n1 GiB fits a batch of: " + ", ".join(fits) if fits else ""))
    ax.set_xticks(range(len(layouts)), ticks, fontsize=8)
    ax.set_ylabel("step peak over resting memory, MiB")
    ax.set_title("Memory of a training step: 8 conv + BN + LeakyReLU blocks, batch 16")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.35)
    ax.legend(fontsize=8, loc="upper center", ncols=2)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    caption(fig, f"bench_memory.py; {machine(section)}")
    path = out / "memory.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_compile_ranks(plt, section: str, out: Path) -> Path:
    rows = tables(section)[0]
    models = [row["model"] for row in rows]
    eager = [number(row["eager"]) for row in rows]
    compiled = [number(row["compiled (fullgraph, Inductor)"]) for row in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for k, (label, values) in enumerate((("eager", eager), ("torch.compile(fullgraph=True)", compiled))):
        xs = [i + (k - 0.5) * width for i in range(len(models))]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(len(models)), [f"{m}\ncompiled / eager {row['compiled / eager']}" for m, row in zip(models, rows)], fontsize=8)
    ax.set_ylabel("ms per training step (slowest rank's median)")
    ax.set_title("Small ResNet (17 batch norms) under DDP over 2 Gloo ranks")
    ax.legend()
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    caption(fig, f"bench_compile_ranks.py; {machine(section)}")
    path = out / "compile_ranks.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_cpu_layers(plt, section: str, out: Path) -> Path:
    rows = tables(section)[0]
    rows = [row for row in rows if "float32" in row["case"]]
    columns = [("ours x1 fwd+bwd", "ours, one replica"), ("threads x2 fwd+bwd", "ThreadedDataParallel x2"),
               ("threads x4 fwd+bwd", "ThreadedDataParallel x4")]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.27
    for k, (column, label) in enumerate(columns):
        values = [ratio(row[column]) for row in rows]
        xs = [i + (k - 1) * width for i in range(len(rows))]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="0.3", linewidth=0.9, linestyle="--", label="nn.BatchNorm* (1.0)")
    ax.set_xticks(range(len(rows)), [row["case"].replace(" float32", "").replace(") ", ")\n") for row in rows], fontsize=7)
    ax.set_ylabel("forward + backward time / nn.BatchNorm*")
    ax.set_title("CPU, float32, forward + backward against nn.BatchNorm* on the full batch")
    ax.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    caption(fig, f"bench_cpu.py; {machine(section)}")
    path = out / "cpu_layers.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


PLOTS = {
    "bench_sync_overhead": plot_sync_overhead,
    "bench_memory": plot_memory,
    "bench_compile_ranks": plot_compile_ranks,
    "bench_cpu": plot_cpu_layers,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "RESULTS.md",
                        help="the results file to read (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img",
                        help="where the PNGs go (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        print("plots.py: matplotlib is not installed, so no pictures were drawn "
              "(pip install matplotlib, then run this again).")
        return 0
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = sections(args.results.read_text(encoding="utf-8"))
    args.out.mkdir(parents=True, exist_ok=True)
    for name, plot in PLOTS.items():
        section = first_section(found, name)
        if section is None:
            print(f"plots.py: no section {name} in {args.results}; skipped")
            continue
        path = plot(plt, section, args.out)
        print(f"plots.py: wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
