"""r2ccl-monitor as a process.

* Anywhere: command-line errors (exit 2, naming the culprit), a scrape over loopback with a
  probe to its own echo responder, clean exit on SIGTERM.
* On the netns testbed (2 hosts x 2 NICs): a monitor on each host probing the other over both
  rails, a real Prometheus server (the Debian `prometheus` binary) in host 0 scraping both
  monitors every second with deploy/prometheus/r2ccl-alerts.yml loaded. A NIC taken down, then
  a black-holed NIC, must show through PromQL (/api/v1/query) on exactly the right devices, and
  clear again after the fault.

Every wait is bounded; everything started is killed at the end.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prom_harness import (PROMETHEUS, http_get, metric_value,  # noqa: E402
                          prometheus_config, start_prometheus, wait_until)
from r2ccl_testbed import BIN_DIR, Testbed, free_port, random_port, wait_for_binary  # noqa: E402

MONITOR = BIN_DIR / "r2ccl-monitor"
FAMILIES = [
    "r2ccl_nic_up", "r2ccl_nic_degraded", "r2ccl_nic_carrier_changes_total",
    "r2ccl_nic_speed_bytes_per_second", "r2ccl_nic_rx_bytes_total", "r2ccl_nic_tx_bytes_total",
    "r2ccl_nic_errors_total", "r2ccl_nic_probe_rtt_seconds", "r2ccl_nic_probe_loss_ratio",
    "r2ccl_build_info",
]


# ------------------------------------------------------------------------------- helpers


@pytest.fixture
def monitor() -> Path:
    return wait_for_binary(MONITOR)


def run_monitor(args: Sequence[str], timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run([str(MONITOR), *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, check=False)


# ---------------------------------------------------------------------- anywhere (loopback)


def test_command_line_errors(monitor):
    r = run_monitor([])
    assert r.returncode == 2 and "--listen" in r.stderr, r.stderr

    r = run_monitor(["--listen", "127.0.0.1:1", "--nics", "lo,nosuchnic0"])
    assert r.returncode == 2, r.stderr
    assert "unknown NIC 'nosuchnic0'" in r.stderr, r.stderr

    r = run_monitor(["--listen", "127.0.0.1:1", "--probe", "nosuchnic1=127.0.0.1"])
    assert r.returncode == 2 and "nosuchnic1" in r.stderr, r.stderr

    r = run_monitor(["--listen", "127.0.0.1:1", "--probe", "lo=not.an.ip"])
    assert r.returncode == 2 and "lo=not.an.ip" in r.stderr, r.stderr

    r = run_monitor(["--listen", "999.1.1.1:9464"])
    assert r.returncode == 2 and "999.1.1.1:9464" in r.stderr, r.stderr

    r = run_monitor(["--listen", "127.0.0.1:9464", "--probe-interval", "fast"])
    assert r.returncode == 2 and "--probe-interval 'fast'" in r.stderr, r.stderr

    r = run_monitor(["--help"])
    assert r.returncode == 0 and "--probe" in r.stdout, r.stdout


def test_port_in_use(monitor):
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
        s.listen(1)
        r = run_monitor(["--listen", f"127.0.0.1:{port}", "--echo-port", "0"])
    assert r.returncode == 2, r.stderr
    assert f"127.0.0.1:{port}" in r.stderr and "already in use" in r.stderr, r.stderr


def test_loopback_scrape_probe_and_clean_exit(monitor, procs):
    port = free_port()
    echo = free_port()  # a TCP port free now; the UDP one is very likely free too
    argv = [str(monitor), "--listen", f"127.0.0.1:{port}", "--echo-port", str(echo), "--nics",
            "lo", "--probe", "lo=127.0.0.1", "--probe-interval", "20ms", "--probe-window", "10"]
    p = procs.start("monitor", argv)
    base = f"http://127.0.0.1:{port}"

    def healthy():
        try:
            return http_get(base + "/healthz", 1.0) == (200, "ok\n")
        except OSError:
            return p.poll() is not None and pytest.fail("r2ccl-monitor exited\n" + procs.logs())
    wait_until("/healthz", healthy, limit=15, context=procs.logs)

    def probed():
        text = http_get(base + "/metrics")[1]
        loss = metric_value(text, 'r2ccl_nic_probe_loss_ratio{device="lo",peer="127.0.0.1"}')
        rtt = metric_value(text, 'r2ccl_nic_probe_rtt_seconds{device="lo",peer="127.0.0.1"}')
        return text if loss == 0.0 and rtt is not None else None
    text = wait_until("an answered probe over loopback", probed, limit=15, context=procs.logs)
    for family in FAMILIES:
        assert f"# HELP {family} " in text, family
    assert metric_value(text, 'r2ccl_nic_up{device="lo"}') == 1.0
    assert metric_value(text, 'r2ccl_nic_degraded{device="lo"}') == 0.0

    # A second monitor cannot take the same echo port.
    r = run_monitor(["--listen", f"127.0.0.1:{free_port()}", "--echo-port", str(echo)])
    assert r.returncode == 2 and f"UDP echo port {echo}" in r.stderr, r.stderr

    assert procs.stop(p) == 0, procs.logs()
    assert "shutting down" in procs.logs()


# ------------------------------------------------------------------- testbed + Prometheus


def test_testbed_nic_down_and_blackhole_seen_by_prometheus(monitor, procs, tmp_path):
    if not PROMETHEUS.exists():
        pytest.skip(f"{PROMETHEUS} not found (Debian package 'prometheus'; scripts/run installs it)")
    with Testbed(hosts=2, nics=2) as tb:
        mport, pport = random_port(), random_port()
        while pport == mport:
            pport = random_port()
        common = ["--probe-interval", "100ms", "--probe-timeout", "500ms", "--probe-window", "10"]
        # Host 0 exports its two rails; host 1 every non-loopback interface (eth0 too).
        m0 = procs.start("monitor-h0", tb.exec_argv(0, [
            str(monitor), "--listen", f"127.0.0.1:{mport}", "--nics", "eth1,eth2",
            "--probe", f"eth1={tb.addr(1, 1)}", "--probe", f"eth2={tb.addr(1, 2)}", *common]))
        m1 = procs.start("monitor-h1", tb.exec_argv(1, [
            str(monitor), "--listen", f"{tb.mgmt_addr(1)}:{mport}",
            "--probe", f"eth1={tb.addr(0, 1)}", "--probe", f"eth2={tb.addr(0, 2)}", *common]))

        # Start-up errors inside the namespace: an address that is not host 1's.
        r = tb.run(1, [str(monitor), "--listen", f"198.18.9.9:{mport}", "--echo-port", "0"])
        assert r.returncode == 2 and "198.18.9.9 is not an address of this host" in r.stderr, \
            r.stderr

        cfg = tmp_path / "prometheus.yml"
        prometheus_config(cfg, {"h0": f"127.0.0.1:{mport}", "h1": f"{tb.mgmt_addr(1)}:{mport}"})
        q = start_prometheus(procs, tb, cfg, tmp_path / "tsdb", pport)
        ctx = procs.logs

        wait_until("Prometheus scraping both monitors",
                   lambda: len(q.vector('up{job="r2ccl-monitor"} == 1') or []) == 2, context=ctx)
        assert q.devices("r2ccl_nic_up") == {("h0", "eth1"), ("h0", "eth2"), ("h1", "eth0"),
                                             ("h1", "eth1"), ("h1", "eth2")}, ctx()
        wait_until("every probe answered, nothing down or degraded",
                   lambda: len(q.vector("r2ccl_nic_probe_loss_ratio == 0") or []) == 4
                   and len(q.vector("r2ccl_nic_probe_rtt_seconds > 0") or []) == 4
                   and q.devices("r2ccl_nic_up == 0") == set()
                   and q.devices("r2ccl_nic_degraded == 1") == set(), context=ctx)
        flips = q.vector('r2ccl_nic_carrier_changes_total{host="h0",device="eth1"}')
        assert flips and len(flips) == 1, ctx()
        flips_before = flips[0][1]

        # --- NIC down: host 0's eth1 (the veth peer, host 1's eth1, loses carrier with it).
        assert tb.tb("down", "0", "eth1").returncode == 0
        down = wait_until("r2ccl_nic_up == 0 for eth1",
                          lambda: q.devices("r2ccl_nic_up == 0") == {("h0", "eth1"),
                                                                     ("h1", "eth1")},
                          context=ctx)
        assert down
        wait_until("eth1 degraded on both hosts, host 1's probe to host 0's eth1 losing",
                   lambda: q.devices("r2ccl_nic_degraded == 1") == {("h0", "eth1"),
                                                                    ("h1", "eth1")}
                   and q.devices('r2ccl_nic_probe_loss_ratio{host="h1"} >= 0.5') == {("h1",
                                                                                      "eth1")},
                   context=ctx)
        assert q.devices("r2ccl_nic_up == 0") == {("h0", "eth1"), ("h1", "eth1")}, ctx()
        assert q.devices('r2ccl_nic_probe_loss_ratio{device="eth2"} == 0') == {("h0", "eth2"),
                                                                              ("h1", "eth2")}
        # The alert rules are loaded in this Prometheus: R2cclNicDown is pending (for: 30s).
        wait_until("ALERTS{alertname=\"R2cclNicDown\"} for eth1",
                   lambda: q.devices('ALERTS{alertname="R2cclNicDown"}') == {("h0", "eth1"),
                                                                             ("h1", "eth1")},
                   context=ctx)

        assert tb.tb("up", "0", "eth1").returncode == 0
        wait_until("eth1 up and healthy again",
                   lambda: q.devices("r2ccl_nic_up == 0") == set()
                   and q.devices('r2ccl_nic_up{device="eth1"} == 1') == {("h0", "eth1"),
                                                                         ("h1", "eth1")}
                   and q.devices("r2ccl_nic_degraded == 1") == set(), context=ctx)
        flips = q.vector('r2ccl_nic_carrier_changes_total{host="h0",device="eth1"}')
        assert flips and flips[0][1] >= flips_before + 2, (flips_before, flips)

        # --- Black hole on host 0's eth2: the links stay up, the probes are lost both ways.
        assert tb.tb("blackhole", "0", "eth2").returncode == 0
        wait_until("eth2 degraded on both hosts by probe loss, links still up",
                   lambda: q.devices("r2ccl_nic_degraded == 1") == {("h0", "eth2"),
                                                                    ("h1", "eth2")}
                   and q.devices("r2ccl_nic_probe_loss_ratio >= 0.5") == {("h0", "eth2"),
                                                                          ("h1", "eth2")},
                   context=ctx)
        assert q.devices("r2ccl_nic_up == 0") == set(), ctx()
        assert tb.tb("heal", "0", "eth2").returncode == 0
        wait_until("eth2 healthy again",
                   lambda: q.devices("r2ccl_nic_degraded == 1") == set()
                   and len(q.vector("r2ccl_nic_probe_loss_ratio < 0.5") or []) == 4, context=ctx)

        # Clean shutdown on SIGTERM.
        assert procs.stop(m0) == 0, ctx()
        assert procs.stop(m1) == 0, ctx()
