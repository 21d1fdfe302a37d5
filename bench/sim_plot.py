#!/usr/bin/python3
"""bench/sim_plot.py: r2ccl-sim's sweeps as CSV and PNG plots.

    bench/sim_plot.py BUILD_DIR [OUT_DIR] [--testbed-csv CSV]
                                                   (/usr/bin/python3 with python3-matplotlib)

For 8 and 64 nodes (one rank each, 8 NICs of 400 Gbit/s, a 256 MiB bf16 all-reduce), one node
losing 0..6 of its NICs: the time of Balance, R2CC-AllReduce and the weighted plan against the
fraction X of that node's bandwidth lost, beside the lower bound T_LB and the fault-free ring,
all relative to the fault-free ring. Writes OUT_DIR/sim-NODES.csv and OUT_DIR/sim-NODES.png
(OUT_DIR default: docs/img).

Then OUT_DIR/degraded-vs-bound.png: each plan's time over the lower bound T_LB against X, from
those two sweeps, beside the testbed's measured times (bench/degraded.py, copied from docs/BENCHMARKS.md
into --testbed-csv, default docs/img/degraded-testbed.csv) and r2ccl-sim's predictions of them,
both over T_LB of that setting (r2ccl-sim at the NIC rate and latency the runs were calibrated
on). Every point drawn is also written to OUT_DIR/degraded-vs-bound.csv.
"""
import argparse
import csv
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PLANS = (("balance", "Balance (ring)", "o", "C0"),
         ("r2cc", "R2CC-AllReduce", "s", "C1"),
         ("weighted", "weighted (r2ccl)", "^", "C2"))
SWEEP_NICS = 8
# The testbed of bench/degraded.py: 4 hosts x 4 NICs, host 1 losing NICs, an int32 all-reduce
# of 16 MiB; r2ccl-sim calibrated on the fault-free ring (docs/BENCHMARKS.md's figures).
TESTBED = {"hosts": 4, "nics": 4, "failed": 1, "bytes": 16 << 20, "type": "f32"}
CALIBRATION = re.compile(r"([0-9.]+) Mbit/s per NIC, ([0-9.]+) us per message")
LOWER_BOUND = re.compile(r"lower bound ([0-9.eE+-]+) s")


def fail(message: str) -> None:
    """Unreadable or missing input: says so and exits 2."""
    print(message, file=sys.stderr)
    sys.exit(2)


