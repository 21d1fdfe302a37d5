"""System tests of the NCCL network plugin (libnccl-net-r2ccl.so) as NCCL drives it.

Two testbed hosts x four NICs; on each, r2ccl-test-nccl-net (tests/system/nccl_net_harness.cc)
loads the plugin with dlopen and uses only NCCL's ncclNet_vN_t ABI: it listens, exchanges its
handle through a file, connects and accepts polled to completion, then streams both ways at once
(tagged isends, grouped irecvs of 1 to 8 elements, some sends smaller than the posted receive,
up to 32 requests outstanding per comm) and checks every byte of every message against a pattern
of (message, offset). Faults come from outside, mid-stream: a NIC down, black-holed (nftables),
flapped, or every NIC of a host down past R2CCL_TIMEOUT; bad handles are refused with a WARN.

Every wait is bounded: the harness has its own deadline (--deadline: past it, it prints
"error ... (a hang)" and exits 3) and the test kills what outlives its bound. The NICs run at
100 Mbit/s so that a case takes 10-20 s.
"""

import os
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

from r2ccl_testbed import (BIN_DIR, PERF, TESTBED, BusyTrigger, Testbed, _base_env, link_bytes,
                           wait_for_binary)
from test_endpoint import Tool

TOOL = PERF.parent / "r2ccl-test-nccl-net"
PLUGIN = Path(os.environ.get("R2CCL_NCCL_NET_PLUGIN",
                             str(BIN_DIR.parent / "lib" / "libnccl-net-r2ccl.so")))
NICS = ["eth1", "eth2", "eth3", "eth4"]
RATE = "100mbit"
# Posted receive elements of at most 128 KiB: a group of 8 is 1 MiB, 32 groups in flight.
STREAM = ["--size", "131072"]
OK = re.compile(r"^ok (\d+) (\d+) received \((\d+) groups\), sent (\d+) (\d+) \((\d+) groups\)")
PROGRESS = re.compile(r"^progress (\d+) ")
SLACK_S = 30  # start-up and shutdown on a loaded 2-core machine: catches hangs only


