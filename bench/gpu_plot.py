#!/usr/bin/python3
"""bench/gpu_plot.py: GPU bf16 all-reduce latency against message size, from a CSV.

    bench/gpu_plot.py [--csv docs/img/gpu-allreduce.csv] [--output docs/img/gpu-latency.png]
                                                   (/usr/bin/python3 with python3-matplotlib)

The CSV holds measured times (columns machine, size_bytes, impl, latency_us; lines starting
with '#' are comments saying where the numbers come from): docs/img/gpu-allreduce.csv is copied
from docs/BENCHMARKS.md's GPU all-reduce tables (2 × H100; 2 and 4 × H200). Draws
one log-log panel per machine (in the CSV's order): r2ccl beside NCCL and PyTorch's symmetric
memory, time per call against size. Implementations not listed below are drawn in grey.
Exit status: 0 written, 2 unreadable input or no matplotlib.
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

# impl in the CSV -> legend label, matplotlib style, z-order (r2ccl on top).
IMPLS = {
    "r2ccl": ("r2ccl (C++)", dict(color="C0", marker="o", linewidth=2.0), 5),
    "r2ccl-python": ("r2ccl (Python, torch tensors)",
                     dict(color="C0", marker="", linestyle=":", linewidth=1.5), 4),
    "nccl-c": ("NCCL (from C)", dict(color="C3", marker="s", linewidth=1.3), 3),
    "nccl-pytorch": ("NCCL (through PyTorch)",
                     dict(color="C3", marker="s", markerfacecolor="none", linestyle="--",
                          linewidth=1.0), 2),
    "symm-mem": ("PyTorch symmetric memory", dict(color="C2", marker="^", linewidth=1.3), 3),
}
MACHINES = {"2xH100": "2 × H100 (NVLink 4)", "2xH200": "2 × H200", "4xH200": "4 × H200"}


def fail(message: str) -> None:
    """Unreadable or missing input: says so and exits 2."""
    print(message, file=sys.stderr)
    sys.exit(2)


def size_label(b: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= scale and b % scale == 0:
            return f"{b // scale} {unit}"
    return f"{b} B"


def read(path: Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """machine -> impl -> [(size_bytes, latency_us)] sorted by size, in the file's order."""
    if not path.is_file():
        fail(f"gpu_plot: {path}: no such file (docs/img/gpu-allreduce.csv holds docs/BENCHMARKS.md's "
             f"measured tables)")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(line for line in f if not line.lstrip().startswith("#")))
    want = {"machine", "size_bytes", "impl", "latency_us"}
    if not rows or not want <= set(rows[0]):
        fail(f"gpu_plot: {path}: needs the columns {', '.join(sorted(want))}")
    data: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for n, r in enumerate(rows, 2):
        try:
            point = (int(r["size_bytes"]), float(r["latency_us"]))
        except (TypeError, ValueError):
            fail(f"gpu_plot: {path}: data row {n}: not a number: {r}")
        data.setdefault(r["machine"], {}).setdefault(r["impl"], []).append(point)
    for impls in data.values():
        for points in impls.values():
            points.sort()
    return data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    repo = Path(__file__).resolve().parent.parent
    ap.add_argument("--csv", type=Path, default=repo / "docs/img/gpu-allreduce.csv",
                    help="measured times (default: docs/img/gpu-allreduce.csv)")
    ap.add_argument("--output", "-o", type=Path, default=repo / "docs/img/gpu-latency.png",
                    help="PNG to write (default: docs/img/gpu-latency.png)")
    a = ap.parse_args()
    data = read(a.csv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter
    except ImportError:
        print("gpu_plot: needs python3-matplotlib (apt-get install python3-matplotlib)",
              file=sys.stderr)
        return 2
    times = [t for impls in data.values() for pts in impls.values() for _, t in pts]

    fig, axes = plt.subplots(1, len(data), figsize=(4.6 * len(data), 4.4), sharey=True,
                             squeeze=False)
    for ax, (machine, impls) in zip(axes[0], data.items()):
        order = sorted(impls, key=lambda i: (i not in IMPLS, list(IMPLS).index(i)
                                             if i in IMPLS else 0, i))
        for impl in order:
            label, style, z = IMPLS.get(impl, (impl, dict(color="grey", marker="."), 1))
            xs, ys = zip(*impls[impl])
            ax.plot(xs, ys, label=label, zorder=z, markersize=5, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        sizes = sorted({s for pts in impls.values() for s, _ in pts})
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(sizes, [size_label(s) for s in sizes], rotation=45, ha="right")
        ax.set_title(MACHINES.get(machine, machine))
        ax.set_xlabel("message size (bf16 sum, per GPU)")
        ax.grid(True, which="both", alpha=0.3)
    ax0 = axes[0][0]
    ax0.set_ylabel("time per all-reduce (µs)")
    ticks = [t for t in (2, 3, 5, 10, 20, 30, 50, 100) if min(times) / 1.2 <= t <= max(times) * 1.2]
    ax0.yaxis.set_major_locator(FixedLocator(ticks))
    ax0.yaxis.set_major_formatter(ScalarFormatter())
    ax0.yaxis.set_minor_locator(NullLocator())
    ax0.set_ylim(min(times) / 1.25, max(times) * 1.25)
    # One legend for every panel: the implementations of the panel that has the most.
    richest = max(axes[0], key=lambda x: len(x.get_lines()))
    handles, labels = richest.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False,
               bbox_to_anchor=(0.5, 0.0))
    fig.suptitle("GPU all-reduce latency inside a node (CUDA graphs; lower is better)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    a.output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.output, dpi=110, metadata={"Software": None})
    plt.close(fig)
    print(f"gpu_plot: wrote {a.output} from {a.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
