"""SGLang's own `nixl` PD-disaggregation transfer backend moving KV through r2ccl's NIXL backend.

SGLang's server needs GPU packages, so its transfer classes are driven directly, on CPU, by
tests/nixl/sglang_pd_peer.py: `NixlKVBootstrapServer`, `NixlKVManager` (PREFILL and DECODE),
`NixlKVSender` (`init`, chunked `send`, `poll`) and `NixlKVReceiver` (`init`, `send_metadata`,
`poll`) from sglang/srt/disaggregation/nixl/conn.py, with SGLANG_DISAGGREGATION_NIXL_BACKEND=R2CCL.
The prefill runs on testbed host 0, the decode on host 1 (two network namespaces, four 100 Mbit/s
rails eth1-eth4, R2CCL_NICS=eth1,eth2,eth3,eth4); SGLang's control traffic (bootstrap HTTP, ZMQ)
uses the management NIC eth0, the KV goes over the rails. KV pools are host memory (torch CPU
tensors, 4 layers x K/V, 64 KiB pages), registered with NIXL as DRAM.

Each request (bootstrap room) pairs 16 prefill pages with 16 different decode pages (scattered
ones and contiguous runs); the prefill sends them in two chunks, the last with its aux slot. SGLang
does the transfer itself: a prepared-dlist NIXL WRITE per chunk and one for the aux data, then its
ZMQ "KV_STATUS" message. The decode checks every byte: each request's pages on every layer (K and
V) and its aux slot hold exactly the prefill's, and nothing else in the pools was written.

What is not SGLang's own code path, and why (nothing on the transfer path is replaced):
* `ServerArgs` is installed with `RuntimeContext.set_server_args` plus an explicit single-rank
  stamp (`get_parallel().override_permanently(tp_rank=0, ..., pp_group=None)`) instead of
  `publish()`, which first resolves a model's HF config; there is no model here.
* The venv lacks `gguf` (an SGLang requirement used only by GGUF weight kernels, imported through
  sglang.srt.disaggregation.utils -> configs.model_config -> layers.quantization); an empty module
  stands in for it when it is not installed.
* `KVArgs.kv_data_mem_kinds = ["DRAM", ...]`: SGLang's own field, set by its decode for host
  pools; its GPU servers leave it at VRAM.
* SGLang 0.5.23 first offers NIXL strided (Nx5) descriptors, which NIXL 1.4.0 rejects (NIXL logs
  "Nx3 shape required ..."); SGLang then falls back to per-block descriptors by itself.

Runs with the venv that has SGLang, NIXL 1.4.0 and the plugin installed, as root (namespaces):
    /tmp/ci-clone/.venv-vllm/bin/python -m pytest tests/nixl/test_sglang_nixl.py
Every wait is bounded; the peers are killed at the end of each test.
"""

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "system"))
from r2ccl_testbed import (BusyTrigger, Testbed, _base_env, _kill_tree, link_bytes,  # noqa: E402
                           random_port)

PEER = Path(__file__).resolve().parent / "sglang_pd_peer.py"
NICS = ["eth1", "eth2", "eth3", "eth4"]
RATE = "100mbit"
LAYERS, PAGES, CHUNK, PAGE_BYTES, AUX_ITEM = 4, 16, 8, 64 << 10, 256
SLACK_S = 90  # imports (8 s of CPU each, over 60 s seen) and start-up on a loaded 2-core machine: catches hangs
PREFILL, DECODE = 0, 1


def expected_bytes(requests):
    return requests * (2 * LAYERS * PAGES * PAGE_BYTES + AUX_ITEM)


def require_environment(backend):
    import importlib.util
    spec = importlib.util.find_spec("sglang")  # not imported here: that takes seconds of CPU
    conn = spec and Path(list(spec.submodule_search_locations)[0], "srt", "disaggregation", "nixl",
                             "conn.py")
    if not conn or not conn.is_file():
        pytest.skip("SGLang (with sglang/srt/disaggregation/nixl/conn.py) is not installed here")
    import nixl._bindings as b
    agent = b.nixlAgent("probe", b.nixlAgentConfig(False))
    if backend not in agent.getAvailPlugins():
        pytest.fail(f"NIXL does not offer the backend {backend}: install the plugin "
                    "(`python -m r2ccl.nixl install`) into this environment")


