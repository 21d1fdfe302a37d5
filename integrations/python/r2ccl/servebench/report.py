"""A standalone run's figures from the files its ranks wrote (standalone.py): the latencies of
its requests (metrics.summarize, as in engine mode), the share of each step spent
communicating, the communication per kind of call, and the faults; a table and a plot for
several runs side by side."""

from __future__ import annotations

import json
from pathlib import Path

from . import metrics


def load(run: str | Path) -> dict:
    run = Path(run)
    ranks = [json.loads(p.read_text()) for p in sorted(run.glob("rank*.json"))]
    if not ranks:
        raise ValueError(f"{run}: no rank*.json (not a standalone run's output)")
    faults = []
    if (run / "faults.jsonl").exists():
        faults = [json.loads(line) for line in (run / "faults.jsonl").read_text().splitlines()
                  if line.strip()]
    return {"dir": str(run), "ranks": ranks, "faults": faults}


def results(run: dict) -> list[metrics.Result]:
    out = []
    for rk in run["ranks"]:
        for q in rk.get("requests", []):
            r = metrics.Result(q["index"], q["arrival_s"], q["input_len"], list(q["token_s"]),
                               len(q["token_s"]), q["error"])
            out.append(r)
    return sorted(out, key=lambda r: r.index)


def comm_share(run: dict) -> dict:
    """Per role: the seconds communicating over the seconds of the steps, summed over its ranks'
    steps; and the mean of the per-step shares."""
    by_role: dict[str, list] = {}
    for rk in run["ranks"]:
        by_role.setdefault(rk["role"], []).extend(rk["steps"])
    out = {}
    for role, steps in by_role.items():
        busy = sum(s[1] - s[0] for s in steps)
        comm = sum(s[3] for s in steps)
        shares = [s[3] / (s[1] - s[0]) for s in steps if s[1] > s[0]]
        out[role] = {"steps": len(steps), "share": round(comm / busy, 4) if busy else None,
                     "mean_step_share": round(sum(shares) / len(shares), 4) if shares else None,
                     "mean_step_ms": round(1e3 * busy / len(steps), 3) if steps else None}
    return out


def summarize(run: dict, percentiles=(50, 90, 99), slos=None) -> dict:
    rank0 = next((rk for rk in run["ranks"] if rk["rank"] == 0), None)
    if rank0 is None:
        raise ValueError(f"{run['dir']}: rank 0 wrote no results (it failed before the end)")
    res = results(run)
    duration = rank0.get("duration_s", 0.0)
    out = metrics.summarize(res, duration, percentiles, slos)
    out["requests"] = rank0.get("requests_total", out["requests"])
    out["failed"] = out["requests"] - out["completed"]
    out["backend"] = rank0["backend"]
    out["model"] = rank0["model"]["name"]
    out["deployment"] = rank0["deployment"]
    out["compute"] = rank0["compute"]
    out["comm_share"] = comm_share(run)
    comm: dict[str, dict] = {}
    for rk in run["ranks"]:
        for op, t in rk["comm"].items():
            c = comm.setdefault(op, {"calls": 0, "bytes": 0, "seconds": 0.0})
            for k in c:
                c[k] += t[k]
    out["comm"] = comm
    out["kv_bytes"] = sum(rk.get("kv_bytes", 0) for rk in run["ranks"] if rk["role"] == "prefill")
    out["faults"] = run["faults"]
    errs = sorted({e for rk in run["ranks"] for e in rk["errors"]})
    if errs:
        out["rank_errors"] = errs
    return out


def table(rows: list[tuple[str, dict]]) -> str:
    head = ("| run | done | failed | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | ITL p99 | "
            "comm share |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for name, s in rows:
        share = "; ".join(f"{role} {100 * v['share']:.0f}%" for role, v in s["comm_share"].items()
                          if v["share"] is not None)

        def f(key):
            v = s.get(key)
            return "-" if v is None else f"{v:.1f}"
        lines.append(f"| {name} | {s['completed']}/{s['requests']} | {s['failed']} | "
                     f"{f('p50_ttft_ms')} | {f('p99_ttft_ms')} | {f('p50_tpot_ms')} | "
                     f"{f('p99_tpot_ms')} | {f('p99_itl_ms')} | {share} |")
    return "\n".join(lines)


def plot(runs: list[tuple[str, dict]], path: str) -> None:
    """Top: each run's TTFT and TPOT per request over its arrival time, faults marked; bottom:
    the CDFs of TTFT and TPOT of every run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for name, run in runs:
        res = [r for r in results(run) if r.ok]
        xs = [r.sent_s for r in res]
        axes[0][0].plot(xs, [1e3 * r.ttft() for r in res], ".", ms=3, label=name)
        axes[0][1].plot(xs, [1e3 * r.tpot() for r in res], ".", ms=3, label=name)
        for f in run["faults"]:
            for ax in axes[0]:
                ax.axvline(f["at_s"], color="red", lw=0.8, ls="--")
        for ax, series in ((axes[1][0], sorted(1e3 * r.ttft() for r in res)),
                           (axes[1][1], sorted(1e3 * r.tpot() for r in res))):
            if series:
                ax.plot(series, [(i + 1) / len(series) for i in range(len(series))], label=name)
    axes[0][0].set(title="TTFT per request (dashed: a fault)", xlabel="arrival (s)", ylabel="ms")
    axes[0][1].set(title="TPOT per request", xlabel="arrival (s)", ylabel="ms")
    axes[1][0].set(title="TTFT CDF", xlabel="ms", ylabel="fraction")
    axes[1][1].set(title="TPOT CDF", xlabel="ms", ylabel="fraction")
    for row in axes:
        for ax in row:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    axes[0][0].set_yscale("log")
    axes[1][0].set_xscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
