#!/usr/bin/python3
"""bench/servebench.py: serving latency under a NIC fault, standalone, on the netns testbed.

    bench/servebench.py BUILD_DIR [--minutes 5] [--fault-at 120] [--rate R] [--nic-rate 1gbit]
                        [--compute-scale S] [--only NAME,...] [--out DIR]      (root; /usr/bin/python3)

Two hosts of four NICs each (tests/testbed/testbed, every NIC shaped to --nic-rate). The
Llama-3.1-8B shape in bf16, Poisson arrivals for --minutes, prompts of 128-512 tokens and 64
output tokens; the compute model is an H100's roofline times --compute-scale (the testbed's
links are far slower than a GPU cluster's, so the compute is slowed with them to keep each
step's share of communication near a real deployment's). Runs, one after the other:

  tp2-r2ccl        TP = 2, one rank per host, r2ccl over the four NICs
  tp2-r2ccl-fault  the same, host 0's eth2 taken down at --fault-at seconds
  tp2-gloo         TP = 2 over Gloo on one NIC (eth1), what a user without r2ccl has
  tp2-gloo-fault   the same, that NIC taken down at --fault-at
  pd-r2ccl         1 prefill + 1 decode instance, TP = 2 each, inside a host (host 0: prefill,
                   host 1: decode), every prompt's KV cache sent across over r2ccl
  pd-r2ccl-fault   the same, host 0's eth2 taken down at --fault-at

--rate defaults to 70% of what the four links sustain for TP = 2: every token crosses them
(2 x layers + 1) x hidden x 2 bytes each way per step, so four links of --nic-rate carry
4 x rate / that many tokens a second, and a request needs input + output of them.

Writes OUT/NAME/ (each rank's results, the faults), OUT/summary.json, OUT/servebench.png and
prints the table (r2ccl-servebench report). PASS when every r2ccl run completed every request
and the runs with the fault have p99 TTFT and TPOT within 5% of the healthy run's; otherwise
FAIL, naming what missed. Exit status: 0 PASS, 1 FAIL, 2 usage, 77 no testbed here."""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTBED = REPO / "tests" / "testbed" / "testbed"
NICS = 4
LAYERS, HIDDEN = 32, 4096


