"""Collectives on the netns testbed with a NIC taken down mid-operation.

Three hosts x four NICs at 100 Mbit/s; r2ccl-perf runs one collective for a few seconds with
every round's result checked on every rank (``--duration`` with ``-c 1``), and a NIC of host 1
goes down while it carries data.  Every rank must finish with every element right; the rail
must be reported failed and the traffic must have moved to the other rails.  No timings are
asserted: the time bounds only catch hangs.
"""

import json
import re

import pytest

from r2ccl_testbed import (TESTBED, BusyTrigger, Proc, Testbed, describe, launch_ranks, perf_ranks, random_port,
                           read_events)

CHECK_LINE = "# Check: every byte verified on every rank"
PARTIAL = re.compile(r"^# Check: every byte of the (\d+) completed round\(s\) verified on every rank; "
                     r"(\d+) round\(s\) failed$", re.M)
ROUND_FAILED = re.compile(r"^r2ccl-perf: rank 0: round (\d+) failed: (.*)$", re.M)
ROUNDS = re.compile(r"^r2ccl-perf: rank 0: (\d+) round\(s\) completed, (\d+) failed$", re.M)
SLACK_S = 40


def run_with_fault(args, fault):
    """Three ranks on 3 hosts x 4 NICs at 100 Mbit/s run `args` (with ``--duration`` and
    ``--events``); once eth2 of host 1 carries data, fault(tb) gives the command that breaks it.
    Checks that every rank finished with every byte verified, the fault ran on a busy link, and
    rank 1 reported eth2 failed; returns the ranks' results and rank 1's (events, finals)."""
    ev = args[args.index("--events") + 1]
    seconds = float(args[args.index("--duration") + 1])
    with Testbed(hosts=3, nics=4, rate="100mbit") as tb:
        trigger = BusyTrigger(tb.ns(1), "eth2", fault(tb), delay=1.5, max_wait=3.0).start()
        try:
            boot = f"{tb.mgmt_addr(0)}:{random_port()}"
            procs = perf_ranks(3, boot, args, hosts=[0, 1, 2])
            res = launch_ranks(procs, testbed=tb, timeout=seconds + SLACK_S)
        finally:
            trigger.finish()
    assert [r.returncode for r in res] == [0, 0, 0], describe(res)
    assert CHECK_LINE in res[0].stdout, describe(res)
    assert trigger.result is not None and trigger.result.returncode == 0, trigger.result
    assert trigger.busy, "eth2 of host 1 never carried data before the fault"
    events, finals = read_events(ev, 1)
    failed = [e for e in events if e["nic"] == "eth2" and e["kind"] == "failed"]
    assert failed, f"rank 1 reported no failure of eth2: {events}"
    return res, (events, finals)


@pytest.mark.parametrize("op,dtype,redop", [
    ("allreduce", "float", "sum"),
    ("allreduce", "bfloat16", "avg"),
    ("reducescatter", "int32", "max"),
    ("allgather", "half", "sum"),
    ("broadcast", "int64", "sum"),
    ("reduce", "double", "prod"),
])
def test_collective_survives_nic_down(perf, tmp_path, op, dtype, redop):
    args = [op, "-b", "3M", "-e", "3M", "-w", "0", "-c", "1", "-d", dtype, "-o", redop, "-r", "0",
            "--duration", "5", "--events", str(tmp_path / "ev")]
    _, (events, finals) = run_with_fault(args, lambda tb: ["ip", "-n", tb.ns(1), "link", "set", "eth2", "down"])
    assert all(f["state"] == "down" for n, f in finals.items() if n == "eth2"), finals
    assert all(f["state"] == "up" for n, f in finals.items() if n != "eth2"), (
        {n: f["state"] for n, f in finals.items()}, [e for e in events if e["nic"] != "eth2"])


def test_collective_survives_lost_acknowledgements(perf, tmp_path):
    """Host 1's eth2 drops what arrives but not what it sends: its chunks land on the peers while
    every acknowledgement is lost.  A chunk that landed must not be written again once the rail
    is fenced (its receive may have completed and its memory been released or reused): every
    result must be right, and no write refused (test_failover checks what is replayed)."""
    args = ["allreduce", "-b", "3M", "-e", "3M", "-w", "0", "-c", "1", "-r", "0",
            "--duration", "5", "--events", str(tmp_path / "ev")]
    res, _ = run_with_fault(args, lambda tb: [str(TESTBED), "blackhole", tb.name, "1", "eth2", "in"])
    assert not any("not registered" in r.stderr for r in res), describe(res)


