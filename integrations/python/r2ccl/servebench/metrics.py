"""Serving latency from the client's side, defined as `vllm bench serve` defines it, so that the
figures compare:
- TTFT: from sending a request to its first streamed token;
- TPOT: per request, (end-to-end latency - TTFT) / (output tokens - 1); 0 for one token;
- ITL: every gap between two streamed chunks of a request, all requests' gaps pooled;
- E2EL: from sending a request to its last token;
- goodput: requests per second that met every SLO given (ttft, tpot, e2el, in ms).
Percentiles interpolate linearly between the closest ranks (numpy's default)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class Result:
    """One request as the client saw it: times in seconds from the start of the run."""
    index: int
    sent_s: float
    input_len: int
    chunk_s: list[float] = field(default_factory=list)  # arrival of each chunk with tokens
    output_tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.chunk_s)

    def ttft(self) -> float:
        return self.chunk_s[0] - self.sent_s

    def e2el(self) -> float:
        return self.chunk_s[-1] - self.sent_s

    def tpot(self) -> float:
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2el() - self.ttft()) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (0-100) of `values`, interpolated linearly; NaN when empty."""
    if not values:
        return math.nan
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} is not within 0-100")
    v = sorted(values)
    pos = (len(v) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def parse_slos(text: str) -> dict[str, float]:
    """"ttft:500 tpot:50" (milliseconds, as vLLM's --goodput takes them) as {key: seconds}."""
    out: dict[str, float] = {}
    for item in text.split():
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"SLO '{item}': expected KEY:MILLISECONDS with KEY one of "
                             f"{', '.join(SLO_KEYS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"SLO '{item}': '{value}' is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"SLO '{item}': the bound must be positive")
        out[key] = ms / 1000.0
    return out


def meets(r: Result, slos: dict[str, float]) -> bool:
    measured = {"ttft": r.ttft(), "tpot": r.tpot(), "e2el": r.e2el()}
    return r.ok and all(measured[k] <= bound for k, bound in slos.items())


def summarize(results: list[Result], duration_s: float, percentiles=(50, 90, 99),
              slos: dict[str, float] | None = None) -> dict:
    """The run's figures: counts, throughput, and for TTFT, TPOT, ITL and E2EL the mean and the
    percentiles asked for, in milliseconds."""
    done = [r for r in results if r.ok]
    series = {
        "ttft": [r.ttft() for r in done],
        "tpot": [r.tpot() for r in done if r.output_tokens > 1],
        "itl": [g for r in done for g in r.itls()],
        "e2el": [r.e2el() for r in done],
    }
    out: dict = {
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": round(duration_s, 3),
        "input_tokens": sum(r.input_len for r in done),
        "output_tokens": sum(r.output_tokens for r in done),
    }
    if duration_s > 0:
        out["request_throughput"] = round(len(done) / duration_s, 4)
        out["output_throughput"] = round(out["output_tokens"] / duration_s, 2)
    for name, values in series.items():
        out[f"mean_{name}_ms"] = round(1e3 * sum(values) / len(values), 3) if values else None
        for p in percentiles:
            q = percentile(values, p)
            out[f"p{p:g}_{name}_ms"] = None if math.isnan(q) else round(1e3 * q, 3)
    if slos:
        good = sum(1 for r in done if meets(r, slos))
        out["slos_ms"] = {k: v * 1e3 for k, v in slos.items()}
        out["good_requests"] = good
        out["goodput"] = round(good / duration_s, 4) if duration_s > 0 else None
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            msg = r.error or "no token streamed"
            errors[msg] = errors.get(msg, 0) + 1
    if errors:
        out["errors"] = errors
    return out
