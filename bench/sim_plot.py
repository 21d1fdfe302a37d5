#!/usr/bin/python3
"""bench/sim_plot.py: r2ccl-sim's sweeps as CSV and PNG plots.

    bench/sim_plot.py BUILD_DIR [OUT_DIR]     (/usr/bin/python3 with python3-matplotlib)

For 8 and 64 nodes (one rank each, 8 NICs of 400 Gbit/s, a 256 MiB bf16 all-reduce), one node
losing 0..6 of its NICs: the time of Balance, R2CC-AllReduce and the weighted plan against the
fraction X of that node's bandwidth lost, beside the lower bound T_LB and the fault-free ring,
all relative to the fault-free ring. Writes OUT_DIR/sim-NODES.csv and OUT_DIR/sim-NODES.png
(OUT_DIR default: docs/img).
"""
import csv
import subprocess
import sys
from pathlib import Path


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    sim = Path(sys.argv[1]).resolve() / "bin" / "r2ccl-sim"
    out = Path(sys.argv[2] if len(sys.argv) > 2 else "docs/img")
    out.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("sim_plot: needs python3-matplotlib (scripts/run simplots installs it)",
              file=sys.stderr)
        return 2
    for nodes in (8, 64):
        path = out / f"sim-{nodes}.csv"
        subprocess.run([str(sim), "--sweep", "-n", str(nodes), "--nics", "8", "--csv", str(path)],
                       check=True, timeout=600)
        with open(path) as f:
            rows = list(csv.DictReader(f))
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