class Harness(Tool):
    """One r2ccl-test-nccl-net process on a testbed host; its output lines as they come
    (test_endpoint.Tool's line reading, waiting and killing)."""

    def __init__(self, tb, host, args, env=None):  # pylint: disable=super-init-not-called
        full_env = _base_env()
        full_env.update({"R2CCL_NICS": ",".join(NICS)})
        for k, v in (env or {}).items():  # None: unset
            if v is None:
                full_env.pop(k, None)
            else:
                full_env[k] = v
        self.argv = tb.exec_argv(host, [str(TOOL), "--plugin", str(PLUGIN), *args])
        self.proc = subprocess.Popen(self.argv, env=full_env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines = []
        self.cv = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def progress(self):
        """The bytes the last progress line counted (sent plus received), 0 before any."""
        with self.cv:
            for ln in reversed(self.lines):
                m = PROGRESS.match(ln)
                if m:
                    return int(m.group(1))
        return 0

    def warnings(self):
        with self.cv:
            return [ln[len("LOG WARN "):] for ln in self.lines if ln.startswith("LOG WARN ")]


def needs_tools():
    wait_for_binary(TOOL)
    if not PLUGIN.is_file():
        pytest.fail(f"{PLUGIN} does not exist (build the target nccl-net-r2ccl, or set "
                    "R2CCL_NCCL_NET_PLUGIN)")


def pair(tb, tmp_path, args, env=None, args1=None):
    """The two harnesses of a stream, host 0 and host 1, each listening and connecting."""
    h0, h1 = str(tmp_path / "handle0"), str(tmp_path / "handle1")
    a = Harness(tb, 0, ["--id", "0", "--handle-out", h0, "--handle-in", h1, *args], env)
    b = Harness(tb, 1, ["--id", "1", "--handle-out", h1, "--handle-in", h0, *(args1 or args)], env)
    return a, b


def finish_ok(procs, timeout):
    """Both harnesses exit 0 with their "ok" line; their received counts, in order."""
    deadline = time.monotonic() + timeout
    oks = []
    for p in procs:
        rc = p.finish(timeout=max(1.0, deadline - time.monotonic()))
        assert rc == 0, f"rc={rc}\n" + both(procs)
        m = next((OK.match(ln) for ln in p.lines if OK.match(ln)), None)
        assert m, both(procs)
        assert int(m.group(1)) > 0 and int(m.group(2)) > 0, both(procs)
        oks.append(m)
    # What one side sent, the other received, message for message.
    assert oks[0].group(1, 2) == oks[1].group(4, 5) and oks[1].group(1, 2) == oks[0].group(4, 5), \
        both(procs)
    return oks


def both(procs):
    """The harnesses' output for a failure message: the last three progress lines only."""
    out = []
    for p in procs:
        with p.cv:
            lines = list(p.lines)
        progress = [i for i, ln in enumerate(lines) if ln.startswith("progress ")]
        drop = set(progress[:-3])
        kept = (ln for i, ln in enumerate(lines) if i not in drop)
        out.append(f"--- {' '.join(p.argv)}\n" + "\n".join(kept))
    return "\n".join(out)


def stream_until_busy(procs, min_bytes=8 << 20, timeout=SLACK_S):
    """Waits until both harnesses are streaming (`min_bytes` counted each), bounded."""
    deadline = time.monotonic() + timeout
    for p in procs:
        while p.progress() < min_bytes:
            if time.monotonic() >= deadline or p.proc.poll() is not None:
                pytest.fail(f"no stream of {min_bytes} bytes within {timeout}s\n" + both(procs))
            time.sleep(0.05)


def run_with_fault(tb, tmp_path, fault, seconds=12, env=None):
    """A stream of `seconds` s both ways with `fault` (argv) run once host 0's eth2 carries data
    after the stream started; returns the two "ok" matches and the bytes counted at the fault."""
    needs_tools()
    procs = pair(tb, tmp_path, [*STREAM, "--seconds", str(seconds), "--deadline",
                                str(seconds + SLACK_S + 30)], env)
    try:
        stream_until_busy(procs)
        trigger = BusyTrigger(tb.ns(0), "eth2", fault, delay=0.0, max_wait=3.0).start()
        trigger.finish(timeout=40)
        at_fault = [p.progress() for p in procs]
        oks = finish_ok(procs, timeout=seconds + 2 * SLACK_S)
    finally:
        for p in procs:
            p.kill()
    assert trigger.result is not None and trigger.result.returncode == 0, trigger.result
    # The stream went on after the fault: each side moved many more bytes.
    for p, before in zip(procs, at_fault):
        assert p.progress() > before + (16 << 20), both(procs)
    return oks, procs


# ------------------------------------------------------------------------------------ cases


def test_healthy_stream_both_ways_every_byte_right(tmp_path):
    needs_tools()
    with Testbed(hosts=2, nics=4, rate=RATE) as tb:
        before = {n: link_bytes(tb.ns(0), n) for n in NICS}
        procs = pair(tb, tmp_path, [*STREAM, "--seconds", "8", "--deadline", "90"])
        try:
            finish_ok(procs, timeout=8 + 2 * SLACK_S)
        finally:
            for p in procs:
                p.kill()
        after = {n: link_bytes(tb.ns(0), n) for n in NICS}
    text = procs[0].text()
    # The ABI versions the plugin exports, and the device it shows NCCL.
    assert re.search(r"^symbols ncclNetPlugin_v8=yes ncclNetPlugin_v9=yes ncclNetPlugin_v10=yes "
                     r"ncclNetPlugin_v11=yes ncclNetPlugin_v12=yes$", text, re.M), text
    assert re.search(r"^version 12 name r2ccl$", text, re.M), text
    assert re.search(r"^devices 1$", text, re.M), text
    props = re.search(r"^properties dev 0: (.*)$", text, re.M)
    assert props, text
    fields = dict(kv.split("=", 1) for kv in props.group(1).split())
    assert fields["ptrSupport"] == "0x1", props.group(0)  # NCCL_PTR_HOST only
    assert fields["maxRecvs"] == "8", props.group(0)
    assert int(fields["speed"]) > 0, props.group(0)
    for p in procs:
        assert not p.warnings(), both(procs)
    # Striped: every NIC carried a share of the stream.
    for n in NICS:
        assert after[n] - before[n] > (4 << 20), (before, after)


def test_every_abi_version_streams(tmp_path):
    # v8 (int sizes, no profiler handles), v9, v10 (connect with a config), v11 (init with a
    # context and a config); v12 is the other cases'. The NICs come from NCCL_SOCKET_IFNAME here
    # (a prefix list), not R2CCL_NICS.
    needs_tools()
    with Testbed(hosts=2, nics=4) as tb:
        for version in (8, 9, 10, 11):
            sub = tmp_path / f"v{version}"
            sub.mkdir()
            env = {"R2CCL_NICS": None, "NCCL_SOCKET_IFNAME": "eth1,eth2,eth3,eth4"}
            procs = pair(tb, sub, [*STREAM, "--version", str(version), "--groups", "100",
                                   "--seconds", "3", "--deadline", "60"], env)
            try:
                finish_ok(procs, timeout=60)
            finally:
                for p in procs:
                    p.kill()
            assert re.search(rf"^version {version} name r2ccl$", procs[0].text(), re.M), both(procs)


def test_nic_down_mid_stream(tmp_path):
    with Testbed(hosts=2, nics=4, rate=RATE) as tb:
        run_with_fault(tb, tmp_path, ["ip", "-n", tb.ns(0), "link", "set", "eth2", "down"])


def test_nic_black_holed_mid_stream(tmp_path):
    # nftables drops everything eth2 of host 0 sends and receives; the link stays up, so only
    # silence can reveal it. It stays black-holed to the end.
    with Testbed(hosts=2, nics=4, rate=RATE) as tb:
        run_with_fault(tb, tmp_path, [str(TESTBED), "blackhole", tb.name, "0", "eth2"])


def test_nic_flapped_five_times_mid_stream(tmp_path):
    # Down 0.3 s, up 0.3 s, five times; the stream goes on for several seconds after.
    with Testbed(hosts=2, nics=4, rate=RATE) as tb:
        run_with_fault(tb, tmp_path, [str(TESTBED), "flap", tb.name, "0", "eth2", "300", "3000"],
                       seconds=14)


def test_all_nics_of_a_host_down_past_the_timeout_is_an_error(tmp_path):
    # Every NIC of host 0 goes down mid-stream and stays down; R2CCL_TIMEOUT is 3 s. Both
    # harnesses must end with an error from the plugin (not a hang: their own deadline is far
    # later), and the plugin's WARN names the peer and the rails.
    needs_tools()
    timeout_s = 3
    with Testbed(hosts=2, nics=4, rate=RATE) as tb:
        procs = pair(tb, tmp_path, [*STREAM, "--seconds", "60", "--deadline", "120"],
                     {"R2CCL_TIMEOUT": f"{timeout_s}s"})
        try:
            stream_until_busy(procs)
            down = " && ".join(f"ip -n {tb.ns(0)} link set {n} down" for n in NICS)
            r = subprocess.run(["sh", "-c", down], capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stderr
            t_down = time.monotonic()
            ended = []
            for p in procs:
                rc = p.finish(timeout=timeout_s + SLACK_S)
                ended.append(time.monotonic() - t_down)
                assert rc == 1, f"rc={rc}\n" + both(procs)
        finally:
            for p in procs:
                p.kill()
    for p, took in zip(procs, ended):
        text = p.text()
        print(f"ended {took:.1f} s after the NICs went down:",
              *[ln for ln in p.lines if ln.startswith("LOG WARN")][:5],
              *[ln for ln in p.lines if ln.startswith("error")], sep="\n  ")
        err = re.search(r"^error (.*)$", text, re.M)
        assert err, both(procs)
        assert "deadline passed" not in err.group(1), both(procs)  # the plugin's error, not ours
        # From test (or a call that started after the failure), never our data check.
        assert re.search(r"returned nccl\w+Error \(\d\)", err.group(1)), both(procs)
        assert took < timeout_s + 20, f"took {took:.1f}s\n" + both(procs)
        # One WARN names the peer and every rail tried (by NIC name or address).
        assert any("peer '" in w and all(n in w or f"198.18.{i}." in w
                                         for i, n in enumerate(NICS, start=1))
                   for w in p.warnings()), both(procs)


KINDS = {  # --bad-handle: what its WARN must name
    "magic": r"magic",
    "length": r"truncated|corrupt|length",
    "truncated": r"malformed|truncated|corrupt|length",
    "wrong-token": r"token|authenticat|challenge|proof|hmac",
}


def test_bad_handles_are_refused_with_a_warning(tmp_path):
    # Host 0 listens; host 1 connects four times, each with the handle damaged: its magic number,
    # its length field garbled, its endpoint part truncated mid-rail, its token. Malformed handles
    # fail at once; a well-formed one with a wrong token within R2CCL_CONNECT_TIMEOUT (3 s).
    # Nothing is ever accepted.
    needs_tools()
    env = {"R2CCL_CONNECT_TIMEOUT": "3s"}
    handle = str(tmp_path / "handle0")
    with Testbed(hosts=2, nics=4) as tb:
        listener = Harness(tb, 0, ["--listen-only", "90", "--handle-out", handle], env)
        results = {}
        try:
            listener.wait_line(r"^listening; handle written", timeout=SLACK_S)
            for kind in KINDS:
                c = Harness(tb, 1, ["--bad-handle", kind, "--handle-in", handle,
                                    "--connect-deadline", "20", "--deadline", "60"], env)
                try:
                    rc = c.finish(timeout=60)
                finally:
                    c.kill()
                assert rc == 0, f"rc={rc} for {kind}\n{c.text()}"
                m = c.wait_line(rf"^rejected {kind} handle after (\d+) ms: connect returned "
                                r"nccl\w+ \(\d\)$", timeout=1)
                results[kind] = (int(m.group(1)), " ".join(c.warnings()), c.text())
            open(handle + ".stop", "w").close()
            assert listener.finish(timeout=SLACK_S) == 0, listener.text()
            listener.wait_line(r"^ok no-accept$", timeout=1)
        finally:
            listener.kill()
    for kind, (ms, warn, text) in results.items():
        print(f"{kind}: refused after {ms} ms: {warn}")
        assert warn, f"{kind}: no WARN logged\n{text}"
        assert re.search(KINDS[kind], warn, re.I), f"{kind}: the WARN does not say what is wrong\n{text}"
        if kind == "wrong-token":
            assert ms < 3000 + 5000, text  # R2CCL_CONNECT_TIMEOUT, and slack for a loaded machine
        else:
            assert ms < 2000, text  # at once: nothing to wait for
