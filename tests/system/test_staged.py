"""The staged device path (StagedComm) on the netns testbed, with host threads standing in for
the GPU and its stream (r2ccl-perf --staged): every call goes through the staging slots, the
words and the progress thread, and with --graph each size's call is captured once and replayed
from then on.  A NIC of host 1 fails mid-loop (down, black-holed, flapping): every round's
result is checked on every rank, the loop never stops, and the failure stays below the stream
(rank 1 reports the rail failed; the calls report nothing).  The time bounds only catch hangs.
"""

import pytest

from r2ccl_testbed import TESTBED, describe
from test_collectives import CHECK_LINE, run_with_fault

FAULTS = {
    "down": lambda tb: ["ip", "-n", tb.ns(1), "link", "set", "eth2", "down"],
    "blackhole": lambda tb: [str(TESTBED), "blackhole", tb.name, "1", "eth2"],
    "flap": lambda tb: [str(TESTBED), "flap", tb.name, "1", "eth2", "200", "3000"],
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_graph_replays_survive_a_failing_nic(perf, tmp_path, fault):
    args = ["allreduce", "-b", "3M", "-e", "3M", "-w", "0", "-c", "1", "-d", "bfloat16", "-r", "0",
            "--staged", "--graph", "--duration", "5", "--events", str(tmp_path / "ev")]
    res, _ = run_with_fault(args, FAULTS[fault])
    assert "staged, graph" in res[0].stdout, describe(res)
    assert not any("failed" in r.stderr.lower() and "round" in r.stderr for r in res), describe(res)


@pytest.mark.parametrize("op,dtype", [("allgather", "half"), ("reducescatter", "float")])
def test_eager_calls_survive_a_nic_down(perf, tmp_path, op, dtype):
    args = [op, "-b", "3M", "-e", "3M", "-w", "0", "-c", "1", "-d", dtype, "-r", "0", "--staged",
            "--duration", "4", "--events", str(tmp_path / "ev")]
    res, _ = run_with_fault(args, FAULTS["down"])
    assert CHECK_LINE in res[0].stdout and "staged" in res[0].stdout, describe(res)
