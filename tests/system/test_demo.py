"""The quick start's demo (scripts/demo.sh): a NIC taken down under load, nothing lost.

Runs the demo exactly as `scripts/run demo` does, on its own netns testbed, and checks its
report: the fault, its detection, the replay onto the surviving rails, the re-admission, a
per-rail table in which the faulted rail carried nothing during the outage and traffic again
after it, and every byte verified.
"""

import re
import subprocess

import r2ccl_testbed
from r2ccl_testbed import REPO

DEMO = REPO / "scripts" / "demo.sh"
DEMO_BOUND_S = 300  # the demo takes about 40 s; this only catches a hang


def test_nic_down_under_load_and_back(perf):
    r2ccl_testbed.testbed_check()
    r = subprocess.run([str(DEMO), str(perf.parent.parent)], capture_output=True, text=True,
                       timeout=DEMO_BOUND_S)
    out = r.stdout
    assert r.returncode == 0, f"demo exited {r.returncode}\n{out}\n{r.stderr}"
    assert "host 0: eth2 taken down (ip link set down, from outside the processes)" in out, out
    assert re.search(r"rank [01]: rail 1 \(eth2\) failed: .*link down", out), out
    assert re.search(r"rank [01]: rail 1 \(eth2\) re-admitted", out), out
    # The fault is timed to hit data in flight; what was in flight went again on other rails.
    replays = dict(re.findall(r"^  rank ([01]): ([\d.]+) MiB", out, re.M))
    assert sorted(replays) == ["0", "1"], out
    for rank, mib in replays.items():
        started = re.search(rf"rank {rank}: rail 1 \(eth2\) replay started: ([1-9]\d*) chunk", out)
        if float(mib) > 0:
            assert started, out
            assert re.search(rf"^  rank {rank}: .*rail [023] \(eth[134]\) [\d.]+ MiB", out, re.M), out
    row = re.search(r"^\s+1\s+eth2\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert row, out
    before, during, after = (float(x) for x in row.groups())
    assert before > 0 and during == 0.0 and after > 0, out
    for rail, nic in ((0, "eth1"), (2, "eth3"), (3, "eth4")):
        other = re.search(rf"^\s+{rail}\s+{nic}\s+[\d.]+\s+([\d.]+)\s+[\d.]+$", out, re.M)
        assert other and float(other.group(1)) > 0, out
    assert out.rstrip().endswith("Result: every byte verified on every rank."), out
