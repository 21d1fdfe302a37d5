"""r2ccl's NIXL backend under rail faults, through NIXL's agent API (the 1.4.0 wheel).

Two testbed hosts x four NICs at 100 Mbit/s; host 0 runs the target agent, host 1 the initiator
(tests/nixl/nixl_peer.py): 1 MiB READs and WRITEs with notifications, 8 in flight, every READ
checked byte for byte at the initiator, every WRITE at the target when its notification comes,
every notification counted (exactly once). Faults come from outside, while host 0's eth2 carries
data: a NIC down, black-holed (nftables), flapped; or every NIC of host 0 down past
R2CCL_TIMEOUT, which must give an error (no hang), after which the same agents transfer again
once the NICs are back.

Runs in the environment of `scripts/run vllm-test` (NIXL's wheel, the plugin installed into it
with `python -m r2ccl.nixl install`), as root (network namespaces).
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "system"))
from r2ccl_testbed import TESTBED, BusyTrigger, Testbed, _base_env  # noqa: E402
from test_endpoint import Tool  # noqa: E402

PEER = Path(__file__).resolve().parent / "nixl_peer.py"
NICS = ["eth1", "eth2", "eth3", "eth4"]
RATE = "100mbit"
SLACK_S = 40  # start-up and shutdown on a loaded 2-core machine: catches hangs only


def plugin_installed():
    from nixl._api import nixl_agent  # noqa: F401  (the wheel itself must import)
    import nixl._bindings as b
    agent = b.nixlAgent("probe", b.nixlAgentConfig(False))
    if "R2CCL" not in agent.getAvailPlugins():
        pytest.fail("NIXL does not offer the backend R2CCL: run `python -m r2ccl.nixl install` "
                    "in this environment")


class Peer(Tool):
    """nixl_peer.py on a testbed host (test_endpoint.Tool's line reading and waiting)."""

    def __init__(self, tb, host, args, env=None):  # pylint: disable=super-init-not-called
        import subprocess as sp
        import threading
        full = _base_env()
        full.update({"R2CCL_NICS": ",".join(NICS), "PYTHONUNBUFFERED": "1"})
        full.update(env or {})
        self.argv = tb.exec_argv(host, [sys.executable, str(PEER), *args])
        self.proc = sp.Popen(self.argv, env=full, stdout=sp.PIPE, stderr=sp.STDOUT, text=True)
        self.lines = []
        self.cv = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def progress(self):
        with self.cv:
            for ln in reversed(self.lines):
                if ln.startswith("progress "):
                    return int(ln.split()[1])
        return 0


def start(tb, tmp_path, transfers, backend="R2CCL", env=None, target_args=(), init_args=()):
    common = ["--dir", str(tmp_path), "--backend", backend, "--transfers", str(transfers)]
    t = Peer(tb, 0, ["target", *common, *target_args], env)
    i = Peer(tb, 1, ["initiator", *common, *init_args], env)
    return t, i


def both(procs):
    out = []
    for p in procs:
        with p.cv:
            lines = [ln for ln in p.lines if not ln.startswith("progress ")][-40:]
        out.append(f"--- {' '.join(p.argv)}\n" + "\n".join(lines))
    return "\n".join(out)


def busy(procs, initiator, min_bytes=8 << 20, timeout=SLACK_S):
    deadline = time.monotonic() + timeout
    while initiator.progress() < min_bytes:
        if time.monotonic() > deadline or any(p.proc.poll() is not None for p in procs):
            pytest.fail(f"no stream of {min_bytes} bytes within {timeout}s\n" + both(procs))
        time.sleep(0.05)


def finish_ok(procs, timeout):
    deadline = time.monotonic() + timeout
    for p in procs:
        rc = p.finish(timeout=max(1.0, deadline - time.monotonic()))
        assert rc == 0, f"rc={rc}\n" + both(procs)
    procs[0].wait_line(r"^ok notifications (\d+) each once$", timeout=1)
    procs[1].wait_line(r"^ok transfers (\d+) bytes (\d+)$", timeout=1)


def scrape(tb, host, port):
    """The Prometheus text a peer serves on its host's loopback."""
    code = (f"import urllib.request; print(urllib.request.urlopen("
            f"'http://127.0.0.1:{port}/metrics', timeout=5).read().decode())")
    r = subprocess.run(tb.exec_argv(host, [sys.executable, "-c", code]), capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


def metric(text, name, **labels):
    """The sum of `name`'s samples whose labels include `labels`."""
    total = 0.0
    for ln in text.splitlines():
        if not ln.startswith(name + "{") and not ln.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in ln for k, v in labels.items()):
            total += float(ln.rsplit(" ", 1)[1])
    return total


def run_with_fault(tb, tmp_path, fault, transfers=400, metrics_port=None):
    plugin_installed()
    env = {"R2CCL_METRICS_PORT": str(metrics_port)} if metrics_port else None
    procs = start(tb, tmp_path, transfers, env=env, init_args=["--deadline", "150"],
                  target_args=["--deadline", "170"])
    try:
        busy(procs, procs[1])
        trigger = BusyTrigger(tb.ns(0), "eth2", fault, delay=0.0, max_wait=3.0).start()
        trigger.finish(timeout=40)
        at_fault = procs[1].progress()
        if metrics_port:
            time.sleep(1.5)  # detection, failover and some transfers after them
            procs[1].metrics = scrape(tb, 1, metrics_port)
        finish_ok(procs, timeout=150 + SLACK_S)
    finally:
        for p in procs:
            p.kill()
    assert trigger.result is not None and trigger.result.returncode == 0, trigger.result
    # The fault hit the stream, not its end: most transfers came after it.
    assert procs[1].progress() > at_fault + (64 << 20), both(procs)
    return procs


def test_healthy_reads_and_writes_every_byte_and_notification(tmp_path):
    plugin_installed()
    with Testbed(hosts=2, nics=4, rate=RATE) as tb:
        procs = start(tb, tmp_path, 160, init_args=["--deadline", "90"],
                      target_args=["--deadline", "110"])
        try:
            finish_ok(procs, timeout=110 + SLACK_S)
        finally:
            for p in procs:
                p.kill()
    for p in procs:
        assert "WARN" not in p.text() and "ERROR" not in p.text(), both(procs)


def test_nic_down_mid_transfer(tmp_path):
    with Testbed(hosts=2, nics=4, rate=RATE) as tb:
        procs = run_with_fault(tb, tmp_path, ["ip", "-n", tb.ns(0), "link", "set", "eth2", "down"],
                               metrics_port=19531)
    # r2ccl's metrics from inside the initiator's process (R2CCL_METRICS_PORT): the rail to the
    # target's eth2 failed over, and NIXL's transfers went on.
    text = procs[1].metrics
    assert metric(text, "r2ccl_rail_failovers_total", remote_device="eth2") >= 1, text
    assert metric(text, "r2ccl_rail_up", remote_device="eth2") == 0, text
    assert metric(text, "r2ccl_nixl_transfers_total", op="write", result="ok") > 0, text
    assert metric(text, "r2ccl_nixl_transfers_total", op="read", result="ok") > 0, text
    assert metric(text, "r2ccl_nixl_transfers_total", result="failed") == 0, text
    # At the end (the initiator's own scrape): every transfer ok, and those in flight on the
    # failed rail counted as preserved.
    m = procs[1].wait_line(r"^metrics (.*)$", timeout=1)
    final = dict(kv.rsplit("=", 1) for kv in m.group(1).split())
    assert float(final['r2ccl_nixl_transfers_total{op="write",result="ok"}']) == 200, final
    assert float(final['r2ccl_nixl_transfers_total{op="read",result="ok"}']) == 200, final
    assert float(final["r2ccl_nixl_transfers_preserved_total"]) >= 1, final


def test_nic_black_holed_mid_transfer(tmp_path):
    with Testbed(hosts=2, nics=4, rate=RATE) as tb:
        run_with_fault(tb, tmp_path, [str(TESTBED), "blackhole", tb.name, "0", "eth2"])


def test_nic_flapped_mid_transfer(tmp_path):
    with Testbed(hosts=2, nics=4, rate=RATE) as tb:
        run_with_fault(tb, tmp_path, [str(TESTBED), "flap", tb.name, "0", "eth2", "300", "3000"])


def test_every_nic_down_past_the_timeout_is_an_error_then_the_peer_works_again(tmp_path):
    plugin_installed()
    timeout_s = 3
    env = {"R2CCL_TIMEOUT": f"{timeout_s}s"}
    with Testbed(hosts=2, nics=4, rate=RATE) as tb:
        procs = start(tb, tmp_path, 0, env=env,
                      init_args=["--expect-failure", "--after", "20", "--deadline", "150"],
                      target_args=["--open-ended", "--deadline", "170"])
        try:
            busy(procs, procs[1])
            down = " && ".join(f"ip -n {tb.ns(0)} link set {n} down" for n in NICS)
            r = subprocess.run(["sh", "-c", down], capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stderr
            t_down = time.monotonic()
            m = procs[1].wait_line(r"^failed (\d+) after ([\d.]+) s: (.*)$",
                                   timeout=2 * timeout_s + SLACK_S)
            took = time.monotonic() - t_down
            up = " && ".join(f"ip -n {tb.ns(0)} link set {n} up" for n in NICS)
            r = subprocess.run(["sh", "-c", up], capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stderr
            (tmp_path / "restored").touch()
            rc = procs[1].finish(timeout=150 + SLACK_S)
            assert rc == 0, f"rc={rc}\n" + both(procs)
            procs[1].wait_line(r"^ok after-restore 20$", timeout=1)
            assert procs[0].finish(timeout=SLACK_S) == 0, both(procs)
        finally:
            for p in procs:
                p.kill()
    print(f"failed {took:.1f} s after every NIC went down: {m.group(3)}")
    # An error of the backend (the peer stays loaded), not a disconnect, naming the rails.
    assert "nixlBackendError" in m.group(3), both(procs)
    assert took < 2 * timeout_s + 25, both(procs)
    text = procs[1].text()
    assert "no rail to agent 'target' has worked" in text or "no usable rail" in text or \
        "write to agent 'target'" in text, both(procs)