class Peer:
    """sglang_pd_peer.py on a testbed host; its output lines as they come."""

    def __init__(self, tb, host, role, args, env):
        full = _base_env()
        full.update({"R2CCL_NICS": ",".join(NICS), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                     "UCX_MODULES": "^ib"})  # NIXL's UCX: no IB module (segfault at exit)
        full.update(env)
        self.role = role
        self.argv = tb.exec_argv(host, ["nice", "-n", "10", sys.executable, str(PEER), role, *args])
        self.proc = subprocess.Popen(self.argv, env=full, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines = []
        self.cv = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            with self.cv:
                self.lines.append(line.rstrip("\n"))
                self.cv.notify_all()

    def text(self, skip_progress=True):
        with self.cv:
            return "\n".join(ln for ln in self.lines
                             if not (skip_progress and ln.startswith("progress ")))

    def find(self, pattern):
        rx = re.compile(pattern)
        with self.cv:
            for ln in self.lines:
                m = rx.search(ln)
                if m:
                    return m
        return None

    def progress(self):
        with self.cv:
            for ln in reversed(self.lines):
                if ln.startswith("progress "):
                    return int(ln.split()[1])
        return 0

    def kill(self):
        if self.proc.poll() is None:
            _kill_tree(self.proc)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.reader.join(timeout=5)


def both(peers):
    return "\n".join(f"--- {p.role}: {' '.join(p.argv)}\n{p.text()[-6000:]}" for p in peers)


def wait_for(peers, cond, what, timeout):
    """Waits (bounded) until cond() holds; fails if a peer exits first or on the timeout."""
    deadline = time.monotonic() + timeout
    while not cond():
        for p in peers:
            rc = p.proc.poll()
            if rc is not None and not cond():
                time.sleep(0.3)  # the reader may still be taking its last lines
                if cond():
                    return
                pytest.fail(f"{p.role} exited (rc={rc}) before {what}\n" + both(peers))
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout:.0f}s\n" + both(peers))
        time.sleep(0.05)


def start(tb, tmp_path, backend, requests, deadline, extra_env=None):
    port = random_port()
    metrics = random_port()
    bootstrap = f"{tb.mgmt_addr(PREFILL)}:{port}"
    common = ["--bootstrap", bootstrap, "--dir", str(tmp_path), "--requests", str(requests),
              "--layers", str(LAYERS), "--pages", str(PAGES), "--chunk", str(CHUNK),
              "--page-bytes", str(PAGE_BYTES), "--aux-item", str(AUX_ITEM),
              "--deadline", str(deadline)]
    env = {"SGLANG_DISAGGREGATION_NIXL_BACKEND": backend}
    if backend == "R2CCL":  # each peer reads its own plugin's Prometheus counters at the end
        common += ["--metrics-port", str(metrics)]
        env["R2CCL_METRICS_PORT"] = str(metrics)
    env.update(extra_env or {})
    p = Peer(tb, PREFILL, "prefill", ["--host-ip", tb.mgmt_addr(PREFILL), *common], env)
    d = Peer(tb, DECODE, "decode", ["--host-ip", tb.mgmt_addr(DECODE), *common], env)
    return p, d


def finish(peers, timeout):
    deadline = time.monotonic() + timeout
    for p in peers:
        try:
            rc = p.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"{p.role} did not exit within {timeout:.0f}s (a hang)\n" + both(peers))
        p.reader.join(timeout=5)
        assert rc == 0, f"{p.role} exited with rc={rc}\n" + both(peers)


def metric(peer, name, **labels):
    """The value of metric `name` whose labels include `labels` (summed over the matches)."""
    total, found = 0.0, False
    for ln in peer.text().splitlines():
        if not ln.startswith(f"metric {name}"):
            continue
        head, _, value = ln[len("metric "):].rpartition(" ")
        m = re.fullmatch(re.escape(name) + r"(?:\{(.*)\})?", head)
        if not m:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(value)
            found = True
    assert found, f"no metric {name}{labels} in the output of {peer.role}\n{peer.text()}"
    return total


def check_transfer(p, d, backend, requests):
    """Every byte of every request verified at the decode, and SGLang used `backend`."""
    peers = (p, d)
    m = d.find(r"^ok decode rooms (\d+) layers (\d+) pages (\d+) bytes (\d+) in ([\d.]+) s")
    assert m, "the decode did not verify the KV\n" + both(peers)
    assert int(m.group(1)) == requests, both(peers)
    assert int(m.group(4)) == expected_bytes(requests), both(peers)
    assert p.find(rf"^ok prefill rooms {requests}\b"), both(peers)
    for peer in peers:
        assert peer.find(rf"NIXL KVManager initialized with backend: {backend}$"), both(peers)
        assert peer.find(rf"^backend env={backend} agent_backends={backend} "), both(peers)
        assert peer.find(rf"Backend {backend} was instantiated"), both(peers)
    return int(m.group(4)), float(m.group(5))


