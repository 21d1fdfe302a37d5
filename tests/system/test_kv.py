"""System tests of the KV-cache transfer engine: r2ccl-kvbench between two hosts.

Two hosts x four NICs at 100mbit on a netns testbed; rank 0 (prefill) runs on host 0 and
rank 1 (decode) on host 1.  Faults are run by rank 0 itself (``--fault SECONDS:COMMAND``,
``ip -n NS link set ...``).  The tests assert behaviour -- exit codes, the JSON summary, the
receiver's notifications -- never timings; the time limits only catch hangs.
"""

import re
import subprocess

import pytest

from r2ccl_testbed import BIN_DIR, Proc, Testbed, describe, launch_ranks, load_json, random_port, rank_env, \
    wait_for_binary

KVBENCH = BIN_DIR / "r2ccl-kvbench"
RESULT_OK = "# result: every request DONE, every block verified"
RESULT_FAILED = "# result: FAILED"
NO_RAIL = "no rail to rank 1 survived"
# The receiver's line for a failed notification, e.g.
# "r2ccl-kvbench: rank 1: notification 3: FAILED (no rail ...; 11 invalid block(s))".
RECEIVER_FAILED = re.compile(r"^r2ccl-kvbench: rank 1: notification (\d+): FAILED \((.*); (\d+) invalid block\(s\)\)$",
                             re.M)
SENDER_FAILED = re.compile(r"^request (\d+): FAILED \((.*); (\d+) invalid block\(s\)\)$")


@pytest.fixture
def kvbench():
    return wait_for_binary(KVBENCH)


@pytest.fixture
def bed():
    with Testbed(hosts=2, nics=4, rate="100mbit") as tb:
        yield tb


def run_kv(tb, args, json_path, *, json_rank=0, timeout=90.0, **env):
    """Runs r2ccl-kvbench on hosts 0 and 1 with `args`; `json_rank` writes --json."""
    boot = f"{tb.mgmt_addr(0)}:{random_port()}"
    procs = []
    for r in (0, 1):
        a = [str(KVBENCH), *args]
        if r == json_rank:
            a += ["--json", str(json_path)]
        procs.append(Proc(env=rank_env(r, 2, boot, **env), argv=a, host=r, name=f"kvbench rank {r}"))
    return launch_ranks(procs, testbed=tb, timeout=timeout)


def summary(res, j):
    """Both ranks' output and the JSON without its long latency list, for failure messages."""
    short = {k: v for k, v in j.items() if k != "latencies_ms"}
    return f"{describe(res)}\n--- json: {short}"


def assert_fault_ran(res, n):
    assert res[0].stderr.count("r2ccl-kvbench: fault at") == n, describe(res)
    assert "the fault command failed" not in res[0].stderr, describe(res)


def link_is_up(tb, host, dev) -> bool:
    r = subprocess.run(["ip", "-n", tb.ns(host), "-o", "link", "show", "dev", dev], capture_output=True,
                       text=True, timeout=10, check=False)
    flags = re.search(r"<([^>]*)>", r.stdout)
    return flags is not None and "UP" in flags.group(1).split(",")


def test_healthy_push(bed, kvbench, tmp_path):
    n = 8
    out = tmp_path / "push.json"
    res = run_kv(bed, ["--requests", str(n), "--min-tokens", "128", "--max-tokens", "384", "--concurrency", "4"],
                 out)
    assert [r.returncode for r in res] == [0, 0], describe(res)
    assert RESULT_OK in res[0].stdout, describe(res)
    j = load_json(out)
    assert j["mode"] == "push" and j["model"] == "llama3-8b", summary(res, j)
    assert j["ok"] is True, summary(res, j)
    assert j["done"] == n and j["failed"] == 0, summary(res, j)
    assert j["receiver_verified"] == n, summary(res, j)
    assert j["failures"] == [], summary(res, j)
    assert j["rails"] == 4, summary(res, j)
    assert j["bytes"] > 0 and len(j["latencies_ms"]) == n, summary(res, j)


def test_pull(bed, kvbench, tmp_path):
    n = 4
    out = tmp_path / "pull.json"  # written by the initiator of a pull: rank 1
    res = run_kv(bed, ["--mode", "pull", "--requests", str(n), "--min-tokens", "64", "--max-tokens", "192",
                       "--concurrency", "2"], out, json_rank=1)
    assert [r.returncode for r in res] == [0, 0], describe(res)
    assert RESULT_OK in res[1].stdout, describe(res)
    j = load_json(out)
    assert j["mode"] == "pull", summary(res, j)
    assert j["done"] == n and j["failed"] == 0 and j["failures"] == [], summary(res, j)


