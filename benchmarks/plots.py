"""Pictures of the main benchmark figures, drawn from the benchmarks' result files
(``benchmarks/results/<name>.json``, see ``benchmarks/results.py``), one PNG each, into ``docs/img/``
(shown by ``docs/performance.md``):

- ``sync_overhead.png``: what synchronizing adds per layer under ThreadedDataParallel, with each
  cost's noise (result
  ``sync_overhead``, rows of kind "threads" and "threads-inplace");
- ``memory.png``: a training step's peak memory over resting, in-place activated batch norm
  against torch's batch norm + LeakyReLU, and the largest batch within the budget (``memory``);
- ``compile_ranks.png``: a step under DDP over 2 Gloo ranks, eager against compiled
  (``compile_ranks``);
- ``cpu_layers.png``: float32 forward + backward against ``nn.BatchNorm*``, ours on one replica and
  under ``ThreadedDataParallel`` (``cpu_layers``).

Each caption names the result's machine and date. A result that is missing, or lacks a figure a
picture needs, is skipped with a line. Needs matplotlib (``pip install matplotlib``); without it
the script says so and exits 0, as nothing else depends on the pictures.

    python benchmarks/plots.py                                   # benchmarks/results -> docs/img
    python benchmarks/plots.py --results-dir DIR --out DIR/img
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import RESULTS_DIR, ROOT, load, machine_text  # noqa: E402

Result = dict[str, Any]


def caption(fig: Any, result: Result, script: str) -> None:
    """The picture's source, machine and date, under it."""
    text = f"{script}, {result['date']}: {machine_text(result['machine'])}"
    width = int(fig.get_figwidth() * 18)  # characters of 6.5 pt that fit across the figure
    fig.text(0.01, 0.01, "\n".join(textwrap.wrap(text, width)), fontsize=6.5, color="0.35", ha="left", va="bottom")


def save(plt: Any, fig: Any, result: Result, script: str, path: Path) -> Path:
    fig.tight_layout(rect=(0, 0.07, 1, 1))  # room for a caption of two lines
    caption(fig, result, script)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bars(ax: Any, groups: int, series: dict[str, list[float]], labels: Callable[[str, int], str] | None = None,
         errors: dict[str, list[float]] | None = None, fmt: str = "%.0f") -> None:
    """Grouped bars, one colour per series; each bar labelled with its value, or ``labels``."""
    width = 0.8 / len(series)
    for k, (label, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(groups)]
        drawn = ax.bar(xs, values, width, label=label, yerr=(errors or {}).get(label), capsize=3)
        if labels is None:
            ax.bar_label(drawn, fmt=fmt, fontsize=8)
        else:
            ax.bar_label(drawn, [labels(label, i) for i in range(groups)], fontsize=8)


def cost_label(value: float, noise: float) -> str:
    """A cost as a bar says it: never a figure below zero, nor one within its noise."""
    if abs(value) <= noise:
        return "within noise"
    return "none" if value < 0 else f"{value:.0f}"


def plot_sync_overhead(plt: Any, result: Result, out: Path) -> Path:
    # rows of another route, where a result holds them, are left out
    kinds = {"threads": "our SyncBatchNorm2d", "threads-inplace": "our InPlaceABN (against BatchNorm2d + LeakyReLU)"}
    rows = [r for r in result["rows"] if r.get("kind") in kinds and r.get("route", "native") == "native"]
    replicas = sorted({r["replicas"] for r in rows})
    pick = {(r["kind"], r["replicas"]): r for r in rows}
    drawn = {kind: label for kind, label in kinds.items() if all((kind, n) in pick for n in replicas)}
    adds = {label: [pick[kind, n]["adds_us"] for n in replicas] for kind, label in drawn.items()}
    noise = {label: [pick[kind, n]["adds_noise_us"] for n in replicas] for kind, label in drawn.items()}
    # a cost below zero is drawn as none: the bar stops at zero, its label says so
    series = {label: [max(value, 0.0) for value in values] for label, values in adds.items()}
    fig, ax = plt.subplots(figsize=(7, 4))
    bars(ax, len(replicas), series, lambda label, i: cost_label(adds[label][i], noise[label][i]), noise)
    ax.axhline(0, color="0.5", linewidth=0.8)
    ax.set_xticks(range(len(replicas)), [f"{n} replicas" for n in replicas])
    ax.set_ylabel("microseconds per layer, forward + backward")
    ax.set_title("What synchronizing adds per layer (ThreadedDataParallel, CPU)\n"
                 "over torch's unsynced nn.BatchNorm2d in the same wrapper; error bars: the noise", fontsize=10)
    ax.legend(fontsize=8)
    return save(plt, fig, result, "bench_sync_overhead.py", out / "sync_overhead.png")


