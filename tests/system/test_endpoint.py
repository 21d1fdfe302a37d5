"""System test of endpoints that were never in a world: processes on three testbed hosts connect
by endpoint blobs (r2ccl-test-endpoint), exchange verified data over four rails, leave (killed)
and come back as a new incarnation, while a third process connects.  No rank, no rendezvous.

Times are bounds that catch hangs, and one behaviour bound: the server's operations with a killed
peer must fail "at once" (well before any operation deadline), so the test gives them 3 s where
the deadline is 30 s.
"""

import os
import re
import signal
import subprocess
import threading
import time

import pytest

from r2ccl_testbed import PERF, Testbed, _base_env, _kill_tree, netns_pids_of, wait_for_binary

TOOL = PERF.parent / "r2ccl-test-endpoint"
NICS = "eth1,eth2,eth3,eth4"
GONE_WITHIN_MS = 3000  # R2CCL_TIMEOUT is 30 s: a failure this soon is not a deadline


class Tool:
    """One r2ccl-test-endpoint process on a testbed host; its output lines, as they come."""

    def __init__(self, tb, host, args):
        env = _base_env()
        env.update(R2CCL_NICS=NICS, R2CCL_TIMEOUT="30s")
        self.argv = tb.exec_argv(host, [str(TOOL), *args])
        self.proc = subprocess.Popen(self.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.lines = []
        self.cv = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            with self.cv:
                self.lines.append(line.rstrip("\n"))
                self.cv.notify_all()

    def wait_line(self, pattern, timeout=30.0):
        """The first output line matching `pattern` (a regex), or fails naming what was seen."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self.cv:
            while True:
                for line in self.lines:
                    m = rx.search(line)
                    if m:
                        return m
                left = deadline - time.monotonic()
                if left <= 0:
                    pytest.fail(f"no line matching {pattern!r} within {timeout}s; output:\n" + self.text())
                self.cv.wait(min(left, 0.2))

    def count_verified(self):
        with self.cv:
            counts = [int(m.group(1)) for m in (re.search(r": (\d+) messages verified", ln) for ln in self.lines) if m]
        return max(counts, default=0)

    def text(self):
        with self.cv:
            return "\n".join(self.lines)

    def finish(self, timeout=60.0):
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(self.proc)
            pytest.fail(f"{self.argv} did not exit within {timeout}s; output:\n" + self.text())
        self.reader.join(timeout=5)
        return rc

    def kill(self):
        if self.proc.poll() is None:
            _kill_tree(self.proc)


def rail_bytes(line):
    return [int(x) for x in line.split("rail tx bytes:")[1].split()]


def test_processes_never_in_a_world_connect_by_blob_leave_and_come_back(tmp_path):
    wait_for_binary(TOOL)
    with Testbed(hosts=3, nics=4) as tb:
        blob = str(tmp_path / "a.blob")
        a = Tool(tb, 0, ["serve", blob, "A", "120"])
        b = c = b2 = None
        try:
            a.wait_line(r"A: serving as incarnation [0-9a-f]{16}")
            # B connects from the blob A wrote, and traffic flows over every rail.
            b = Tool(tb, 1, ["connect", blob, "B", "1000000"])
            inc_b1 = b.wait_line(r"B: connected to peer 'A' \(incarnation [0-9a-f]{16}\) as incarnation "
                                 r"([0-9a-f]{16})").group(1)
            line = b.wait_line(r"B: 20 messages verified; rail tx bytes: .*").group(0)
            assert len(rail_bytes(line)) == 4 and all(x > 0 for x in rail_bytes(line)), line
            a.wait_line(rf"A: peer 'B' \(incarnation {inc_b1}\) joined")

            # C connects to A while A <-> B traffic flows, and is served too.
            before = b.count_verified()
            c = Tool(tb, 2, ["connect", blob, "C", "30"])
            assert c.finish() == 0, c.text()
            c.wait_line(r"C: 30 messages verified; rail tx bytes: \d+ \d+ \d+ \d+$")
            assert b.count_verified() > before, "B's traffic stopped while C was connected:\n" + b.text()

            # B is killed: A's operations with it fail at once, naming B's incarnation.
            pids = netns_pids_of(tb.ns(1), TOOL)
            assert pids, "B's process is not in host 1's namespace"
            killed_ms = int(time.time() * 1000)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            b.finish(timeout=10)
            m = a.wait_line(rf"^(\d+) A: peer 'B' \(incarnation {inc_b1}\): peer 'B' \(incarnation {inc_b1}\) "
                            r"is gone: its process ended", timeout=15)
            assert int(m.group(1)) - killed_ms < GONE_WITHIN_MS, a.text()
            a.wait_line(rf"A: peer 'B' \(incarnation {inc_b1}\) left: its process ended")

            # B starts again: a new incarnation, served like the first.
            b2 = Tool(tb, 1, ["connect", blob, "B", "30"])
            assert b2.finish() == 0, b2.text()
            inc_b2 = b2.wait_line(r"as incarnation ([0-9a-f]{16})").group(1)
            assert inc_b2 != inc_b1
            line = b2.wait_line(r"B: 30 messages verified; rail tx bytes: .*").group(0)
            assert len(rail_bytes(line)) == 4 and all(x > 0 for x in rail_bytes(line)), line
            a.wait_line(rf"A: peer 'B' \(incarnation {inc_b2}\) joined")

            open(blob + ".stop", "w").close()
            assert a.finish() == 0, a.text()
            assert "is wrong at byte" not in a.text(), a.text()
        finally:
            for t in (a, b, c, b2):
                if t:
                    t.kill()
