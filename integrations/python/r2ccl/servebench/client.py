"""Engine mode: the requests of a workload sent to a serving engine's OpenAI-compatible
completions endpoint at their arrival times, each streamed, timed on arrival of every chunk.
Prompts are token ids (so their lengths are exact whatever the tokenizer), greedy, with
`ignore_eos` so that every request produces the tokens it asked for. Faults are commands run at
given times, from outside the engine (for example `ip link set eth1 down` in a host's
namespace)."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass

from .metrics import Result
from .workload import Request

# What one streamed line may hold: a longer one is an error of the server's.
MAX_LINE = 1 << 20


@dataclass(frozen=True)
class Fault:
    at_s: float
    command: str


def parse_fault(text: str) -> Fault:
    at, sep, command = text.partition(":")
    try:
        at_s = float(at)
    except ValueError:
        at_s = -1.0
    if not sep or at_s < 0 or not command.strip():
        raise ValueError(f"fault '{text}': expected SECONDS:COMMAND (e.g. 120:ip link set eth1 "
                         "down)")
    return Fault(at_s, command)


def prompt_ids(req: Request, seed: int, token_range: tuple[int, int]) -> list[int]:
    rng = random.Random(seed * 1_000_003 + req.index)
    lo, hi = token_range
    return [rng.randint(lo, hi) for _ in range(req.input_len)]


async def _one(session, url: str, model: str, req: Request, t0: float, seed: int,
               token_range: tuple[int, int], timeout_s: float) -> Result:
    import aiohttp
    body = {"model": model, "prompt": prompt_ids(req, seed, token_range),
            "max_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    res = Result(req.index, time.monotonic() - t0, req.input_len)
    chunks = 0
    try:
        async with session.post(url, json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                text = (await resp.text())[:200]
                res.error = f"HTTP {resp.status}: {text}"
                return res
            async for raw in resp.content:
                if len(raw) > MAX_LINE:
                    res.error = f"a streamed line of {len(raw)} bytes"
                    return res
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                msg = json.loads(data)
                now = time.monotonic() - t0
                choices = msg.get("choices") or []
                if any(c.get("text") for c in choices):
                    res.chunk_s.append(now)
                    chunks += 1
                usage = msg.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    res.output_tokens = int(usage["completion_tokens"])
    except asyncio.TimeoutError:
        res.error = f"no answer within {timeout_s:g} s"
    except Exception as e:  # noqa: BLE001 (a request's failure is a result, not the run's)
        res.error = f"{type(e).__name__}: {e}"
    if not res.output_tokens:
        res.output_tokens = chunks
    if not res.error and res.output_tokens < req.output_len:
        res.error = f"{res.output_tokens} of {req.output_len} tokens"
    return res


async def run(base_url: str, model: str, requests: list[Request], *, seed: int = 0,
              token_range: tuple[int, int] = (10, 999), timeout_s: float = 600.0,
              faults: tuple[Fault, ...] = (), progress=sys.stderr) -> tuple[list[Result], dict]:
    """Sends every request at its time; returns the results and the run's timeline (start,
    faults applied, duration)."""
    import aiohttp
    url = base_url.rstrip("/") + "/v1/completions"
    timeline: dict = {"faults": []}
    results: list[Result] = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.monotonic()

        async def send(req: Request) -> None:
            await asyncio.sleep(max(0.0, req.arrival_s - (time.monotonic() - t0)))
            results.append(await _one(session, url, model, req, t0, seed, token_range,
                                      timeout_s))

        async def fault(f: Fault) -> None:
            await asyncio.sleep(max(0.0, f.at_s - (time.monotonic() - t0)))
            at = time.monotonic() - t0
            p = await asyncio.create_subprocess_shell(
                f.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            out, _ = await p.communicate()
            timeline["faults"].append({"at_s": round(at, 3), "command": f.command,
                                       "exit": p.returncode,
                                       "output": out.decode(errors="replace")[-300:]})

        async def report() -> None:
            while True:
                await asyncio.sleep(1.0)
                done = [r for r in results if r.ok]
                ttfts = sorted(r.ttft() for r in done)
                p50 = f"{1e3 * ttfts[len(ttfts) // 2]:.0f} ms" if ttfts else "-"
                print(f"servebench: {time.monotonic() - t0:6.1f} s, {len(results)}/"
                      f"{len(requests)} answered, {len(results) - len(done)} failed, "
                      f"p50 TTFT {p50}", file=progress, flush=True)

        reporter = asyncio.ensure_future(report()) if progress is not None else None
        await asyncio.gather(*(send(r) for r in requests), *(fault(f) for f in faults))
        if reporter is not None:
            reporter.cancel()
        timeline["duration_s"] = time.monotonic() - t0
    results.sort(key=lambda r: r.index)
    return results, timeline
