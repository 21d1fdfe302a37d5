"""r2ccl-servebench standalone on the testbed: two hosts of four NICs, the Llama-3.1-8B shape's
serving traffic with a NIC taken down while requests are in flight. Every request must come
back with every token it asked for, for tensor parallelism across the hosts and for a prefill
instance on one host sending KV caches to a decode instance on the other."""

import json
import os
import subprocess
from pathlib import Path

import pytest

import r2ccl_testbed as t

ROOT = Path(__file__).resolve().parents[2]
PYTHON = "/usr/bin/python3"

pytestmark = pytest.mark.skipif(not Path(PYTHON).exists() or subprocess.run(
    [PYTHON, "-c", "import torch"], capture_output=True).returncode != 0,
    reason="needs Debian's python3-torch (scripts/run installs it)")


def library() -> Path:
    return t.wait_for_binary().parent.parent / "lib" / "libr2ccl.so"


def run(tb, tmp: Path, hosts, extra, fault_at: float, requests: int):
    out = tmp / "out"
    port = t.random_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "integrations" / "python"),
               R2CCL_LIBRARY=str(library()), R2CCL_NICS="eth1,eth2,eth3,eth4",
               R2CCL_SOCKET_IFNAME="eth0")
    procs = []
    for rank, host in enumerate(hosts):
        argv = tb.exec_argv(host, [
            PYTHON, "-m", "r2ccl.servebench", "standalone", *extra, "--rank", str(rank),
            "--world", str(len(hosts)), "--master", f"{tb.mgmt_addr(0)}:{port}",
            "--requests", str(requests), "--rate", "2", "--input-len", "64:256",
            "--output-len", "12", "--compute-scale", "20", "--drain", "90", "--quiet",
            "--fault", f"{fault_at}:{t.TESTBED} down {tb.name} 0 eth2", "--out", str(out)])
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            o, e = p.communicate()
        outs.append((p.returncode, o, e))
    assert [rc for rc, _, _ in outs] == [0] * len(hosts), outs
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(len(hosts))]
    faults = [json.loads(x) for x in (out / "faults.jsonl").read_text().splitlines()]
    return ranks, faults, outs


def check(ranks, faults, requests: int, fault_at: float):
    assert len(faults) == 1 and faults[0]["rc"] == 0, faults
    assert faults[0]["at_s"] >= fault_at
    assert all(not rk["errors"] for rk in ranks), [rk["errors"] for rk in ranks]
    reqs = [q for rk in ranks for q in rk.get("requests", [])]
    assert sorted(q["index"] for q in reqs) == list(range(requests))
    for q in reqs:
        assert q["error"] == "" and len(q["token_s"]) == 12, q
        assert q["arrival_s"] < q["token_s"][0] and q["token_s"] == sorted(q["token_s"]), q
    # Requests were in flight when the NIC went down, and after it.
    assert any(q["arrival_s"] < faults[0]["at_s"] < q["token_s"][-1] for q in reqs)
    assert any(q["arrival_s"] > faults[0]["at_s"] for q in reqs)
    return reqs


def test_tensor_parallel_across_hosts_keeps_every_request_through_a_nic_down(tmp_path):
    with t.Testbed(hosts=2, nics=4, rate="200mbit") as tb:
        ranks, faults, _ = run(tb, tmp_path, [0, 1], ["--tp", "2"], 6.0, 24)
    check(ranks, faults, 24, 6.0)
    for rk in ranks:
        # 65 all-reduces a step (embedding, two per layer), the logits' all-gather when sampling.
        assert rk["comm"]["all_reduce"]["calls"] == 65 * len(rk["steps"]), rk["comm"]
        assert 0 < sum(s[3] for s in rk["steps"]) < sum(s[1] - s[0] for s in rk["steps"])


def test_prefill_to_decode_kv_caches_cross_hosts_through_a_nic_down(tmp_path):
    with t.Testbed(hosts=2, nics=4, rate="200mbit") as tb:
        ranks, faults, _ = run(tb, tmp_path, [0, 0, 1, 1],
                               ["--tp", "2", "--prefill", "1", "--decode", "1"], 6.0, 24)
    reqs = check(ranks, faults, 24, 6.0)
    # Every prompt's KV cache went over, from each prefill rank to its decode rank.
    layers_kv = {q["index"]: q["input_len"] * 2 * 4 * 128 * 2 * 32 for q in reqs}
    sent = sum(rk["kv_bytes"] for rk in ranks if rk["role"] == "prefill")
    got = sum(rk["kv_bytes"] for rk in ranks if rk["role"] == "decode")
    assert sent == got == sum(layers_kv.values()) * 2
    assert all(q["kv_arrived_s"] is not None and q["kv_arrived_s"] < q["token_s"][0] for q in reqs)
