"""System tests of r2ccl-perf sendrecv: real processes on netns testbeds or loopback.

The tests assert behaviour (exit codes, verified data, which rails carried bytes,
error messages), never timings; the timeouts only catch hangs.
"""

import re
import shutil

import pytest

from r2ccl_testbed import (JOB_TOKEN, PERF, Proc, Testbed, describe, free_port, launch_ranks, load_json,
                           loopback_nics, perf_ranks, random_port, rank_env)

CHECK_LINE = "# Check: every byte verified on every rank"
# size count type redop root time algbw busbw #wrong algo
ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+uint8\s+none\s+-1\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)\s+p2p\s*$")
TOKEN_A = "0123456789abcdef0123456789abcdef"
TOKEN_B = "fedcba9876543210fedcba9876543210"


def table_rows(stdout):
    """(bytes, wrong) for every row of rank 0's table."""
    return [(int(m.group(1)), m.group(6)) for m in map(ROW.match, stdout.splitlines()) if m]


def assert_all_ok(results, sizes=None):
    """Every process exited 0; rank 0 printed a verified table (with `sizes`)."""
    assert all(r.returncode == 0 for r in results), describe(results)
    out = results[0].stdout
    rows = table_rows(out)
    assert rows, "no table rows in rank 0's output\n" + describe(results)
    assert all(w == "0" for _, w in rows), f"rows with wrong bytes: {rows}\n" + describe(results)
    if sizes is not None:
        assert [b for b, _ in rows] == list(sizes), out
    assert CHECK_LINE in out, describe(results)
    return rows


def tb_ranks(tb, nranks, args, **kw):
    """One r2ccl-perf per testbed host 0..nranks-1, bootstrap at host 0's mgmt address."""
    boot = f"{tb.mgmt_addr(0)}:{random_port()}"
    return perf_ranks(nranks, boot, args, hosts=list(range(nranks)), **kw)


def loop_ranks(nranks, args, k=2, **kw):
    """One r2ccl-perf per rank on loopback, k rails each (127.0.0.x addresses)."""
    boot = f"127.0.0.1:{free_port()}"
    return perf_ranks(nranks, boot, args, nics=[loopback_nics(r, k) for r in range(nranks)], **kw), boot


# ------------------------------------------------------------------------ data path


def test_two_hosts_four_nics_all_sizes_verified(perf, tmp_path):
    js = str(tmp_path / "out.json")
    args = ["sendrecv", "-b", "1", "-e", "16M", "-f", "4", "-n", "5", "-w", "1", "-c", "1", "--rails"]
    with Testbed(hosts=2, nics=4) as tb:
        res = launch_ranks(tb_ranks(tb, 2, args, json_path=js), testbed=tb, timeout=120)
    sizes = [4 ** i for i in range(13)]  # 1 .. 16M
    assert_all_ok(res, sizes)
    out = res[0].stdout
    assert "4 rail(s) per rank (eth1,eth2,eth3,eth4)" in out, out
    assert "# Per-rail traffic of rank 0" in out, out
    report = load_json(js)
    assert report["op"] == "sendrecv" and report["nranks"] == 2 and report["rails"] == 4
    assert [r["bytes"] for r in report["results"]] == sizes
    assert all(r["wrong"] == 0 for r in report["results"]), report["results"]
    stats = report["rail_stats"]
    assert sorted(s["nic"] for s in stats) == ["eth1", "eth2", "eth3", "eth4"], stats
    for s in stats:
        assert s["peer"] == 1 and s["state"] == "up", s
        assert s["remote_nic"] == s["nic"], s  # rail i of h0 is wired to rail i of h1
        assert s["tx_bytes"] > 0 and s["rx_bytes"] > 0, f"rail {s['nic']} carried nothing: {stats}"
    # 5 timed iterations of 16 MiB each way, all of it on these rails.
    assert sum(s["tx_bytes"] for s in stats) == 5 * (16 << 20), stats
    assert sum(s["rx_bytes"] for s in stats) == 5 * (16 << 20), stats


def test_zero_bytes(perf, tmp_path):
    js = str(tmp_path / "out.json")
    args = ["sendrecv", "-b", "0", "-e", "0", "-n", "3", "-w", "1", "-c", "1"]
    with Testbed(hosts=2, nics=4) as tb:
        res = launch_ranks(tb_ranks(tb, 2, args, json_path=js), testbed=tb, timeout=60)
    assert_all_ok(res, [0])
    assert [r["bytes"] for r in load_json(js)["results"]] == [0]