def read_csv(path: Path) -> tuple[list[str], list[dict]]:
    """The '#' comment lines and the rows of a CSV."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    comments = [line.lstrip("# ") for line in lines if line.startswith("#")]
    return comments, list(csv.DictReader(line for line in lines if not line.startswith("#")))


def testbed_points(sim: Path, path: Path) -> tuple[str, list[dict]]:
    """The testbed rows with whole NICs lost, each with T_LB from r2ccl-sim (at the NIC rate and
    latency of docs/BENCHMARKS.md's calibration, named in the CSV's comment)."""
    comments, rows = read_csv(path)
    cal = next((m for c in comments for m in [CALIBRATION.search(c)] if m), None)
    if cal is None:
        fail(f"sim_plot: {path}: no comment naming the calibration "
             f"('... N Mbit/s per NIC, N us per message')")
    mbit, latency_us = float(cal[1]), float(cal[2])
    bounds = {}
    points = []
    for r in rows:
        plan = r.get("plan", "")
        if plan not in {p for p, *_ in PLANS} or not r.get("lost_nics"):
            continue  # the automatic choice, and the shaped host (no NIC lost)
        lost = int(r["lost_nics"])
        if lost not in bounds:
            argv = [str(sim), "-n", str(TESTBED["hosts"]), "--nics", str(TESTBED["nics"]),
                    "--nic-gbps", f"{mbit / 1e3:.6f}", "--latency-us", f"{latency_us:g}",
                    "-b", str(TESTBED["bytes"]), "-d", TESTBED["type"], "--failed",
                    str(TESTBED["failed"]), "--lost-nics", str(lost), "-a", "balance"]
            out = subprocess.run(argv, capture_output=True, text=True, check=True,
                                 timeout=120).stdout
            m = LOWER_BOUND.search(out)
            if m is None:
                fail(f"sim_plot: no lower bound in the output of {' '.join(argv)}:\n{out}")
            bounds[lost] = float(m[1])
        for source, key in (("testbed measured", "measured_s"),
                            ("testbed r2ccl-sim", "predicted_s")):
            points.append({"source": source, "nodes": TESTBED["hosts"], "nics": TESTBED["nics"],
                           "lost_nics": lost, "x": lost / TESTBED["nics"], "plan": plan,
                           "time_s": float(r[key]), "lower_bound_s": bounds[lost]})
    return f"{mbit:g} Mbit/s per NIC", points


def plot_vs_bound(plt, sweeps: dict, testbed_csv: Path, sim: Path, out: Path) -> None:
    points = []
    for nodes, rows in sweeps.items():
        for r in rows:
            x = float(r["x"])
            for plan, *_ in PLANS:
                points.append({"source": "r2ccl-sim", "nodes": nodes, "nics": SWEEP_NICS,
                               "lost_nics": round(x * SWEEP_NICS), "x": x, "plan": plan,
                               "time_s": float(r[plan]), "lower_bound_s": float(r["lower_bound"])})
    calibration = None
    if testbed_csv.is_file():
        calibration, tb = testbed_points(sim, testbed_csv)
        points += tb
    else:
        print(f"sim_plot: {testbed_csv} not found: degraded-vs-bound.png without the testbed",
              file=sys.stderr)
    for p in points:
        p["time_over_bound"] = p["time_s"] / p["lower_bound_s"]
    data = out / "degraded-vs-bound.csv"
    with open(data, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        keys = ("source", "nodes", "nics", "lost_nics", "x", "plan", "time_s", "lower_bound_s",
                "time_over_bound")
        w.writerow(keys)
        for p in points:
            w.writerow([f"{p[k]:.6g}" if isinstance(p[k], float) else p[k] for k in keys])

    panels = [(f"r2ccl-sim: {n} nodes × {SWEEP_NICS} NICs (400 Gbit/s)\n256 MiB bf16",
               SWEEP_NICS, [("r2ccl-sim", n, "-", True)]) for n in sweeps]
    if calibration:
        panels.append((f"testbed: {TESTBED['hosts']} hosts × {TESTBED['nics']} NICs at 100 "
                       f"Mbit/s, 16 MiB int32\nT_LB at the calibrated {calibration}",
                       TESTBED["nics"], [("testbed measured", TESTBED["hosts"], "-", True),
                                         ("testbed r2ccl-sim", TESTBED["hosts"], ":", False)]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.3 * len(panels), 4.6), sharey=True,
                             squeeze=False)
    for ax, (title, nics, series) in zip(axes[0], panels):
        for source, nodes, line, filled in series:
            for plan, label, marker, color in PLANS:
                pts = sorted((p["x"], p["time_over_bound"]) for p in points
                             if p["source"] == source and p["nodes"] == nodes and p["plan"] == plan)
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, linestyle=line, marker=marker, color=color, markersize=6,
                            markerfacecolor=color if filled else "white")
        ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("X, fraction of one node's NIC bandwidth lost")
        ax.set_xticks([k / nics for k in range(nics) if k / nics < 0.76])
        ax.set_xticklabels([str(Fraction(k, nics)) for k in range(nics) if k / nics < 0.76])
        top = ax.secondary_xaxis("top", functions=(lambda x, n=nics: x * n,
                                                   lambda k, n=nics: k / n))
        top.set_xticks(range(nics))
        top.set_xlabel(f"NICs lost (of {nics})", fontsize=9)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("all-reduce time / lower bound T_LB")
    axes[0][0].set_ylim(bottom=0.9)
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], color=c, marker=m, label=lab) for _, lab, m, c in PLANS]
    handles.append(Line2D([], [], color="k", linestyle="--", label="lower bound T_LB (= 1)"))
    if calibration:
        handles += [Line2D([], [], color="grey", marker="o", label="testbed: measured"),
                    Line2D([], [], color="grey", marker="o", linestyle=":",
                           markerfacecolor="white", label="testbed: r2ccl-sim's prediction")]
    fig.legend(handles=handles, loc="lower center", ncol=3, frameon=False, fontsize=9)
    fig.suptitle("Degraded-mode all-reduce: time over the lower bound T_LB, one node losing NICs")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    png = out / "degraded-vs-bound.png"
    fig.savefig(png, dpi=110, metadata={"Software": None})
    plt.close(fig)
    note = f" (testbed T_LB at {calibration})" if calibration else ""
    print(f"sim_plot: wrote {data} and {png}{note}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build", type=Path, help="build directory (its bin/ has r2ccl-sim)")
    ap.add_argument("out", type=Path, nargs="?", default=Path("docs/img"),
                    help="where the CSVs and PNGs go (default: docs/img)")
    ap.add_argument("--testbed-csv", type=Path, default=REPO / "docs/img/degraded-testbed.csv",
                    help="bench/degraded.py's figures (default: docs/img/degraded-testbed.csv)")
    a = ap.parse_args()
    sim = a.build.resolve() / "bin" / "r2ccl-sim"
    if not sim.is_file():
        print(f"sim_plot: {sim} not found (build first: scripts/run build)", file=sys.stderr)
        return 2
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("sim_plot: needs python3-matplotlib (scripts/run simplots installs it)",
              file=sys.stderr)
        return 2
    sweeps = {}
    for nodes in (8, 64):
        path = out / f"sim-{nodes}.csv"
        subprocess.run([str(sim), "--sweep", "-n", str(nodes), "--nics", str(SWEEP_NICS),
                        "--csv", str(path)], check=True, timeout=600)
        with open(path) as f:
            rows = list(csv.DictReader(f))
        sweeps[nodes] = rows
        x = [float(r["x"]) for r in rows]
        base = [float(r["fault_free"]) for r in rows]
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for key, label, style in (("balance", "Balance (ring)", "o-"),
                                  ("r2cc", "R2CC-AllReduce", "s-"),
                                  ("weighted", "weighted (r2ccl)", "^-"),
                                  ("lower_bound", "lower bound T_LB", "k--")):
            ax.plot(x, [float(r[key]) / b for r, b in zip(rows, base)], style, label=label)
        ax.axhline(1.0, color="grey", linewidth=0.8, label="fault-free ring")
        ax.set_xlabel("X, fraction of one node's NIC bandwidth lost")
        ax.set_ylabel("all-reduce time / fault-free ring")
        ax.set_title(f"r2ccl-sim: {nodes} nodes x 8 NICs, 256 MiB bf16 all-reduce")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"sim-{nodes}.png", dpi=110)
        plt.close(fig)
        print(f"sim_plot: wrote {path} and {out / f'sim-{nodes}.png'}")
    plot_vs_bound(plt, sweeps, a.testbed_csv, sim, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
