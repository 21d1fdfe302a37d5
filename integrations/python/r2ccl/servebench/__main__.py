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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="r2ccl-servebench", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    e = sub.add_parser("engine", help="against a serving engine's OpenAI-compatible API")
    e.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    e.add_argument("--model", required=True, help="the served model's name")
    e.add_argument("--requests", type=int, default=100)
    e.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    e.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 Poisson, below 1 burstier")
    e.add_argument("--input-len", type=length_range, default=(128, 128), metavar="N|LOW:HIGH")
    e.add_argument("--output-len", type=length_range, default=(32, 32), metavar="N|LOW:HIGH")
    e.add_argument("--trace", help="a Mooncake-format trace (JSON lines) instead of --rate")
    e.add_argument("--time-scale", type=float, default=1.0,
                   help="multiplies the trace's arrival times")
    e.add_argument("--max-input", type=int, default=workload.MAX_TOKENS,
                   help="caps a trace's input lengths (the model's length)")
    e.add_argument("--max-output", type=int, default=workload.MAX_TOKENS)
    e.add_argument("--seed", type=int, default=0)
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
    a = ap.parse_args(argv)
    try:
        pcts = [float(p) for p in a.percentiles.split(",")]
        slos = metrics.parse_slos(a.slo)
        faults = tuple(client.parse_fault(f) for f in a.fault)
        if a.trace:
            reqs = workload.mooncake_trace(a.trace, a.time_scale, a.requests, a.max_input,
                                           a.max_output)
        else:
            reqs = workload.poisson(a.requests, a.rate, a.input_len, a.output_len, a.burstiness,
                                    a.seed)
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
