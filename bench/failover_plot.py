#!/usr/bin/python3
"""bench/failover_plot.py: the demo's rails over time, from the records it kept.

    bench/failover_plot.py [--data docs/img/failover-timeline.json]
                           [--output docs/img/failover-timeline.png] [--window 0.5]
                                                   (/usr/bin/python3 with python3-matplotlib)

scripts/demo.sh BUILD_DIR --plot PNG (through scripts/demo_report.py --plot PNG) keeps, next to
the PNG (same name, .json), the records of one demo run the picture is drawn from: the injector's
fault times, both ranks' rail events (r2ccl-perf --events) and rank 0's per-rail counters over
time (r2ccl-perf --rail-samples, summed over peers). This script draws that file again, with no
demo run: on top, what rank 0 sent on each rail (MB/s, stacked, from the counters' differences
over --window seconds); below, each rail's state as rank 0 sampled it and the rail events of
both ranks (failed, replay, re-admitted), with the NIC's outage shaded across both; at the
bottom, close-ups in milliseconds of the events after the NIC went down and after it came back.
Exit status: 0 written, 2 unreadable input or no matplotlib.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FORMAT = "r2ccl-demo-timeline/1"
# Rail states (r2ccl::rail_state_name) -> colour of the state strip.
STATE_COLOURS = {"up": "#b9e4b4", "suspect": "#ffe08a", "down": "#e8747c", "probing": "#f5b26b",
                 "degraded": "#c7a6e0"}
WORST = {"down": 0, "probing": 1, "suspect": 2, "degraded": 3, "up": 4}
# Event kinds drawn -> legend label, marker, colour.
EVENT_STYLES = {
    "link_down": ("link down seen", "v", "#7f0000"),
    "failed": ("failed (DOWN)", "X", "#c00000"),
    "replay_started": ("replay started", ">", "#1f4e9c"),
    "replay_reconciled": ("replay reconciled with the peer", "d", "#1f4e9c"),
    "first_replay_confirmed": ("first replayed chunk confirmed", "*", "#1f4e9c"),
    "link_up": ("link up seen", "^", "#2b7a2b"),
    "readmitted": ("re-admitted", "o", "#2b7a2b"),
    "degraded": ("degraded", "s", "#7b3fa0"),
    "recovered": ("no longer degraded", "s", "#2b7a2b"),
}


def fail(message: str) -> None:
    """Unreadable or missing input: says so and exits 2."""
    print(message, file=sys.stderr)
    sys.exit(2)


# ---- the records ---------------------------------------------------------------------------

def records(faults: dict, events: dict, samples: dict, about: str = "") -> dict:
    """What the picture needs from one demo run, as kept in the JSON file.

    faults: {"start": (ns, ""), "down": (ns, nic), "up": (ns, nic)} (scripts/demo.sh's injector);
    events: {rank: [r2ccl-perf --events lines, without "final"]};
    samples: {rank: [r2ccl-perf --rail-samples lines]} (rank 0's are kept)."""
    rails = sorted({(x["rail"], x["nic"]) for s in samples[0] for x in s["rails"]})
    index = {rail: i for i, (rail, _) in enumerate(rails)}
    kept = []
    for s in samples[0]:
        row = {"wall_ns": s["wall_ns"], "tx_bytes": [0] * len(rails), "rx_bytes": [0] * len(rails),
               "replayed_bytes": [0] * len(rails), "state": ["?"] * len(rails)}
        for x in s["rails"]:  # every peer's end of the rail (the demo has one peer)
            i = index[x["rail"]]
            for key in ("tx_bytes", "rx_bytes", "replayed_bytes"):
                row[key][i] += x[key]
            # The worst state over the peers' ends.
            if WORST.get(x["state"], len(WORST)) < WORST.get(row["state"][i], len(WORST)):
                row["state"][i] = x["state"]
        kept.append(row)
    return {
        "format": FORMAT,
        "about": about,
        "start_ns": faults["start"][0],
        "faults": [{"kind": k, "wall_ns": faults[k][0], "host": 0, "nic": faults[k][1]}
                   for k in ("down", "up") if k in faults],
        "rails": [{"rail": r, "nic": nic} for r, nic in rails],
        "events": sorted(({k: e[k] for k in ("wall_ns", "rank", "peer", "rail", "nic", "kind",
                                              "detail") if k in e}
                          for r in sorted(events) for e in events[r]),
                         key=lambda e: (e["wall_ns"], e.get("rank", 0), e["rail"])),
        "samples": kept,
    }


def dump(data: dict, path: Path) -> None:
    """The records as JSON, one event or sample a line (small diffs, same bytes for same data)."""
    lines = ["{"]
    items = list(data.items())
    for n, (k, v) in enumerate(items):
        comma = "," if n + 1 < len(items) else ""
        if isinstance(v, list) and v:
            lines.append(f" {json.dumps(k)}: [")
            lines += [f"  {json.dumps(x, sort_keys=True)}" + ("," if i + 1 < len(v) else "")
                      for i, x in enumerate(v)]
            lines.append(f" ]{comma}")
        else:
            lines.append(f" {json.dumps(k)}: {json.dumps(v, sort_keys=True)}{comma}")
    lines.append("}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def load(path: Path) -> dict:
    if not path.is_file():
        fail(f"failover_plot: {path}: no such file (scripts/demo.sh BUILD_DIR --plot PNG "
             f"writes it next to the PNG)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        fail(f"failover_plot: {path}: not JSON: {e}")
    if data.get("format") != FORMAT:
        fail(f"failover_plot: {path}: not a {FORMAT} file")
    if len(data.get("samples", [])) < 2:
        fail(f"failover_plot: {path}: fewer than two rail samples")
    return data


# ---- the picture ---------------------------------------------------------------------------

def rates(data: dict, window_s: float) -> tuple[list[float], list[list[float]]]:
    """Interval starts (s from the launch) and, per rail, MB/s sent in each interval: samples are
    merged until an interval spans at least window_s (they are taken between rounds, every
    200 ms or more), so each value averages whole rounds."""
    t0 = data["start_ns"]
    samples = data["samples"]
    starts, per_rail = [], [[] for _ in data["rails"]]
    a = 0
    for b in range(1, len(samples)):
        dt = (samples[b]["wall_ns"] - samples[a]["wall_ns"]) / 1e9
        if dt < window_s and b + 1 < len(samples):
            continue
        if dt <= 0:
            continue
        starts.append((samples[a]["wall_ns"] - t0) / 1e9)
        for i in range(len(data["rails"])):
            per_rail[i].append((samples[b]["tx_bytes"][i] - samples[a]["tx_bytes"][i]) / dt / 1e6)
        a = b
    starts.append((samples[a]["wall_ns"] - t0) / 1e9)  # where the last interval ends
    return starts, per_rail


def zoom(ax, data: dict, ref_ns: int, lo_ns: int, hi_ns: int, what: str) -> set:
    """The events of both ranks between lo_ns and hi_ns, in ms from ref_ns (an injector's
    command), one row per rank. Returns the kinds drawn."""
    seen = set()
    xs = []
    for e in data["events"]:
        if e["kind"] not in EVENT_STYLES or not lo_ns <= e["wall_ns"] < hi_ns:
            continue
        _, marker, colour = EVENT_STYLES[e["kind"]]
        rank = e.get("rank", 0)
        x = (e["wall_ns"] - ref_ns) / 1e6
        ax.plot(x, rank, marker, color=colour, markersize=9,
                markerfacecolor=colour if rank == 0 else "white", markeredgewidth=1.3, zorder=5)
        xs.append(x)
        seen.add(e["kind"])
    ax.axvline(0, color="#555555", linestyle="--", linewidth=1)
    ax.set_yticks([0, 1], ["rank 0", "rank 1"])
    ax.set_ylim(1.6, -0.6)
    ax.set_xlim(min([0.0] + xs) - 0.06 * (max(xs + [1.0])), max(xs + [1.0]) * 1.08)
    ax.set_xlabel(f"ms after {what}", fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    return seen


def draw(data: dict, png: Path, window_s: float = 0.5) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.transforms import blended_transform_factory

    t0 = data["start_ns"]
    sec = lambda ns: (ns - t0) / 1e9  # noqa: E731
    rails = data["rails"]
    nrails = len(rails)
    starts, per_rail = rates(data, window_s)
    fault = {f["kind"]: f for f in data["faults"]}
    samples = data["samples"]
    end = sec(samples[-1]["wall_ns"])
    last_ns = max([samples[-1]["wall_ns"]] + [e["wall_ns"] for e in data["events"]])

    both = "down" in fault and "up" in fault
    fig = plt.figure(figsize=(10, 8.4 if both else 6.2))
    grid = fig.add_gridspec(3 if both else 2, 2, height_ratios=[3, 2, 1.25][:3 if both else 2],
                            hspace=0.45)
    top = fig.add_subplot(grid[0, :])
    strip = fig.add_subplot(grid[1, :], sharex=top)

    # Stacked steps: each interval's rate held from its start to the next.
    colours = [f"C{i}" for i in range(nrails)]
    xs = [x for i in range(len(starts) - 1) for x in (starts[i], starts[i + 1])]
    base = [0.0] * len(xs)
    for i, r in enumerate(rails):
        ys = [v for v in per_rail[i] for _ in (0, 1)]
        top.fill_between(xs, base, [b + y for b, y in zip(base, ys)], color=colours[i],
                         alpha=0.8, linewidth=0, label=f"rail {r['rail']} ({r['nic']})")
        base = [b + y for b, y in zip(base, ys)]
    top.plot(xs, base, color="k", linewidth=0.8, label="all rails")
    top.set_ylabel(f"sent by rank 0 (MB/s,\n{window_s:g} s averages)")
    top.set_ylim(0, max(base) * 1.3 if base else 1)
    top.grid(True, axis="y", alpha=0.3)
    top.tick_params(labelbottom=False)

    # The outage, and the injector's two commands, across both panels.
    if "down" in fault:
        d = sec(fault["down"]["wall_ns"])
        u = sec(fault["up"]["wall_ns"]) if "up" in fault else end
        for ax in (top, strip):
            ax.axvspan(d, u, color="#e8747c", alpha=0.12, linewidth=0)
            ax.axvline(d, color="#c00000", linestyle="--", linewidth=1)
            if "up" in fault:
                ax.axvline(u, color="#2b7a2b", linestyle="--", linewidth=1)
        nic = fault["down"]["nic"]
        above = blended_transform_factory(top.transData, top.transAxes)
        top.text(d, 1.02, f"host 0: {nic} down\n(ip link set down)", transform=above,
                 ha="center", va="bottom", fontsize=8, color="#c00000")
        if "up" in fault:
            top.text(u, 1.02, f"{nic} back up", transform=above, ha="center", va="bottom",
                     fontsize=8, color="#2b7a2b")

    # Rail states as rank 0 sampled them (each held until the next sample).
    for i in range(nrails):
        runs = []
        for a, b in zip(samples, samples[1:]):
            x0, x1, st = sec(a["wall_ns"]), sec(b["wall_ns"]), a["state"][i]
            if runs and runs[-1][2] == st:
                runs[-1][1] = x1
            else:
                runs.append([x0, x1, st])
        for x0, x1, st in runs:
            strip.broken_barh([(x0, x1 - x0)], (i - 0.35, 0.7),
                              facecolor=STATE_COLOURS.get(st, "#dddddd"), edgecolor="none")
    # Events of both ranks on their rail's row: rank 0 above the middle, rank 1 below.
    seen = set()
    row = {r["rail"]: i for i, r in enumerate(rails)}
    for e in data["events"]:
        if e["kind"] not in EVENT_STYLES or e["rail"] not in row:
            continue
        _, marker, colour = EVENT_STYLES[e["kind"]]
        rank = e.get("rank", 0)
        strip.plot(sec(e["wall_ns"]), row[e["rail"]] + (-0.17 if rank == 0 else 0.17), marker,
                   color=colour, markersize=8, markerfacecolor=colour if rank == 0 else "white",
                   markeredgewidth=1.3, zorder=5)
        seen.add(e["kind"])
    strip.set_yticks(range(nrails), [f"rail {r['rail']} ({r['nic']})" for r in rails])
    strip.set_ylim(nrails - 0.5, -0.5)
    strip.set_xlabel("seconds from the launch")
    strip.set_xlim(0, end)
    strip.set_title("rail state (rank 0's view, sampled between rounds) and rail events",
                    fontsize=9)

    # What the events say, in words.
    failed = [e for e in data["events"] if e["kind"] == "failed"]
    back = [e for e in data["events"] if e["kind"] == "readmitted"
            and ("up" not in fault or e["wall_ns"] >= fault["up"]["wall_ns"])]
    notes = []
    if "down" in fault and failed:
        first = min(e["wall_ns"] for e in failed)
        notes.append(f"failed {(first - fault['down']['wall_ns']) / 1e6:.1f} ms after the NIC "
                     f"went down")
    if "down" in fault:
        before = [s for s in samples if s["wall_ns"] <= fault["down"]["wall_ns"]] or samples[:1]
        replayed = [a - b for a, b in zip(samples[-1]["replayed_bytes"],
                                          before[-1]["replayed_bytes"])]
        if sum(replayed):
            on = [rails[i]["nic"] for i in range(nrails) if replayed[i] > 0]
            notes.append(f"rank 0 replayed {sum(replayed) / 2**20:.1f} MiB in flight, on "
                         f"{', '.join(on)}")
    if "up" in fault and back:
        first = min(e["wall_ns"] for e in back)
        notes.append(f"re-admitted {(first - fault['up']['wall_ns']) / 1e9:.2f} s after it came "
                     f"back")
    if notes:
        top.text(0.99, 0.97, "\n".join(notes), transform=top.transAxes, ha="right", va="top",
                 fontsize=8, bbox=dict(facecolor="white", edgecolor="#999999", alpha=0.9))
    top.legend(loc="upper left", ncol=nrails + 1, fontsize=8, framealpha=0.9)

    # Close-ups of the two moments, in milliseconds.
    if both:
        down_ns, up_ns = fault["down"]["wall_ns"], fault["up"]["wall_ns"]
        left = fig.add_subplot(grid[2, 0])
        seen |= zoom(left, data, down_ns, down_ns - 10**9, up_ns, f"{fault['down']['nic']} went "
                     f"down")
        left.set_title("close-up: the failure", fontsize=9)
        right = fig.add_subplot(grid[2, 1])
        seen |= zoom(right, data, up_ns, up_ns, last_ns + 1, f"{fault['up']['nic']} came back")
        right.set_title("close-up: the return", fontsize=9)

    handles = [Patch(facecolor=STATE_COLOURS[s], label=f"state {s}") for s in STATE_COLOURS
               if any(s in x["state"] for x in samples)]
    handles += [Line2D([], [], linestyle="", marker=EVENT_STYLES[k][1], color=EVENT_STYLES[k][2],
                       markersize=7, label=EVENT_STYLES[k][0]) for k in EVENT_STYLES if k in seen]
    handles += [Line2D([], [], linestyle="", marker="o", color="grey", label="rank 0 (filled)"),
                Line2D([], [], linestyle="", marker="o", color="grey", markerfacecolor="white",
                       label="rank 1 (hollow)")]
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.suptitle("r2ccl demo: a NIC dies under verified traffic (2 ranks × 4 rails, 16 MiB "
                 "each way per round)", fontsize=11)
    fig.subplots_adjust(left=0.1, right=0.98, top=0.9, bottom=0.16 if both else 0.2)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110, metadata={"Software": None})
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    repo = Path(__file__).resolve().parent.parent
    ap.add_argument("--data", type=Path, default=repo / "docs/img/failover-timeline.json",
                    help="the demo's kept records (default: docs/img/failover-timeline.json)")
    ap.add_argument("--output", "-o", type=Path, default=None,
                    help="PNG to write (default: --data with .png)")
    ap.add_argument("--window", type=float, default=0.5,
                    help="throughput averaged over at least this many seconds (default 0.5)")
    a = ap.parse_args()
    data = load(a.data)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("failover_plot: needs python3-matplotlib (apt-get install python3-matplotlib)",
              file=sys.stderr)
        return 2
    out = a.output or a.data.with_suffix(".png")
    draw(data, out, a.window)
    print(f"failover_plot: wrote {out} from {a.data}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
