"""r2ccl-servebench engine: a workload against a serving engine's OpenAI-compatible API.

    python -m r2ccl.servebench engine --url http://127.0.0.1:8000 --model NAME \
        --requests 200 --rate 2 --input-len 128:512 --output-len 32 \
        --slo "ttft:2000 tpot:200" --fault "60:ip -n h0 link set eth1 down" --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import urllib.request
from pathlib import Path

from . import client, metrics, workload


def length_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not N or LOW:HIGH") from None
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"'{text}': need 1 <= LOW <= HIGH")
    return a, b


def r2ccl_counters(url: str) -> dict[str, float]:
    """The r2ccl_* samples of a Prometheus endpoint, summed per name (labels dropped)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(r2ccl_[a-zA-Z0-9_]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m and (m.group(1).endswith("_total") or m.group(1).endswith("_bytes")):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def add_workload(p) -> None:
    p.add_argument("--requests", type=int, default=0,
                   help="how many (default: rate x duration, or the whole trace)")
    p.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 Poisson, below 1 burstier")
    p.add_argument("--input-len", type=length_range, default=(128, 128), metavar="N|LOW:HIGH")
    p.add_argument("--output-len", type=length_range, default=(32, 32), metavar="N|LOW:HIGH")
    p.add_argument("--trace", help="a Mooncake-format trace (JSON lines) instead of --rate")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiplies the trace's arrival times")
    p.add_argument("--max-input", type=int, default=workload.MAX_TOKENS,
                   help="caps a trace's input lengths (the model's length)")
    p.add_argument("--max-output", type=int, default=workload.MAX_TOKENS)
    p.add_argument("--seed", type=int, default=0)


def add_standalone(sub) -> None:
    from . import model

    s = sub.add_parser(
        "standalone", help="one rank of the communication a serving engine issues (no engine)",
        description="One rank of a standalone run: launch one per rank with torchrun or mpirun "
                    "(or --rank/--world/--master); each instance's first rank schedules, every "
                    "rank runs the steps' collectives over --backend and sleeps the compute "
                    "model's time. Writes OUT/rank<R>.json; `r2ccl-servebench report OUT`.")
    s.add_argument("--model", default="llama-3.1-8b",
                   help=f"a preset ({', '.join(model.PRESETS)}) or custom")
    for f in ("layers", "hidden", "heads", "kv-heads", "head-dim", "intermediate", "vocab"):
        s.add_argument(f"--{f}", type=int, help=f"the model's {f.replace('-', ' ')} (overrides "
                       "the preset's)")
    s.add_argument("--dtype", default="bf16", choices=sorted(model.DTYPE_BYTES))
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    s.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    s.add_argument("--prefill", type=int, default=0, help="prefill instances (disaggregation)")
    s.add_argument("--decode", type=int, default=0, help="decode instances (disaggregation)")
    s.add_argument("--max-batch-tokens", type=int, default=2048,
                   help="a step's token budget (chunked prefill splits longer prompts)")
    s.add_argument("--max-seqs", type=int, default=64, help="requests in a batch at most")
    s.add_argument("--compute", default="roofline:h100",
                   help="roofline:GPU (h100, h200, a100, l40s), table:FILE (tokens,ms per step) "
                        "or measure (this machine's CPU)")
    s.add_argument("--compute-scale", type=float, default=1.0,
                   help="multiplies every compute time")
    s.add_argument("--duration", type=float, default=60.0,
                   help="seconds of arrivals (with --rate)")
    s.add_argument("--drain", type=float, default=120.0,
                   help="seconds after the last arrival before unfinished requests fail")
    add_workload(s)
    s.add_argument("--backend", choices=("r2ccl", "gloo"), default="r2ccl")
    s.add_argument("--fault", action="append", default=[], metavar="SECONDS:COMMAND",
                   help="rank 0 runs COMMAND (a shell line) SECONDS into the run; repeatable")
    s.add_argument("--rank", type=int, help="this rank (else torchrun's or mpirun's variables)")
    s.add_argument("--world", type=int, help="the number of ranks")
    s.add_argument("--master", help="HOST:PORT of rank 0's store (else MASTER_ADDR/MASTER_PORT)")
    s.add_argument("--setup-timeout", type=float, default=120.0)
    s.add_argument("--comm-timeout", type=float, default=60.0,
                   help="Gloo's deadline per call (r2ccl's is R2CCL_TIMEOUT)")
    s.add_argument("--out", required=True, help="a directory for this rank's results")
    s.add_argument("--quiet", action="store_true", help="no progress line")


def run_standalone(a) -> int:
    from . import standalone

    if (a.rank is None) != (a.world is None):
        print("r2ccl-servebench: --rank and --world go together", file=sys.stderr)
        return 2
    try:
        for spec in a.fault:
            client.parse_fault(spec)
        return standalone.main(a)
    except ValueError as err:
        print(f"r2ccl-servebench: {err}", file=sys.stderr)
        return 2


def run_report(a) -> int:
    from . import report

    try:
        pcts = [float(p) for p in a.percentiles.split(",")]
        slos = metrics.parse_slos(a.slo)
        runs = []
        for spec in a.runs:
            name, sep, d = spec.partition("=")
            runs.append((name if sep else Path(spec).name, report.load(d if sep else spec)))
        sums = [(name, report.summarize(run, pcts, slos)) for name, run in runs]
    except (ValueError, OSError, KeyError) as err:
        print(f"r2ccl-servebench: {err}", file=sys.stderr)
        return 2
    print(report.table(sums))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(sums), f, indent=1)
    if a.plot:
        report.plot(runs, a.plot)
    return 0 if all(s["failed"] == 0 for _, s in sums) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="r2ccl-servebench", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    e = sub.add_parser("engine", help="against a serving engine's OpenAI-compatible API")
    e.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    e.add_argument("--model", required=True, help="the served model's name")
    add_workload(e)
    e.set_defaults(requests=100)
    e.add_argument("--token-range", type=length_range, default=(10, 999), metavar="LOW:HIGH",
                   help="prompt token ids are drawn from this range (within the vocabulary)")
    e.add_argument("--slo", default="", help='"ttft:MS tpot:MS e2el:MS": goodput counts the '
                   "requests that met all")
    e.add_argument("--percentiles", default="50,90,99")
    e.add_argument("--fault", action="append", default=[], metavar="SECONDS:COMMAND",
                   help="run COMMAND (a shell line) SECONDS into the run; repeatable")
    e.add_argument("--metrics", action="append", default=[], metavar="URL",
                   help="a Prometheus endpoint of the engine's processes (r2ccl's counters are "
                        "read before and after); repeatable")
    e.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    e.add_argument("--json", help="write the results here")
    e.add_argument("--quiet", action="store_true", help="no progress line")
    add_standalone(sub)
    r = sub.add_parser("report", help="the figures of standalone runs, side by side")
    r.add_argument("runs", nargs="+", metavar="[NAME=]DIR", help="a standalone run's --out")
    r.add_argument("--percentiles", default="50,90,99")
    r.add_argument("--slo", default="")
    r.add_argument("--plot", help="write a PNG here (needs matplotlib)")
    r.add_argument("--json", help="write the summaries here")
    a = ap.parse_args(argv)
    if a.mode == "standalone":
        return run_standalone(a)
    if a.mode == "report":
        return run_report(a)
    try:
        pcts = [float(p) for p in a.percentiles.split(",")]
        slos = metrics.parse_slos(a.slo)
        faults = tuple(client.parse_fault(f) for f in a.fault)
        reqs = workload.from_args(a)
    except (ValueError, OSError) as err:
        print(f"r2ccl-servebench: {err}", file=sys.stderr)
        return 2
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        print("r2ccl-servebench: engine mode needs aiohttp: pip install 'r2ccl[servebench]'",
              file=sys.stderr)
        return 2
    try:
        before = {u: r2ccl_counters(u) for u in a.metrics}
    except OSError as err:
        print(f"r2ccl-servebench: the metrics endpoint: {err}", file=sys.stderr)
        return 2
    results, timeline = asyncio.run(client.run(
        a.url, a.model, reqs, seed=a.seed, token_range=a.token_range, timeout_s=a.timeout,
        faults=faults, progress=None if a.quiet else sys.stderr))
    out = metrics.summarize(results, timeline["duration_s"], pcts, slos)
    out["faults"] = timeline["faults"]
    if a.metrics:
        try:
            after = {u: r2ccl_counters(u) for u in a.metrics}
        except OSError as err:  # the engine may have gone: the latencies still stand
            after = before
            out["metrics_error"] = str(err)
        out["r2ccl"] = {u: {k: v - before[u].get(k, 0.0) for k, v in after[u].items()
                            if v != before[u].get(k, 0.0)} for u in a.metrics}
    out["requests_detail"] = [
        {"index": r.index, "sent_s": round(r.sent_s, 4), "input_len": r.input_len,
         "output_tokens": r.output_tokens, "ttft_ms": round(1e3 * r.ttft(), 3) if r.ok else None,
         "e2el_ms": round(1e3 * r.e2el(), 3) if r.ok else None, "error": r.error}
        for r in results]
    brief = {k: v for k, v in out.items() if k != "requests_detail"}
    print(json.dumps(brief, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if out["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