@pytest.mark.parametrize("size,env", [
    ("1000003", {}),                             # not a multiple of the 512K chunk
    ("12345", {"R2CCL_CHUNK_SIZE": "4K"}),       # several 4K chunks and a tail
], ids=["1000003B-chunk512K", "12345B-chunk4K"])
def test_odd_sizes(perf, size, env):
    args = ["sendrecv", "-b", size, "-e", size, "-n", "5", "-w", "1", "-c", "1"]
    with Testbed(hosts=2, nics=4) as tb:
        res = launch_ranks(tb_ranks(tb, 2, args, extra_env=env), testbed=tb, timeout=60)
    assert_all_ok(res, [int(size)])
    if env:
        assert "chunk 4K" in res[0].stdout, res[0].stdout


def test_three_hosts_bridged_ring(perf, tmp_path):
    js = str(tmp_path / "out.json")
    args = ["sendrecv", "-b", "1K", "-e", "4M", "-f", "8", "-n", "3", "-w", "1", "-c", "1"]
    with Testbed(hosts=3, nics=2) as tb:
        res = launch_ranks(tb_ranks(tb, 3, args, json_path=js), testbed=tb, timeout=120)
    assert_all_ok(res)
    report = load_json(js)
    assert report["nranks"] == 3 and report["rails"] == 2
    # Rank 0 sends to rank 1 over both rails.
    tx_to_1 = {s["nic"]: s["tx_bytes"] for s in report["rail_stats"] if s["peer"] == 1}
    assert sorted(tx_to_1) == ["eth1", "eth2"] and all(v > 0 for v in tx_to_1.values()), report["rail_stats"]


def test_shaped_striping_over_four_rails(perf, tmp_path):
    js = str(tmp_path / "out.json")
    args = ["sendrecv", "-b", "16M", "-e", "16M", "-n", "5", "-w", "1", "-c", "1", "--rails"]
    with Testbed(hosts=2, nics=4, rate="100mbit") as tb:
        res = launch_ranks(tb_ranks(tb, 2, args, json_path=js), testbed=tb, timeout=180)
    assert_all_ok(res, [16 << 20])
    stats = load_json(js)["rail_stats"]
    total = sum(s["tx_bytes"] for s in stats)
    assert sorted(s["nic"] for s in stats) == ["eth1", "eth2", "eth3", "eth4"], stats
    shares = {s["nic"]: s["tx_bytes"] / total for s in stats}
    assert all(0.15 <= v <= 0.35 for v in shares.values()), f"uneven striping: {shares}"


# ------------------------------------------------------------------------ bootstrap


def test_rank0_unreachable(perf):
    port = free_port()
    env = rank_env(1, 2, f"127.0.0.1:{port}", R2CCL_BOOTSTRAP_TIMEOUT="1s", R2CCL_NICS="127.0.0.21")
    (r,) = launch_ranks([Proc(env=env, args=["sendrecv", "-b", "8", "-e", "8"])], timeout=30)
    assert r.returncode == 2, r.describe()
    assert f"could not reach rank 0 at 127.0.0.1:{port} within 1000ms" in r.stderr, r.describe()
    assert "last error:" in r.stderr, r.describe()
    assert r.stderr.startswith("r2ccl-perf: "), r.describe()
    assert r.elapsed < 10, r.describe()


def test_wrong_token(perf):
    procs, boot = loop_ranks(2, ["sendrecv", "-b", "8", "-e", "8"],
                             extra_env={"R2CCL_BOOTSTRAP_TIMEOUT": "2s"})
    procs[0].env["R2CCL_BOOTSTRAP_TOKEN"] = TOKEN_A
    procs[1].env["R2CCL_BOOTSTRAP_TOKEN"] = TOKEN_B
    procs[1].delay = 0.2
    r0, r1 = launch_ranks(procs, timeout=30)
    assert r1.returncode == 2 and "wrong bootstrap token" in r1.stderr, describe([r0, r1])
    assert r0.returncode == 2, describe([r0, r1])
    assert f"timed out after 2000ms waiting at rank 0 ({boot}) for rank(s) 1 to join (1 of 2 joined)" \
        in r0.stderr, r0.describe()
    assert "refused:" in r0.stderr and "wrong bootstrap token" in r0.stderr, r0.describe()


def test_world_size_mismatch(perf):
    procs, boot = loop_ranks(2, ["sendrecv", "-b", "8", "-e", "8"],
                             extra_env={"R2CCL_BOOTSTRAP_TIMEOUT": "2s"})
    procs[1].env["R2CCL_NRANKS"] = "3"
    procs[1].delay = 0.2
    r0, r1 = launch_ranks(procs, timeout=30)
    assert r1.returncode == 2, describe([r0, r1])
    assert "world size mismatch: this process has 3 ranks, rank 0 has 2" in r1.stderr, r1.describe()
    assert r0.returncode == 2, r0.describe()
    assert "for rank(s) 1 to join" in r0.stderr and "world size mismatch" in r0.stderr, r0.describe()


