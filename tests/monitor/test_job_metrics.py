"""A job's own rail metrics (R2CCL_METRICS_PORT) seen by a real Prometheus across a fault.

* On the netns testbed (2 hosts x 4 NICs, 100mbit): two r2ccl-perf ranks run a verified
  ``sendrecv --duration`` job with metrics on, each rank serving /metrics on its host's
  management address; a real Prometheus server (the Debian `prometheus` binary) in host 0
  scrapes both every second with deploy/prometheus/r2ccl-alerts.yml loaded. Host 0's eth2 is
  taken down: through PromQL (/api/v1/query) exactly eth2's rail goes to r2ccl_rail_up 0 on
  both ranks, its failover counter rises on both, R2cclRailDown goes pending; after the link
  comes back the rail is up again on both ranks, and the job ends with every byte verified.
* Anywhere (loopback): a metrics port that cannot be served (in use, or past 65535 for a
  rank) gives a warning naming it and the job runs on without metrics.

Every wait is bounded; everything started is killed at the end.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prom_harness import (PROMETHEUS, prometheus_config, start_prometheus,  # noqa: E402
                          wait_until)
from r2ccl_testbed import (Proc, Testbed, _base_env, describe, free_port,  # noqa: E402
                           launch_ranks, loopback_nics, random_port, rank_env, wait_for_binary)

CHECK_LINE = "# Check: every byte verified on every rank"
NICS = ["eth1", "eth2", "eth3", "eth4"]
FAULT_NIC = "eth2"
DURATION_S = 40  # the job's length; every phase below fits in it with room to spare
SLACK_S = 30  # start-up, shutdown and one R2CCL_TIMEOUT past the duration: catches hangs only
JOB = "r2ccl-job"
ALERT = "R2cclRailDown"  # deploy/prometheus/r2ccl-alerts.yml: expr r2ccl_rail_up == 0, for: 30s


@pytest.fixture
def perf() -> Path:
    return wait_for_binary()


def job_args(duration: int):
    return ["sendrecv", "-b", "4M", "-e", "4M", "-w", "0", "-c", "1", "--duration", str(duration)]


def rank_devices(q, query):
    """(rank, device) of every series `query` returns (None while Prometheus cannot answer)."""
    return q.labels(query, "rank", "device")


# ------------------------------------------------------------------- testbed + Prometheus


def test_rail_down_and_back_seen_by_prometheus(perf, procs, tmp_path):
    if not PROMETHEUS.exists():
        pytest.skip(f"{PROMETHEUS} not found (Debian package 'prometheus'; scripts/run installs it)")
    with Testbed(hosts=2, nics=4, rate="100mbit") as tb:
        mport, pport, bport = random_port(), random_port(), random_port()
        while len({mport, mport + 1, pport, bport}) < 4:
            pport, bport = random_port(), random_port()
        # Rank r serves on mport + r at its host's management address (reachable from host 0).
        targets = {"r0": f"{tb.mgmt_addr(0)}:{mport}", "r1": f"{tb.mgmt_addr(1)}:{mport + 1}"}
        cfg = tmp_path / "prometheus.yml"
        prometheus_config(cfg, targets, job=JOB, label="target")
        q = start_prometheus(procs, tb, cfg, tmp_path / "tsdb", pport)
        ctx = procs.logs
        wait_until("Prometheus answering queries", lambda: q.vector("vector(1)") is not None,
                   context=ctx)

        ranks = []
        for r in (0, 1):
            env = _base_env()
            env.update(rank_env(r, 2, f"{tb.mgmt_addr(0)}:{bport}", R2CCL_METRICS_PORT=str(mport),
                                R2CCL_METRICS_ADDR=tb.mgmt_addr(r)))
            ranks.append(procs.start(f"rank{r}", tb.exec_argv(r, [str(perf), *job_args(DURATION_S)]),
                                     env=env))
        t_start = time.monotonic()

        def running():
            for r, p in enumerate(ranks):
                if p.poll() is not None:
                    pytest.fail(f"rank {r} exited early (rc {p.returncode})\n{ctx()}")
            return True

        every_rail = {(str(r), n) for r in (0, 1) for n in NICS}
        wait_until("Prometheus scraping both ranks",
                   lambda: running() and len(q.vector(f'up{{job="{JOB}"}} == 1') or []) == 2,
                   context=ctx)
        wait_until("r2ccl_rail_up: 4 series per rank, all 1",
                   lambda: running() and rank_devices(q, "r2ccl_rail_up") == every_rail
                   and rank_devices(q, "r2ccl_rail_up == 1") == every_rail, context=ctx)
        assert rank_devices(q, "r2ccl_rail_up == 0") == set(), ctx()
        assert q.labels("r2ccl_build_info", "rank") == {("0",), ("1",)}, ctx()
        # Each rank's rail eth<i> leads to the peer's eth<i> (direct veth pairs).
        assert q.labels("r2ccl_rail_up", "rank", "peer", "device", "remote_device") == {
            (str(r), str(1 - r), n, n) for r in (0, 1) for n in NICS}, ctx()
        failovers = f'r2ccl_rail_failovers_total{{device="{FAULT_NIC}"}}'
        before = q.values(failovers, "rank")
        assert before is not None and set(before) == {("0",), ("1",)}, (before, ctx())
        assert rank_devices(q, f'ALERTS{{alertname="{ALERT}"}}') == set(), ctx()

        # --- Host 0's eth2 down (host 1's eth2, its veth peer, loses carrier with it).
        assert tb.tb("down", "0", FAULT_NIC).returncode == 0
        fault = {("0", FAULT_NIC), ("1", FAULT_NIC)}

        def failed_over():
            now = q.values(failovers, "rank") or {}
            return all(now.get(k, -1) > v for k, v in before.items())
        wait_until(f"r2ccl_rail_up == 0 for exactly {FAULT_NIC} on both ranks and its "
                   "r2ccl_rail_failovers_total risen on both",
                   lambda: running() and rank_devices(q, "r2ccl_rail_up == 0") == fault
                   and failed_over(), context=ctx)
        # The other rails carry on.
        assert rank_devices(q, "r2ccl_rail_up == 1") == every_rail - fault, ctx()
        # The alert rules are loaded in this Prometheus: R2cclRailDown is pending (for: 30s)
        # or firing for exactly that rail, on both ranks.
        wait_until(f'ALERTS{{alertname="{ALERT}"}} for {FAULT_NIC}',
                   lambda: running() and q.labels(
                       f'ALERTS{{alertname="{ALERT}",alertstate=~"pending|firing"}}', "rank",
                       "device") == fault, context=ctx)
        assert rank_devices(q, "r2ccl_rail_up == 0") == fault, ctx()

        # --- The link back: re-admitted after the hold-down (1 s) once probes answer.
        assert tb.tb("up", "0", FAULT_NIC).returncode == 0
        wait_until(f"r2ccl_rail_up == 1 for {FAULT_NIC} on both ranks again",
                   lambda: running()
                   and rank_devices(q, f'r2ccl_rail_up{{device="{FAULT_NIC}"}} == 1') == fault
                   and rank_devices(q, "r2ccl_rail_up == 0") == set(), context=ctx)
        assert rank_devices(q, "r2ccl_rail_up == 1") == every_rail, ctx()
        elapsed = time.monotonic() - t_start
        assert elapsed < DURATION_S - 2, \
            f"the checks took {elapsed:.0f}s of the {DURATION_S}s job: it may have ended too soon"

        # --- The job ends on its own, every byte verified across the fault.
        deadline = t_start + DURATION_S + SLACK_S
        for r, p in enumerate(ranks):
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {r} still running {DURATION_S + SLACK_S}s after the start\n"
                            + ctx())
        assert [p.returncode for p in ranks] == [0, 0], ctx()
        assert CHECK_LINE in procs.log("rank0"), ctx()


# ---------------------------------------------------------------------- anywhere (loopback)


def two_free_ports() -> int:
    """P such that P and P + 1 are both free on 127.0.0.1 now (bounded number of tries)."""
    for _ in range(50):
        p = free_port()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def loopback_job(metrics_port: int, args=("sendrecv", "-b", "1M", "-e", "1M", "-n", "5", "-c",
                                          "1")):
    boot = f"127.0.0.1:{free_port()}"
    procs = [Proc(env=rank_env(r, 2, boot, R2CCL_NICS=loopback_nics(r, 2),
                               R2CCL_METRICS_PORT=str(metrics_port)), args=list(args))
             for r in range(2)]
    return launch_ranks(procs, timeout=60)


def test_metrics_port_in_use_job_runs_without_metrics(perf):
    port = two_free_ports()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))  # rank 0's port
        s.listen(1)
        res = loopback_job(port)
    assert [r.returncode for r in res] == [0, 0], describe(res)
    assert CHECK_LINE in res[0].stdout, describe(res)
    warning = [line for line in res[0].stderr.splitlines() if "running without metrics" in line]
    assert len(warning) == 1 and f"127.0.0.1:{port}" in warning[0], describe(res)
    assert "running without metrics" not in res[1].stderr, describe(res)  # rank 1 served on P+1


def test_metrics_port_past_65535_job_runs_without_metrics(perf):
    # Rank 1 would listen on 65535 + 1.
    res = loopback_job(65535)
    assert [r.returncode for r in res] == [0, 0], describe(res)
    assert CHECK_LINE in res[0].stdout, describe(res)
    warning = [line for line in res[1].stderr.splitlines() if "running without metrics" in line]
    assert len(warning) == 1 and "65535" in warning[0], describe(res)


def test_collective_durations_are_exported_per_op_and_algorithm(perf):
    """A running all-reduce job publishes r2ccl_collective_duration_seconds{op,algo}: one series
    per algorithm it ran (one-shot for 4 KiB, ring for 4 MiB: two ranks take one-shot up to
    1 MiB), counts growing while it runs."""
    import re
    import threading
    import urllib.request
    port = two_free_ports()
    result = {}
    job = threading.Thread(target=lambda: result.setdefault("res", loopback_job(
        port, ("allreduce", "-b", "4K", "-e", "4M", "-f", "1024", "--duration", "3", "-c", "1"))))
    job.start()
    pat = re.compile(r'^r2ccl_collective_duration_seconds_count\{(?=[^}]*op="allreduce")'
                     r'(?=[^}]*algo="(\w+)")[^}]*\} (\d+)', re.M)
    seen = {}
    deadline = time.monotonic() + 30
    while job.is_alive() and time.monotonic() < deadline:  # bounded: the job's own 60 s limit
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            for algo, count in pat.findall(text):
                seen[algo] = max(seen.get(algo, 0), int(count))
        except OSError:
            pass
        time.sleep(0.2)
    job.join(60)
    res = result["res"]
    assert [r.returncode for r in res] == [0, 0], describe(res)
    assert CHECK_LINE in res[0].stdout, describe(res)
    assert seen.get("oneshot", 0) > 0 and seen.get("ring", 0) > 0, seen