def parse_rate(text: str) -> float:
    """'1gbit', '200mbit' -> bytes per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for u, f in units.items():
        if text.endswith(u):
            return float(text[: -len(u)]) * f / 8
    raise argparse.ArgumentTypeError(f"'{text}' is not a rate such as 1gbit or 200mbit")


def main() -> int:
    # A SIGTERM ends the run through the finally blocks, which destroy the testbed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build", help="build directory (its lib/ has libr2ccl.so)")
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--fault-at", type=float, default=120.0, help="seconds into the run")
    ap.add_argument("--rate", type=float, help="requests per second (default: 70%% of the links)")
    ap.add_argument("--load", type=float, default=0.7, help="the default rate's share of the links")
    ap.add_argument("--nic-rate", default="1gbit")
    ap.add_argument("--input-len", default="128:512")
    ap.add_argument("--output-len", default="64")
    ap.add_argument("--compute-scale", type=float, default=10.0)
    ap.add_argument("--only", help="comma-separated run names")
    ap.add_argument("--out", help="results directory (default: a new one under /tmp)")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("servebench: needs root (network namespaces)", file=sys.stderr)
        return 77
    lib = Path(a.build).resolve() / "lib" / "libr2ccl.so"
    if not lib.exists():
        print(f"servebench: {lib} is missing (scripts/run build)", file=sys.stderr)
        return 2
    nic_bps = parse_rate(a.nic_rate)
    lo, _, hi = a.input_len.partition(":")
    mean_in = (int(lo) + int(hi or lo)) / 2
    mean_out = int(a.output_len.partition(":")[0])
    token_bytes = (2 * LAYERS + 1) * HIDDEN * 2
    capacity = NICS * nic_bps / token_bytes / (mean_in + mean_out)
    rate = a.rate or round(a.load * capacity, 3)
    duration = 60.0 * a.minutes
    out = Path(a.out or tempfile.mkdtemp(prefix="r2ccl-servebench-"))
    out.mkdir(parents=True, exist_ok=True)
    name = f"sb{os.getpid() % 10000}"
    runs = {
        "tp2-r2ccl": ("r2ccl", "tp", False),
        "tp2-r2ccl-fault": ("r2ccl", "tp", True),
        "tp2-gloo": ("gloo", "tp", False),
        "tp2-gloo-fault": ("gloo", "tp", True),
        "pd-r2ccl": ("r2ccl", "pd", False),
        "pd-r2ccl-fault": ("r2ccl", "pd", True),
    }
    if a.only:
        unknown = set(a.only.split(",")) - set(runs)
        if unknown:
            print(f"servebench: no run named {', '.join(sorted(unknown))} ({', '.join(runs)})",
                  file=sys.stderr)
            return 2
        runs = {k: v for k, v in runs.items() if k in a.only.split(",")}
    print(f"servebench: 2 hosts x {NICS} NICs at {a.nic_rate}; Llama-3.1-8B bf16; "
          f"{a.minutes:g} min of Poisson arrivals at {rate:g}/s ({100 * rate / capacity:.0f}% of "
          f"the {capacity:.3f}/s the links sustain); results in {out}", flush=True)
    subprocess.run([str(TESTBED), "destroy", name], capture_output=True)
    r = subprocess.run([str(TESTBED), "create", name, "--hosts", "2", "--nics", str(NICS),
                        "--rate", a.nic_rate], capture_output=True, text=True)
    if r.returncode == 77:
        print(f"servebench: no testbed here: {r.stderr.strip()}", file=sys.stderr)
        return 77
    if r.returncode != 0:
        print(f"servebench: testbed create: {r.stderr.strip()}", file=sys.stderr)
        return 1
    names = []
    try:
        for i, (run, (backend, shape, fault)) in enumerate(runs.items()):
            d = out / run
            subprocess.run(["rm", "-rf", str(d)])
            d.mkdir(parents=True)
            nic = "eth1" if backend == "gloo" else "eth2"
            faults = [f"{a.fault_at:g}:{TESTBED} down {name} 0 {nic}"] if fault else []
            if shape == "tp":
                hosts, extra = [0, 1], ["--tp", "2"]
            else:
                hosts, extra = [0, 0, 1, 1], ["--tp", "2", "--prefill", "1", "--decode", "1"]
            port = 29700 + i
            env = dict(os.environ, PYTHONPATH=str(REPO / "integrations" / "python"),
                       R2CCL_LIBRARY=str(lib), R2CCL_NICS=",".join(f"eth{k + 1}" for k in range(NICS)),
                       R2CCL_SOCKET_IFNAME="eth0", GLOO_SOCKET_IFNAME="eth1")
            procs = []
            t0 = time.time()
            for rank, host in enumerate(hosts):
                argv = [str(TESTBED), "exec", name, str(host), "--", "/usr/bin/python3", "-m",
                        "r2ccl.servebench", "standalone", *extra, "--rank", str(rank), "--world",
                        str(len(hosts)), "--master", f"198.19.0.1:{port}", "--backend", backend,
                        "--rate", str(rate), "--duration", str(duration), "--input-len",
                        a.input_len, "--output-len", a.output_len, "--compute-scale",
                        str(a.compute_scale), "--drain", "120", "--out", str(d)]
                argv += [x for f in faults for x in ("--fault", f)]
                if rank:
                    argv.append("--quiet")
                procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL))
            bound = duration + 600
            for p in procs:
                try:
                    p.wait(timeout=max(bound - (time.time() - t0), 1))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            subprocess.run([str(TESTBED), "up", name, "0", nic], capture_output=True)
            print(f"servebench: {run} done in {time.time() - t0:.0f} s", flush=True)
            names.append(f"{run}={d}")
    finally:
        subprocess.run([str(TESTBED), "destroy", name], capture_output=True)
    env = dict(os.environ, PYTHONPATH=str(REPO / "integrations" / "python"))
    rep = subprocess.run(["/usr/bin/python3", "-m", "r2ccl.servebench", "report", *names,
                          "--json", str(out / "summary.json"), "--plot",
                          str(out / "servebench.png")], env=env, capture_output=True, text=True)
    print(rep.stdout, end="")
    if rep.returncode not in (0, 1):
        print(f"servebench: report failed: {rep.stderr.strip()}", file=sys.stderr)
        return 1
    summary = json.loads((out / "summary.json").read_text())
    problems = []
    for run, s in summary.items():
        if "r2ccl" in run and s["failed"]:
            problems.append(f"{run}: {s['failed']} requests failed")
    for base in ("tp2-r2ccl", "pd-r2ccl"):
        h, f = summary.get(base), summary.get(base + "-fault")
        if not h or not f:
            continue
        for key in ("p99_ttft_ms", "p99_tpot_ms"):
            if h[key] and f[key] and f[key] > 1.05 * h[key]:
                problems.append(f"{base}-fault: {key} {f[key]:.1f} is {f[key] / h[key]:.2f}x "
                                f"the healthy run's {h[key]:.1f}")
    print("\n".join(problems) or "", "FAIL" if problems else "PASS")
    print(f"servebench: {out / 'summary.json'}, {out / 'servebench.png'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