def test_rank_out_of_range_is_config_error(perf):
    env = rank_env(5, 2, f"127.0.0.1:{free_port()}", R2CCL_BOOTSTRAP_TIMEOUT="1s")
    (r,) = launch_ranks([Proc(env=env, args=["sendrecv", "-b", "8", "-e", "8"])], timeout=30)
    assert r.returncode == 2, r.describe()
    assert "R2CCL_RANK" in r.stderr and "'5'" in r.stderr, r.describe()
    assert r.elapsed < 10, r.describe()


def test_two_processes_claim_one_rank(perf):
    """Ranks 0 and 1 start, a second rank 1 starts after the first has joined, rank 2
    starts last.  Exactly one of the two rank-1 processes is refused (normally the
    late one: 'already taken'; if it got in after the rendezvous: 'joined after');
    the other three processes complete the 3-rank ring."""
    args = ["sendrecv", "-b", "1K", "-e", "64K", "-f", "8", "-n", "2", "-w", "1", "-c", "1"]
    procs, _ = loop_ranks(3, args, extra_env={"R2CCL_BOOTSTRAP_TIMEOUT": "20s"})
    dup = Proc(env=dict(procs[1].env, R2CCL_NICS=loopback_nics(3, 2)), args=args, delay=1.0,
               name="duplicate rank 1")
    procs[2].delay = 2.5
    res = launch_ranks([procs[0], procs[1], procs[2], dup], timeout=90)
    failed = [r for r in res if r.returncode != 0]
    assert len(failed) == 1, describe(res)
    bad = failed[0]
    assert bad is res[1] or bad is res[3], describe(res)
    assert bad.returncode == 2, describe(res)
    assert ("rank 1 is already taken by another process (connected from " in bad.stderr
            or "rank 1 joined after the rendezvous of all 3 ranks completed (two processes claim rank 1?)"
            in bad.stderr), describe(res)
    # The survivors ran the ring correctly; rank 0's table is verified.
    assert CHECK_LINE in res[0].stdout and all(w == "0" for _, w in table_rows(res[0].stdout)), describe(res)


# --------------------------------------------------------------------------- config


def test_latency_percentiles(perf, tmp_path):
    """--latency times each timed operation: rank 0 prints p1 <= p50 <= p90 <= p99 <= max for
    every size, over exactly -n operations, and the JSON carries the same figures."""
    js = str(tmp_path / "out.json")
    args = ["sendrecv", "-b", "8", "-e", "64K", "-f", "64", "-n", "40", "-w", "2", "-c", "1",
            "--latency"]
    procs, _ = loop_ranks(2, args, json_path=js)
    res = launch_ranks(procs, timeout=60)
    assert_all_ok(res, [8, 512, 32768])
    out = res[0].stdout
    head = "# Time of each operation on rank 0 (us), percentiles over the timed iterations:"
    assert head in out, out
    lines = out.split(head, 1)[1].strip().splitlines()[1:]  # after the column names
    rows = [l.split() for l in lines if l.strip() and not l.startswith("#")]
    assert [int(r[0]) for r in rows] == [8, 512, 32768], out
    report = {r["bytes"]: r for r in load_json(js)["results"]}
    for r in rows:
        assert int(r[1]) == 40, out
        p = [float(x) for x in r[2:7]]
        assert all(x > 0 for x in p) and p == sorted(p), out
        lat = report[int(r[0])]["latency_us"]
        assert [lat[k] for k in ("p1", "p50", "p90", "p99", "max")] == pytest.approx(p, abs=0.051), lat
    assert "# Time of each operation" not in res[1].stdout, res[1].describe()


def test_latency_with_duration_is_refused(perf):
    env = rank_env(0, 1, f"127.0.0.1:{free_port()}")
    (r,) = launch_ranks([Proc(env=env, args=["allreduce", "-b", "8", "-e", "8", "--latency",
                                             "--duration", "1"])], timeout=30)
    assert r.returncode != 0, r.describe()
    assert "--latency" in r.stderr and "--duration" in r.stderr and "exclude" in r.stderr, r.describe()


def test_bad_chunk_size(perf):
    env = rank_env(0, 1, f"127.0.0.1:{free_port()}", R2CCL_CHUNK_SIZE="abc")
    (r,) = launch_ranks([Proc(env=env, args=["sendrecv", "-b", "8", "-e", "8"])], timeout=30)
    assert r.returncode == 2, r.describe()
    assert "R2CCL_CHUNK_SIZE" in r.stderr and "abc" in r.stderr, r.describe()
    assert r.stderr.startswith("r2ccl-perf: "), r.describe()


