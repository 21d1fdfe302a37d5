"""An attacker process on the testbed that knows every address of a job but not its token.

Two ranks (hosts 0 and 1, four NICs each) run verified 16 MiB sendrecv rounds; from host 2,
tests/system/attacker.py sends garbage, frame headers claiming 1 GiB, forged rail hellos (a
high epoch, a forged MAC), idle connections, and forged probe packets at every port of both
ranks (bootstrap, rails, probes).  The job must finish with every byte verified, no rail must
fail over because of it, no forged hello may be answered, and the ranks' memory stays bounded.
"""

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from r2ccl_testbed import (PERF, Testbed, describe, launch_ranks, netns_pids_of, perf_ranks,
                           random_port, read_events)

ATTACKER = Path(__file__).resolve().parent / "attacker.py"
CHECK_LINE = "# Check: every byte verified on every rank"
RSS_LIMIT_KB = 1_500_000  # the ranks use a few hundred MB; a 1 GiB allocation would show


def listening(tb, host, proto):
    """(address, port) of every r2ccl-perf socket listening in host's namespace."""
    flag = "-ltnpH" if proto == "tcp" else "-lunpH"
    out = tb.run(host, ["ss", flag]).stdout
    found = []
    for line in out.splitlines():
        if "r2ccl-perf" not in line:
            continue
        local = line.split()[3]
        addr, port = local.rsplit(":", 1)
        addr = addr.split("%")[0]  # "198.18.1.1%eth1": a socket bound to its device
        if addr in ("*", "0.0.0.0"):
            addr = tb.mgmt_addr(host)
        found.append((addr, int(port)))
    return found


def rss_kb(pid):
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def test_an_attacker_without_the_token_changes_nothing(tmp_path):
    events = str(tmp_path / "events")
    with Testbed(hosts=3, nics=4) as tb:
        boot = f"{tb.mgmt_addr(0)}:{random_port()}"
        args = ["sendrecv", "-b", "16M", "-e", "16M", "-w", "0", "-c", "1", "--duration", "14",
                "--events", events]
        procs = perf_ranks(2, boot, args, hosts=[0, 1])
        attack = {}

        def run_attacker():
            # Once the job's ports are open (the rails listen after the rendezvous).
            deadline = time.monotonic() + 20
            tcp, udp = [], []
            while time.monotonic() < deadline:
                tcp = listening(tb, 0, "tcp") + listening(tb, 1, "tcp")
                udp = listening(tb, 0, "udp") + listening(tb, 1, "udp")
                if len(tcp) >= 8 and len(udp) >= 8:
                    break
                time.sleep(0.2)
            attack["targets"] = (tcp, udp)
            argv = [sys.executable, str(ATTACKER), "--seconds", "8"]
            for a, p in tcp:
                argv += ["--tcp", f"{a}:{p}"]
            for a, p in udp:
                argv += ["--udp", f"{a}:{p}"]
            peak = 0
            proc = subprocess.Popen(tb.exec_argv(2, argv), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            end = time.monotonic() + 30
            while proc.poll() is None and time.monotonic() < end:
                for host in (0, 1):
                    for pid in netns_pids_of(tb.ns(host), PERF):
                        peak = max(peak, rss_kb(pid))
                time.sleep(0.2)
            if proc.poll() is None:
                proc.kill()
            attack["output"] = proc.communicate(timeout=10)[0]
            attack["peak_rss_kb"] = peak

        t = threading.Thread(target=run_attacker, daemon=True)
        t.start()
        res = launch_ranks(procs, testbed=tb, timeout=90)
        t.join(timeout=60)

    tcp, udp = attack.get("targets", ([], []))
    assert len(tcp) >= 8 and len(udp) >= 8, f"the job's ports were not found: {attack}"
    out = attack.get("output", "")
    counts = dict(re.findall(r"(\w+)=(\d+)", out))
    assert int(counts.get("hellos_refused", 0)) > 0 and int(counts.get("garbage", 0)) > 0, out
    assert int(counts.get("hellos_answered", 0)) == 0, f"a forged hello was answered: {out}"
    assert int(counts.get("probes", 0)) > 0, out
    assert all(r.returncode == 0 for r in res), describe(res)
    assert CHECK_LINE in res[0].stdout, describe(res)  # rank 0 reports for every rank
    failed = [e for rank in (0, 1) for e in read_events(events, rank)[0] if e["kind"] == "failed"]
    assert not failed, f"rails failed over during the attack: {failed}"
    assert 0 < attack["peak_rss_kb"] < RSS_LIMIT_KB, attack["peak_rss_kb"]