def plot_memory(plt: Any, result: Result, out: Path) -> Path:
    layouts = list(dict.fromkeys(r["layout"] for r in result["rows"]))
    pick = {(r["layout"], r["contender"]): r for r in result["rows"]}
    labels = {
        "torch": "torch: BatchNorm2d + LeakyReLU(inplace)",
        "ours-fused": "ours: SyncBatchNorm2d(activation=...)",
        "ours-inplace": "ours: InPlaceABN",
    }
    series = {label: [pick[layout, c]["over_mib"] for layout in layouts] for c, label in labels.items()}
    fig, ax = plt.subplots(figsize=(7, 4))
    bars(ax, len(layouts), series)
    ticks = []
    for layout in layouts:
        fits = [f"{c.split('-')[-1]} {pick[layout, c]['fits']}" for c in ("torch", "ours-inplace") if pick[layout, c].get("fits") is not None]
        ticks.append(layout + (f"\n{result['budget_mib']} MiB fits a batch of: " + ", ".join(fits) if fits else ""))
    ax.set_xticks(range(len(layouts)), ticks, fontsize=8)
    ax.set_ylabel("step peak over resting memory, MiB")
    ax.set_title(f"Memory of a training step: 8 conv + BN + LeakyReLU blocks, batch {result['batch']}")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.35)
    ax.legend(fontsize=8, loc="upper center", ncols=2)
    return save(plt, fig, result, "bench_memory.py", out / "memory.png")


def plot_compile_ranks(plt: Any, result: Result, out: Path) -> Path:
    rows = result["rows"]
    series = {"eager": [r["eager_ms"] for r in rows], "torch.compile(fullgraph=True)": [r["compiled_ms"] for r in rows]}
    fig, ax = plt.subplots(figsize=(7, 4))
    bars(ax, len(rows), series, fmt="%.1f")
    ax.set_xticks(range(len(rows)), [f"{r['model']}\ncompiled / eager {r['ratio']:.2f}x" for r in rows], fontsize=8)
    ax.set_ylabel("ms per training step (slowest rank's median)")
    ax.set_title("Small ResNet (17 batch norms) under DDP over 2 Gloo ranks")
    ax.legend()
    return save(plt, fig, result, "bench_compile_ranks.py", out / "compile_ranks.png")


def plot_cpu_layers(plt: Any, result: Result, out: Path) -> Path:
    rows = [r for r in result["rows"] if r["dtype"] == "float32"]
    if not rows:
        raise KeyError("float32 rows")
    contenders = {"ours_x1": "ours, one replica", "threads_x2": "ThreadedDataParallel x2",
                  "threads_x4": "ThreadedDataParallel x4"}
    series = {label: [r[key] for r in rows] for key, label in contenders.items()}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bars(ax, len(rows), series, fmt="%.2f")
    ax.axhline(1.0, color="0.3", linewidth=0.9, linestyle="--", label="nn.BatchNorm* (1.0)")
    ax.set_xticks(range(len(rows)), [r["case"].replace(" float32", "").replace(") ", ")\n") for r in rows], fontsize=7)
    ax.set_ylabel("forward + backward time / nn.BatchNorm*")
    ax.set_title("CPU, float32, forward + backward against nn.BatchNorm* on the full batch")
    ax.legend(fontsize=8)
    return save(plt, fig, result, "bench_cpu.py", out / "cpu_layers.png")


PLOTS: dict[str, Callable[[Any, Result, Path], Path]] = {
    "sync_overhead": plot_sync_overhead,
    "memory": plot_memory,
    "compile_ranks": plot_compile_ranks,
    "cpu_layers": plot_cpu_layers,
}


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR,
                        help="the folder of the result files (default: benchmarks/results)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img",
                        help="where the PNGs go (default: docs/img)")
    args = parser.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        print("plots.py: matplotlib is not installed, so no pictures were drawn "
              "(pip install matplotlib, then run this again).")
        return 0
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    for name, plot in PLOTS.items():
        result = load(name, args.results_dir)
        if result is None:
            print(f"plots.py: no result {name} in {shown(args.results_dir)}; skipped")
            continue
        try:
            path = plot(plt, result, args.out)
        except (KeyError, StopIteration) as missing:  # a result written before the picture's figures were kept
            plt.close("all")
            print(f"plots.py: result {name} lacks {missing}; {name} skipped")
            continue
        print(f"plots.py: wrote {shown(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