def check_r2ccl_metrics(p, d, requests, nbytes):
    """The plugin's own counters: every SGLang WRITE (a chunk or the aux data) went through it."""
    peers = (p, d)
    writes = requests * (PAGES // CHUNK + 1)
    assert metric(p, "r2ccl_nixl_transfers_total", op="write", result="ok") == writes, both(peers)
    assert metric(p, "r2ccl_nixl_transfers_total", op="write", result="failed") == 0, both(peers)
    assert metric(p, "r2ccl_nixl_transfer_bytes_total") == nbytes, both(peers)
    assert metric(d, "r2ccl_nixl_transfers_total", op="write", result="ok") == 0, both(peers)
    tx = {n: metric(p, "r2ccl_rail_tx_bytes_total", device=n) for n in NICS}
    rx = {n: metric(d, "r2ccl_rail_rx_bytes_total", device=n) for n in NICS}
    assert sum(tx.values()) >= nbytes and sum(rx.values()) >= nbytes, (tx, rx, nbytes)
    return tx, rx


def no_r2ccl_complaints(peers):
    for peer in peers:
        bad = [ln for ln in peer.text().splitlines()
               if ln.startswith("r2ccl[") and (" warn: " in ln or " error: " in ln)]
        assert not bad, f"r2ccl warned in {peer.role}:\n" + "\n".join(bad[:20])


def test_sglang_nixl_kv_through_r2ccl_every_byte(tmp_path):
    require_environment("R2CCL")
    requests = 8
    with Testbed(hosts=2, nics=4, rate=RATE) as tb:
        p, d = start(tb, tmp_path, "R2CCL", requests, deadline=SLACK_S + 30)
        try:
            finish((p, d), timeout=SLACK_S + 45)
        finally:
            for x in (p, d):
                x.kill()
    nbytes, took = check_transfer(p, d, "R2CCL", requests)
    tx, _ = check_r2ccl_metrics(p, d, requests, nbytes)
    # Healthy: the KV was spread over every rail.
    assert all(v > nbytes / 8 for v in tx.values()), tx
    no_r2ccl_complaints((p, d))
    print(f"R2CCL: {requests} requests, {nbytes} bytes verified in {took:.2f} s; "
          f"rail tx bytes {tx}")


def test_sglang_nixl_kv_through_r2ccl_nic_down_mid_transfer(tmp_path):
    require_environment("R2CCL")
    requests = 24
    with Testbed(hosts=2, nics=4, rate=RATE) as tb:
        p, d = start(tb, tmp_path, "R2CCL", requests, deadline=SLACK_S + 60)
        try:
            # The prefill's eth2 goes down while it carries KV, after a few requests are done.
            wait_for((p, d), lambda: d.progress() >= 3, "3 requests received", SLACK_S + 30)
            trigger = BusyTrigger(tb.ns(PREFILL), "eth2",
                                  ["ip", "-n", tb.ns(PREFILL), "link", "set", "eth2", "down"],
                                  delay=0.0, max_wait=3.0).start()
            trigger.finish(timeout=40)
            at_fault = d.progress()
            finish((p, d), timeout=SLACK_S + 60)
        finally:
            for x in (p, d):
                x.kill()
    assert trigger.result is not None and trigger.result.returncode == 0, trigger.result
    assert trigger.busy, "eth2 carried no KV when it was to go down\n" + both((p, d))
    nbytes, took = check_transfer(p, d, "R2CCL", requests)
    tx, _ = check_r2ccl_metrics(p, d, requests, nbytes)
    # The fault hit the stream, not its end: several requests were sent after it.
    assert at_fault <= requests - 4, f"only {requests - at_fault} requests after the fault"
    # r2ccl saw eth2 go down and carried the rest on the other rails.
    eth2_down = metric(p, "r2ccl_rail_state", device="eth2", state="down")
    failovers = metric(p, "r2ccl_rail_failovers_total", device="eth2")
    assert eth2_down == 1 or failovers >= 1, both((p, d))
    logs = [ln for x in (p, d) for ln in x.text().splitlines() if ln.startswith("r2ccl[")]
    print("\n".join(logs[:12]))
    print(f"R2CCL, eth2 down after {at_fault} of {requests} requests: {nbytes} bytes verified "
          f"in {took:.2f} s; eth2 down={eth2_down:.0f} failovers={failovers:.0f}; rail tx {tx}")


def test_sglang_nixl_kv_through_ucx_for_comparison(tmp_path):
    """The same transfer with NIXL's UCX backend: a report for comparison, and a check of this
    harness (SGLang's classes move and verify the KV with NIXL's reference backend too).

    UCX is held to TCP over the rails (UCX_TLS=tcp, UCX_NET_DEVICES=eth1..eth4; it was seen to
    use two of them, eth1 and eth2, UCX_MAX_RNDV_RAILS=4 or not): left to itself it
    sees both namespaces as one node (one kernel) and moves the KV through shared memory / CMA,
    with no byte on any NIC; with UCX_TLS=tcp alone it takes eth0 (the unshaped management NIC)
    and eth1."""
    require_environment("UCX")
    requests = 8
    nics = ["eth0", *NICS]
    with Testbed(hosts=2, nics=4, rate=RATE) as tb:
        before = {n: link_bytes(tb.ns(PREFILL), n) for n in nics}
        p, d = start(tb, tmp_path, "UCX", requests, deadline=SLACK_S + 30,
                     extra_env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": ",".join(NICS)})
        try:
            finish((p, d), timeout=SLACK_S + 45)
        finally:
            for x in (p, d):
                x.kill()
        moved = {n: link_bytes(tb.ns(PREFILL), n) - before[n] for n in nics}
    nbytes, took = check_transfer(p, d, "UCX", requests)
    assert sum(moved[n] for n in NICS) >= nbytes, f"the KV did not cross the rails: {moved}"
    print(f"UCX (tcp over {','.join(NICS)}): {requests} requests, {nbytes} bytes verified in "
          f"{took:.2f} s; NIC bytes (tx+rx) at the prefill {moved}")
