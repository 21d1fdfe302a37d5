#!/usr/bin/env python3
"""The report of scripts/demo.sh: what happened to the rails, from the ranks' own records.

Inputs (written by scripts/demo.sh and r2ccl-perf):
  --faults F    lines "start NS", "down NS NIC", "up NS NIC" (CLOCK_REALTIME, from the injector)
  --events E    r2ccl-perf --events files E.rank0, E.rank1 (rail events as JSON lines)
  --samples S   r2ccl-perf --rail-samples files S.rank0, S.rank1 (per-rail counters over time)
  --result R    r2ccl-perf --json of rank 0 (rounds, size)
  --output O    rank 0's standard output (its "# Check:" line)
  --plot PNG    also draw the rails over time (bench/failover_plot.py: per-rail throughput, rail
                states and events, the outage) to PNG, keeping the records it is drawn from next
                to it as PNG with .json (`bench/failover_plot.py --data JSON` draws them again);
                needs python3-matplotlib
  --about TEXT  with --plot: what was run, kept in the JSON
Exit status: 0 when rank 0 reported every byte verified, 1 otherwise, 2 on unreadable input (or,
with --plot, no matplotlib).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CHECK_OK = "# Check: every byte verified on every rank"
SETTLE_NS = 500_000_000  # rates are taken from half a second after each change


def load_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"demo_report: {path}:{n}: not JSON: {e}")
    return out


def mib(b: float) -> str:
    return f"{b / 2**20:.1f} MiB"


def rate(samples: list[dict], a: int, b: int, rail: int) -> float | None:
    """MB/s sent on `rail` between wall times a and b (the samples inside the window)."""
    inside = [s for s in samples if a <= s["wall_ns"] <= b]
    if len(inside) < 2:
        return None
    first, last = inside[0], inside[-1]
    dt = (last["wall_ns"] - first["wall_ns"]) / 1e9
    if dt <= 0:
        return None
    tx = lambda s: next((r["tx_bytes"] for r in s["rails"] if r["rail"] == rail), 0)  # noqa: E731
    return (tx(last) - tx(first)) / dt / 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("faults", "events", "samples", "result", "output"):
        ap.add_argument(f"--{name}", required=True, type=Path)
    ap.add_argument("--plot", type=Path, help="also draw the rails over time to this PNG")
    ap.add_argument("--about", default="", help="with --plot: what was run, kept in the JSON")
    a = ap.parse_args()
    failover_plot = None
    if a.plot:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
        try:
            import matplotlib  # noqa: F401
            import failover_plot
        except ImportError as e:
            print(f"demo_report: --plot needs python3-matplotlib ({e})", file=sys.stderr)
            return 2

    faults = {}
    for line in a.faults.read_text().split("\n"):
        f = line.split()
        if len(f) >= 2 and f[1].isdigit():
            faults[f[0]] = (int(f[1]), f[2] if len(f) > 2 else "")
    if "start" not in faults:
        print(f"demo_report: {a.faults} has no start time", file=sys.stderr)
        return 2
    t0 = faults["start"][0]
    at = lambda ns: f"{(ns - t0) / 1e9:7.3f} s"  # noqa: E731

    ranks = (0, 1)
    events = {r: [e for e in load_lines(Path(f"{a.events}.rank{r}")) if e.get("kind") != "final"]
              for r in ranks}
    samples = {r: load_lines(Path(f"{a.samples}.rank{r}")) for r in ranks}
    if not samples[0]:
        print(f"demo_report: no rail samples in {a.samples}.rank0", file=sys.stderr)
        return 2
    rails = sorted({(x["rail"], x["nic"]) for x in samples[0][-1]["rails"]})

    timeline = []
    if "down" in faults:
        timeline.append((faults["down"][0], f"host 0: {faults['down'][1]} taken down "
                                            f"(ip link set down, from outside the processes)"))
    if "up" in faults:
        timeline.append((faults["up"][0], f"host 0: {faults['up'][1]} brought back up"))
    shown = {"failed": "failed", "replay_started": "replay started",
             "replay_reconciled": "replay reconciled with the peer",
             "first_replay_confirmed": "first replayed chunk confirmed",
             "readmitted": "re-admitted"}
    for r in ranks:
        for e in events[r]:
            if e["kind"] in shown:
                timeline.append((e["wall_ns"], f"rank {r}: rail {e['rail']} ({e['nic']}) "
                                               f"{shown[e['kind']]}: {e['detail']}"))
    if timeline:
        print("What happened (seconds from the launch):")
        for ns, text in sorted(timeline):
            print(f"  {at(ns)}  {text}")
        print()

    # In-flight data that was on the failed rail and went again over the others.
    if "down" in faults:
        print("In-flight data replayed on the surviving rails:")
        for r in ranks:
            if not samples[r]:
                continue
            base = [s for s in samples[r] if s["wall_ns"] <= faults["down"][0]] or samples[r][:1]
            first, last = base[-1], samples[r][-1]
            per = []
            total = 0
            for x in last["rails"]:
                b0 = next((y["replayed_bytes"] for y in first["rails"] if y["rail"] == x["rail"]), 0)
                d = x["replayed_bytes"] - b0
                if d > 0:
                    per.append(f"rail {x['rail']} ({x['nic']}) {mib(d)}")
                    total += d
            print(f"  rank {r}: {mib(total)}" + (f": {', '.join(per)}" if per else
                                                 " (nothing was in flight on the failed rail)"))
        print()

    # Per-rail throughput before, during and after the outage (rank 0's sends).
    end = samples[0][-1]["wall_ns"]
    windows = [("whole run", samples[0][0]["wall_ns"], end)]
    if "down" in faults and "up" in faults:
        failed = [e["wall_ns"] for e in events[0] if e["kind"] == "failed"]
        back = [e["wall_ns"] for e in events[0]
                if e["kind"] == "readmitted" and e["wall_ns"] > faults["up"][0]]
        down_at = min(failed) if failed else faults["down"][0]
        back_at = min(back) if back else faults["up"][0]
        windows = [("before", samples[0][0]["wall_ns"] + SETTLE_NS, faults["down"][0]),
                   ("during", down_at + SETTLE_NS, faults["up"][0]),
                   ("after", back_at + SETTLE_NS, end)]
    width = max(len(nic) for _, nic in rails)
    print("Traffic sent by rank 0, per rail (MB/s):")
    print(f"  {'rail':>4}  {'nic':<{width}}" + "".join(f"{w[0]:>11}" for w in windows))
    totals = [0.0] * len(windows)
    for rail, nic in rails:
        cells = []
        for i, (_, lo, hi) in enumerate(windows):
            v = rate(samples[0], lo, hi, rail)
            cells.append(f"{v:11.1f}" if v is not None else f"{'-':>11}")
            totals[i] += v or 0.0
        print(f"  {rail:>4}  {nic:<{width}}" + "".join(cells))
    print(f"  {'all':>4}  {'':<{width}}" + "".join(f"{t:11.1f}" for t in totals))
    print()

    out = a.output.read_text() if a.output.exists() else ""
    verified = CHECK_OK in out
    result = json.loads(a.result.read_text()) if a.result.exists() else {}
    rows = result.get("results", [])
    if rows:
        r = rows[-1]
        moved = 2 * r["iters"] * r["bytes"]
        print(f"Rounds: {r['iters']} of {mib(r['bytes'])} each way ({moved / 1e9:.2f} GB in all), "
              f"{r['time_us'] / 1e3:.1f} ms per round on average.")
    print("Result: every byte verified on every rank." if verified else
          "Result: FAILED: rank 0 did not report every byte verified.")
    if failover_plot:
        data = failover_plot.records(faults, events, samples, a.about)
        failover_plot.dump(data, a.plot.with_suffix(".json"))
        failover_plot.draw(data, a.plot)
        print(f"Timeline: {a.plot} (records: {a.plot.with_suffix('.json')})")
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
