"""The requests of a serving benchmark: when each arrives, how long its prompt is and how many
tokens it asks for. From an arrival process (Poisson at a rate, or gamma-distributed gaps for
burstier traffic, as `vllm bench serve --burstiness` draws them) or from a trace in the format
of Mooncake's published traces (JSON lines with `timestamp` in milliseconds, `input_length`,
`output_length`)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

# A bound on what one trace line may ask for: larger values are an error, not a workload.
MAX_TOKENS = 1 << 20


@dataclass(frozen=True)
class Request:
    index: int
    arrival_s: float  # after the start of the run
    input_len: int
    output_len: int


def _length(spec: tuple[int, int], rng: random.Random) -> int:
    lo, hi = spec
    return lo if lo == hi else rng.randint(lo, hi)


def poisson(count: int, rate: float, input_len: tuple[int, int], output_len: tuple[int, int],
            burstiness: float = 1.0, seed: int = 0) -> list[Request]:
    """`count` requests at `rate` per second on average: gaps drawn from a gamma distribution of
    shape `burstiness` (1: exponential, so Poisson arrivals; below 1 burstier), then scaled so
    that the last arrives at count / rate, as vLLM's benchmark does. Lengths uniform in the
    closed ranges given."""
    if count <= 0:
        raise ValueError(f"the number of requests must be positive, not {count}")
    if not rate > 0 or math.isinf(rate):
        raise ValueError(f"the request rate must be a positive finite number, not {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive, not {burstiness}")
    for name, (lo, hi) in (("input", input_len), ("output", output_len)):
        if not 1 <= lo <= hi <= MAX_TOKENS:
            raise ValueError(f"{name} length range {lo}-{hi} is not within 1-{MAX_TOKENS}")
    rng = random.Random(seed)
    gaps = [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(count)]
    total = sum(gaps)
    scale = (count / rate) / total if total > 0 else 0.0
    t = 0.0
    out = []
    for i, g in enumerate(gaps):
        t += g * scale
        out.append(Request(i, t, _length(input_len, rng), _length(output_len, rng)))
    return out


def mooncake_trace(path: str | Path, time_scale: float = 1.0, limit: int | None = None,
                   max_input: int = MAX_TOKENS, max_output: int = MAX_TOKENS) -> list[Request]:
    """The requests of a Mooncake trace (one JSON object a line: `timestamp` in milliseconds,
    `input_length`, `output_length`; other fields ignored), arrival times relative to the first
    and multiplied by `time_scale`, lengths capped at `max_input` / `max_output` (a serving
    engine's model length). A line that is not such an object is an error naming it."""
    if not time_scale > 0:
        raise ValueError(f"the time scale must be positive, not {time_scale}")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(rows) >= limit:
                break
            where = f"{path}, line {n}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{where}: not a JSON object")
            values = []
            for key in ("timestamp", "input_length", "output_length"):
                v = rec.get(key)
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ValueError(f"{where}: '{key}' is missing or not a number")
                if v < 0 or (key != "timestamp" and (v != int(v) or not 1 <= v <= MAX_TOKENS)):
                    raise ValueError(f"{where}: '{key}' is {v}, out of range")
                values.append(v)
            rows.append(values)
    if not rows:
        raise ValueError(f"{path}: no requests")
    start = min(r[0] for r in rows)
    reqs = [Request(0, (ts - start) / 1000.0 * time_scale, min(int(i), max_input),
                    min(int(o), max_output)) for ts, i, o in rows]
    reqs.sort(key=lambda r: r.arrival_s)
    return [Request(i, r.arrival_s, r.input_len, r.output_len) for i, r in enumerate(reqs)]


def from_args(a) -> list[Request]:
    """The requests r2ccl-servebench's options ask for: a trace when --trace is given, else
    --requests Poisson arrivals at --rate (when --requests is 0: rate x --duration of them)."""
    if a.trace:
        return mooncake_trace(a.trace, a.time_scale, a.requests or None, a.max_input,
                              a.max_output)
    count = a.requests or max(1, round(a.rate * getattr(a, "duration", 0.0)))
    return poisson(count, a.rate, a.input_len, a.output_len, a.burstiness, a.seed)