def test_unknown_nic(perf):
    env = rank_env(0, 1, f"127.0.0.1:{free_port()}", R2CCL_NICS="nosuchnic", R2CCL_BOOTSTRAP_TIMEOUT="2s")
    (r,) = launch_ranks([Proc(env=env, args=["sendrecv", "-b", "8", "-e", "8"])], timeout=30)
    assert r.returncode == 2, r.describe()
    assert "R2CCL_NICS" in r.stderr and "nosuchnic" in r.stderr, r.describe()


def test_no_token_with_rails_outside_loopback_is_refused(perf):
    # Rank 0 on loopback lets a job start without a token, but its rails are the testbed's NICs
    # (198.18.x), whose handshakes the all-zero token would key: both ranks refuse, naming them.
    # With R2CCL_INSECURE_NO_TOKEN=1 the same job runs. (Both ranks on host 0.)
    with Testbed(hosts=2, nics=2) as tb:
        def pair(**extra):
            port = random_port()
            envs = [rank_env(r, 2, f"127.0.0.1:{port}", R2CCL_BOOTSTRAP_TIMEOUT="10s", **extra)
                    for r in range(2)]
            for env in envs:
                del env["R2CCL_BOOTSTRAP_TOKEN"]
            return launch_ranks([Proc(env=env, host=0, args=["sendrecv", "-b", "64K", "-e", "64K"])
                                 for env in envs], testbed=tb, timeout=60)

        refused = pair()
        allowed = pair(R2CCL_INSECURE_NO_TOKEN="1")
    for r in refused:
        assert r.returncode == 2, r.describe()
        assert "R2CCL_BOOTSTRAP_TOKEN is not set" in r.stderr, r.describe()
        assert f"eth1 {Testbed.addr(0, 1)}" in r.stderr, r.describe()
        assert "R2CCL_INSECURE_NO_TOKEN=1" in r.stderr, r.describe()
    assert [r.returncode for r in allowed] == [0, 0], describe(allowed)
    assert "# Out of bounds values : 0 OK" in allowed[0].stdout, describe(allowed)


# --------------------------------------------------------------------------- mpirun


def test_mpirun_two_ranks(perf):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not found (apt-get install openmpi-bin)")
    with Testbed(hosts=2, nics=4) as tb:
        argv = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2",
                "-x", f"R2CCL_BOOTSTRAP={tb.mgmt_addr(0)}:{random_port()}",
                "-x", f"R2CCL_BOOTSTRAP_TOKEN={JOB_TOKEN}",
                str(PERF), "sendrecv", "-b", "1K", "-e", "1M", "-c", "1"]
        (r,) = launch_ranks([Proc(argv=argv, host=0, name="mpirun")], testbed=tb, timeout=120)
    assert r.returncode == 0, r.describe()
    assert "# r2ccl-perf sendrecv: 2 ranks" in r.stdout, r.describe()
    assert_all_ok([r])


# ------------------------------------------------------------------- failures at run time


def test_size_mismatch_between_ranks_is_reported(perf):
    """Rank 0 sends 1M while rank 1 posts 2M: both fail (rc 2) with a clear message
    instead of hanging or 'verifying' garbage."""
    procs, _ = loop_ranks(2, ["sendrecv", "-b", "1M", "-e", "1M", "-n", "2", "-w", "1", "-c", "1"],
                          extra_env={"R2CCL_TIMEOUT": "5s"})
    procs[1].args = ["sendrecv", "-b", "2M", "-e", "2M", "-n", "2", "-w", "1", "-c", "1"]
    res = launch_ranks(procs, timeout=60)
    assert [r.returncode for r in res] == [2, 2], describe(res)
    assert "size mismatch" in res[0].stderr and "1048576" in res[0].stderr and "2097152" in res[0].stderr, \
        describe(res)
    assert CHECK_LINE not in res[0].stdout, describe(res)


def test_peer_killed_midway(perf):
    """Rank 1 is SIGKILLed in the middle of a 64 MiB transfer on a shaped testbed:
    rank 0 must exit 2 with an error naming rank 1 (not hang, not succeed)."""
    args = ["sendrecv", "-b", "64M", "-e", "64M", "-n", "3", "-w", "1", "-c", "1"]
    with Testbed(hosts=2, nics=2, rate="100mbit") as tb:
        procs = tb_ranks(tb, 2, args, extra_env={"R2CCL_TIMEOUT": "5s"})
        procs[1].argv = ["timeout", "-s", "KILL", "2", str(PERF), *args]
        r0, r1 = launch_ranks(procs, testbed=tb, timeout=90)
    assert r1.returncode in (-9, 137), describe([r0, r1])  # killed (timeout kills its own group)
    assert r0.returncode == 2, describe([r0, r1])
    assert "rank 1" in r0.stderr, describe([r0, r1])
    assert CHECK_LINE not in r0.stdout, describe([r0, r1])