def test_collective_mismatch_is_named_with_check(perf, tmp_path):
    """R2CCL_CHECK=1: ranks that call different collectives all fail with the same message."""
    with Testbed(hosts=2, nics=2, rate="100mbit") as tb:
        boot = f"{tb.mgmt_addr(0)}:{random_port()}"
        procs = perf_ranks(2, boot, ["allreduce", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0"],
                           hosts=[0, 1], extra_env={"R2CCL_CHECK": "1"})
        procs[1].args = ["allgather", "-b", "2K", "-e", "2K", "-n", "1", "-w", "0"]
        res = launch_ranks(procs, testbed=tb, timeout=SLACK_S)
    want = ("mismatched collective (R2CCL_CHECK=1): rank 0 called allreduce(count 256, float, sum) "
            "but rank 1 called allgather(count 256, float)")
    assert [r.returncode for r in res] == [2, 2], describe(res)
    assert want in res[0].stderr, describe(res)


def rail_finals(prefix, rank):
    """{(peer, nic): final state} of rank `rank`'s rails (``r2ccl-perf --events``)."""
    with open(f"{prefix}.rank{rank}") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {(e["peer"], e["nic"]): e["state"] for e in rows if e["kind"] == "final"}


def test_colocated_ranks_keep_their_rails_when_every_nic_goes_down(perf, tmp_path):
    """Two ranks on one host talk through the kernel's loopback even on their NICs' addresses:
    every NIC of the host going down touches none of their rails.  Every round completes,
    verified, and no rail is failed or reported down."""
    ev = tmp_path / "ev"
    with Testbed(hosts=2, nics=2, rate="100mbit") as tb:  # host 1 stays idle
        ns = tb.ns(0)
        boot = f"{tb.mgmt_addr(0)}:{random_port()}"
        args = ["allreduce", "-b", "1M", "-e", "1M", "-w", "0", "-c", "1", "--duration", "5",
                "--events", str(ev)]
        procs = perf_ranks(2, boot, args, hosts=[0, 0], extra_env={"R2CCL_TIMEOUT": "3s"})
        down = " ; ".join(f"ip -n {ns} link set eth{i} down" for i in (1, 2))
        procs.append(Proc(argv=["sh", "-c", down], delay=1.5, name="every NIC of host 0 down"))
        res = launch_ranks(procs, testbed=tb, timeout=5 + SLACK_S)
    assert [r.returncode for r in res] == [0, 0, 0], describe(res)
    assert CHECK_LINE in res[0].stdout, describe(res)
    for rank in (0, 1):
        events, _ = read_events(ev, rank)
        assert not [e for e in events if e["kind"] in ("link_down", "failed")], events
        finals = rail_finals(ev, rank)
        assert sorted(finals) == [(1 - rank, "eth1"), (1 - rank, "eth2")], finals
        assert set(finals.values()) == {"up"}, finals


def test_nic_down_fails_only_the_rails_that_crossed_it(perf, tmp_path):
    """Ranks 0 and 1 share host 0, rank 2 is on host 1.  Host 0's eth2 goes down while it
    carries data: the rails over it to rank 2 fail and their traffic moves, the rails between
    ranks 0 and 1 on the same NIC's address stay up.  Every byte is verified."""
    ev = tmp_path / "ev"
    args = ["allreduce", "-b", "3M", "-e", "3M", "-w", "0", "-c", "1", "-r", "0", "--duration", "5",
            "--events", str(ev)]
    with Testbed(hosts=2, nics=2, rate="100mbit") as tb:
        fault = ["ip", "-n", tb.ns(0), "link", "set", "eth2", "down"]
        trigger = BusyTrigger(tb.ns(0), "eth2", fault, delay=1.5, max_wait=3.0).start()
        try:
            boot = f"{tb.mgmt_addr(0)}:{random_port()}"
            res = launch_ranks(perf_ranks(3, boot, args, hosts=[0, 0, 1]), testbed=tb,
                               timeout=5 + SLACK_S)
        finally:
            trigger.finish()
    assert [r.returncode for r in res] == [0, 0, 0], describe(res)
    assert CHECK_LINE in res[0].stdout, describe(res)
    assert trigger.result is not None and trigger.result.returncode == 0, trigger.result
    for rank in (0, 1):
        events, _ = read_events(ev, rank)
        assert [e for e in events if e["kind"] == "failed" and e["peer"] == 2 and e["nic"] == "eth2"], events
        assert not [e for e in events if e["kind"] in ("link_down", "failed") and e["peer"] != 2], events
        finals = rail_finals(ev, rank)
        assert finals[(2, "eth2")] == "down", finals
        assert finals[(1 - rank, "eth2")] == "up" and finals[(1 - rank, "eth1")] == "up", finals
        assert finals[(2, "eth1")] == "up", finals


def test_allreduce_resumes_after_every_nic_was_down(perf):
    """All four NICs of host 0 go down (the round in flight fails at R2CCL_TIMEOUT, with the
    reason), then eth3 comes back: it is re-admitted and later all-reduce rounds complete,
    verified, over it alone."""
    with Testbed(hosts=2, nics=4, rate="100mbit") as tb:
        ns = tb.ns(0)
        boot = f"{tb.mgmt_addr(0)}:{random_port()}"
        args = ["allreduce", "-b", "1M", "-e", "1M", "-w", "0", "-c", "1", "--duration", "10",
                "--keep-going"]
        procs = perf_ranks(2, boot, args, hosts=[0, 1], extra_env={"R2CCL_TIMEOUT": "3s", "R2CCL_LOG": "info"})
        down = " ; ".join(f"ip -n {ns} link set eth{i} down" for i in (1, 2, 3, 4))
        procs.append(Proc(argv=["sh", "-c", down], delay=2.0, name="all NICs of host 0 down"))
        procs.append(Proc(argv=["sh", "-c", f"ip -n {ns} link set eth3 up"], delay=5.0, name="eth3 up"))
        res = launch_ranks(procs, testbed=tb, timeout=10 + SLACK_S)
    assert [r.returncode for r in res[:2]] == [2, 2], describe(res)  # --keep-going: a round failed
    assert all(r.returncode == 0 for r in res[2:]), describe(res)
    m = PARTIAL.search(res[0].stdout)
    assert m and int(m.group(2)) >= 1, describe(res)
    failed = ROUND_FAILED.findall(res[0].stderr)
    assert failed and all("no rail to rank 1 survived" in why for _, why in failed), describe(res)
    readmitted = [line for line in res[0].stderr.splitlines() if "(eth3 -> eth3) to rank 1 re-admitted" in line]
    assert readmitted, describe(res)
    # Rounds completed after the outage: more than the ones before it could account for alone.
    after = ROUNDS.search(res[0].stderr)
    assert after and int(after.group(1)) == int(m.group(1)), describe(res)
    last_failed = max(int(n) for n, _ in failed)
    assert int(after.group(1)) + len(failed) > last_failed + 1, describe(res)


def test_degraded_mode_replans_around_lost_nics_and_survives_another(perf, tmp_path):
    """Host 1 of 4 has lost two of its four NICs before the job: the ranks agree on a table that
    says so (rails 0x3 for rank 1, unequal bandwidths) and the automatic choice runs a degraded
    plan; host 2 then loses eth2 in the middle of the job, and every round's result is still
    right on every rank."""
    with Testbed(hosts=4, nics=4, rate="100mbit") as tb:
        for nic in ("eth3", "eth4"):
            tb.tb("down", "1", nic)
        boot = f"{tb.mgmt_addr(0)}:{random_port()}"
        args = ["allreduce", "-d", "int32", "-b", "4M", "-e", "4M", "-w", "0", "-c", "1",
                "--duration", "8"]
        procs = perf_ranks(4, boot, args, hosts=[0, 1, 2, 3], json_path=str(tmp_path / "r.json"))
        procs.append(Proc(argv=[str(TESTBED), "down", tb.name, "2", "eth2"], delay=4.0,
                          name="host 2 eth2 down"))
        res = launch_ranks(procs, testbed=tb, timeout=8 + SLACK_S)
    assert [r.returncode for r in res[:4]] == [0, 0, 0, 0], describe(res)
    assert res[4].returncode == 0, describe(res)
    assert CHECK_LINE in res[0].stdout, describe(res)
    line = next((x for x in res[0].stdout.splitlines() if x.startswith("# Degraded mode:")), "")
    assert "/0x3 " in line and "unequal" in line, describe(res)
    plan = re.search(r"last plan (\w+)$", line)
    assert plan and plan.group(1) in ("weighted", "r2cc"), line