def test_one_nic_down_mid_transfer(bed, kvbench, tmp_path):
    """eth2 of host 0 goes down while requests are in flight: its chunks are replayed on the
    other rails, every request still ends DONE with every block verified."""
    n = 12
    out = tmp_path / "down.json"
    fault = f"2:ip -n {bed.ns(0)} link set eth2 down"
    res = run_kv(bed, ["--requests", str(n), "--min-tokens", "256", "--max-tokens", "512", "--concurrency", "4",
                       "--fault", fault], out)
    assert_fault_ran(res, 1)
    assert not link_is_up(bed, 0, "eth2"), "the fault did not take eth2 down\n" + describe(res)
    assert [r.returncode for r in res] == [0, 0], describe(res)
    assert RESULT_OK in res[0].stdout, describe(res)
    j = load_json(out)
    assert j["done"] == n and j["failed"] == 0 and j["failures"] == [], summary(res, j)
    assert j["receiver_verified"] == n, summary(res, j)
    assert j["preserved"] >= 1, "no request had data replayed\n" + summary(res, j)


def test_all_nics_down_then_one_back(bed, kvbench, tmp_path):
    """Wave 0: every rail of host 0 goes down; requests in flight end FAILED (on both sides, with
    their invalid blocks) once R2CCL_TIMEOUT passes.  eth3 comes back; wave 1 is served on it.

    Every request of a wave is in flight from its start (concurrency = requests, an in-flight
    limit above the wave's bytes): so wave 0's writes all time out while no rail is up (~1 s +
    3 s), well before eth3 is re-admitted (5 s + the 1 s hold-down).  With fewer requests in
    flight, a request started during the outage may reach its deadline just after eth3 is
    re-admitted and fail with "eth3 up, N bytes unconfirmed" instead of "no rail survived"."""
    n = 6
    out = tmp_path / "all.json"
    ns0 = bed.ns(0)
    faults = ["--fault", f"1:for i in 1 2 3 4; do ip -n {ns0} link set eth$i down; done",
              "--fault", f"5:ip -n {ns0} link set eth3 up"]
    res = run_kv(bed, ["--requests", str(n), "--min-tokens", "128", "--max-tokens", "256", "--concurrency", str(n),
                       "--waves", "2", "--wave-gap", "1", *faults], out, timeout=120, R2CCL_TIMEOUT="3s",
                 R2CCL_KV_MAX_INFLIGHT="1G")
    assert_fault_ran(res, 2)
    assert [link_is_up(bed, 0, f"eth{i}") for i in (1, 2, 3, 4)] == [False, False, True, False], describe(res)
    assert [r.returncode for r in res] == [1, 1], describe(res)
    assert RESULT_FAILED in res[0].stdout, describe(res)
    j = load_json(out)
    w0, w1 = j["waves"]
    assert w0["wave"] == 0 and w1["wave"] == 1, summary(res, j)
    # Wave 0: some requests FAILED, none of them DONE with partial data.
    assert w0["failed"] >= 1 and w0["invalid_blocks"] >= 1, summary(res, j)
    assert w0["done"] + w0["failed"] == n, summary(res, j)
    assert len(j["failures"]) == w0["failed"], summary(res, j)
    sender = {}
    for f in j["failures"]:
        assert NO_RAIL in f and "invalid block" in f, summary(res, j)
        m = SENDER_FAILED.match(f)
        assert m, f"unexpected failure string {f!r}\n" + summary(res, j)
        assert int(m.group(1)) < n, "a request of wave 1 failed\n" + summary(res, j)
        assert int(m.group(3)) >= 1, summary(res, j)
        sender[int(m.group(1))] = int(m.group(3))
    assert sum(sender.values()) == w0["invalid_blocks"], summary(res, j)
    # Wave 1: the engine serves again on the NIC that came back.
    assert w1["done"] == n and w1["failed"] == 0 and w1["invalid_blocks"] == 0, summary(res, j)
    # Every block that did arrive was verified: all DONE notifications of both waves.
    assert j["done"] == w0["done"] + n, summary(res, j)
    assert j["receiver_verified"] == j["done"], summary(res, j)
    # The receiver learnt of the same failed requests, with the same invalid block counts,
    # over the control path (no rail was left).
    receiver = {int(m.group(1)): int(m.group(3)) for m in RECEIVER_FAILED.finditer(res[1].stderr)}
    assert receiver == sender, summary(res, j)
    for m in RECEIVER_FAILED.finditer(res[1].stderr):
        assert NO_RAIL in m.group(2), describe(res)


def test_deepseek_mla(bed, kvbench, tmp_path):
    """DeepSeek-V3: 61 layers of one MLA latent part -- a different layout."""
    n = 4
    out = tmp_path / "mla.json"
    res = run_kv(bed, ["--model", "deepseek-v3", "--requests", str(n), "--min-tokens", "64", "--max-tokens", "256",
                       "--concurrency", "2"], out)
    assert [r.returncode for r in res] == [0, 0], describe(res)
    j = load_json(out)
    assert j["model"] == "deepseek-v3", summary(res, j)
    assert j["done"] == n and j["receiver_verified"] == n and j["failures"] == [], summary(res, j)
