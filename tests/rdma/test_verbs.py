"""r2ccl over real RDMA verbs: Soft-RoCE (rdma_rxe) NICs in the QEMU guest of tests/rdma/rdma-vm.

Runs INSIDE the guest (``tests/rdma/run.sh --hosts 2 --nics 3 -- /usr/bin/python3 -m pytest
tests/rdma/test_verbs.py``); anywhere else every test skips.  Two ranks, plain local processes:
rank 0 uses host 0's NICs (rxe_h0n*), rank 1 host 1's (rxe_h1n*); a "host" is only a naming
convention in the guest (one network namespace), rail n is bridge rail<n>.  Faults come from
``rdma-vm-nic`` (down/up, cut/uncut, blackhole/unblackhole) while ``r2ccl-perf`` moves verified
data (``--duration`` with ``-c 1``).  Like tests/system/test_failover.py the tests assert
behaviour -- exit codes, the Check line, rail events and final rail states -- never timings;
every time bound only catches hangs, and is generous: the guest is emulated (TCG, about
0.3 Gb/s per rail, jitter in the ms range).
"""

import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "system"))

from r2ccl_testbed import (CHECK_LINE, Proc, assert_no_rail_survived,  # noqa: E402
                           assert_rounds_resumed, describe, free_port, launch_ranks, link_down_transitions, perf_ranks,
                           read_events, wait_for_binary)

IN_VM = bool(os.environ.get("RDMA_VM"))
pytestmark = pytest.mark.skipif(not IN_VM, reason="needs the Soft-RoCE guest: run it through "
                                "tests/rdma/run.sh (RDMA_VM is not set)")

VM_NICS = int(os.environ.get("RDMA_VM_NICS", "0") or 0)
# R2CCL_TEST_RDMA_PROVIDER=tcp runs the same tests over the tcp provider on the guest's netdevs
# (R2CCL_NICS=h0n0,... instead of rxe_h0n0,...): a check of this harness itself, and a
# reference for the verbs runs.  The bad-input tests are verbs-only.
PROVIDER = os.environ.get("R2CCL_TEST_RDMA_PROVIDER", "verbs")
# size count type redop root time algbw busbw #wrong algo
ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(-?\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)\s+(\S+)\s*$")
# A rail in service at the end.  Under emulation a healthy rail's measured rate swings enough to
# be judged "degraded" (still used, with less weight): the tests here are about failure and
# re-admission, not that judgement (tests/system/test_failover.py checks it on shaped links).
USABLE = ("up", "degraded")
# Start-up (bootstrap, QP connection) and shutdown under TCG plus one R2CCL_TIMEOUT: hangs only.
SLACK_S = 60
# The guest's two vCPUs run rxe's transport, both ranks and their verification: probes are
# given room so that a busy CPU is not taken for a dead rail.  Real faults are still seen
# through the link state, verbs async events and completion errors.
VM_ENV = {
    "R2CCL_PROVIDER": PROVIDER,
    "R2CCL_BOOTSTRAP_TIMEOUT": "60s",
    "R2CCL_CONNECT_TIMEOUT": "30s",
    "R2CCL_PROBE_INTERVAL": "100ms",
    "R2CCL_PROBE_TIMEOUT": "2s",
    "R2CCL_STALL_TIMEOUT": "5s",
    # 268 ms transport timer (default 14: 67 ms).  Under TCG an acknowledgement is often later
    # than 67 ms, and each spurious retransmission risks (as we read rxe 6.1) a race between its requester
    # (req_retry reads the completer's PSN) and completer (complete_wqe moves that PSN past the
    # WQE before retiring it): the WQE is resent empty, every later PSN shifts, and the responder
    # NAKs the next write with "remote invalid request" (ERR_LENGTH).  With 16, retransmissions
    # fell about 4x and that error went from most runs of the fault tests to none seen.
    "R2CCL_IB_TIMEOUT": "16",
}


# ------------------------------------------------------------------------------- helpers


@pytest.fixture
def perf() -> Path:
    return wait_for_binary()


def need_nics(k: int) -> None:
    if VM_NICS < k:
        pytest.skip(f"needs {k} NICs per host, the guest has {VM_NICS} (rdma-vm --nics {k})")


def netdev(host: int, n: int) -> str:
    return f"h{host}n{n}"


def rxe(host: int, n: int) -> str:
    """Host `host`'s NIC n as r2ccl names it: the verbs device (the netdev under tcp)."""
    return f"rxe_h{host}n{n}" if PROVIDER == "verbs" else f"h{host}n{n}"


def rank_nics(rank: int, k: int) -> str:
    """R2CCL_NICS of `rank` (on host `rank`): its first k rxe devices."""
    return ",".join(rxe(rank, n) for n in range(k))


def ranks(args, k: int, nics=None, **env):
    """Two r2ccl-perf ranks over the verbs provider, rank r on host r's first k NICs."""
    boot = f"127.0.0.1:{free_port()}"
    e = dict(VM_ENV)
    e.update({key: str(v) for key, v in env.items()})
    return perf_ranks(2, boot, args, nics=nics or [rank_nics(r, k) for r in (0, 1)], extra_env=e)


def duration_args(seconds, events, size="8M", keep_going=False):
    a = ["sendrecv", "-b", size, "-e", size, "-w", "0", "-c", "1", "--duration", str(seconds),
         "--events", events]
    return a + (["--keep-going"] if keep_going else [])


TOUCHED = set()  # NICs faulted by the running test (cleared after it)


def nic_cmd(action, nic, *extra):
    """`rdma-vm-nic ACTION NIC ...` (argv); NIC is then cleared after the test."""
    TOUCHED.add(nic)
    return ["rdma-vm-nic", action, nic, *extra]


def set_link_down(dev: str) -> subprocess.CompletedProcess:
    """Admin-down of netdev `dev` through one rtnetlink request from this process, what
    `ip link set DEV down` (and `rdma-vm-nic down`) does, without forking bash and ip, which
    takes most of a second under TCG: the fault lands while the traffic just seen is still in
    flight.  Returns a CompletedProcess (returncode 0, or the kernel's errno) for BusyTrigger."""
    TOUCHED.add(dev)
    argv = ["rtnetlink", "down", dev]
    try:
        index = socket.if_nametoindex(dev)
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as s:
            s.settimeout(10.0)
            rtm_newlink, nlm_f_request, nlm_f_ack, iff_up = 16, 1, 4, 1
            body = struct.pack("=BxHiII", socket.AF_UNSPEC, 0, index, 0, iff_up)
            s.send(struct.pack("=IHHII", 16 + len(body), rtm_newlink, nlm_f_request | nlm_f_ack,
                               1, 0) + body)
            reply = s.recv(65536)
        length, kind = struct.unpack_from("=IH", reply)
        if kind != 2 or length < 20:  # NLMSG_ERROR carries the answer (0: done)
            return subprocess.CompletedProcess(argv, -1, "", f"unexpected netlink reply {kind}")
        err = -struct.unpack_from("=i", reply, 16)[0]
        return subprocess.CompletedProcess(argv, err, "", os.strerror(err) if err else "")
    except OSError as e:
        return subprocess.CompletedProcess(argv, -1, "", str(e))


def table_rows(stdout):
    """(bytes, #wrong) of every row of rank 0's table."""
    return [(int(m.group(1)), m.group(9)) for m in map(ROW.match, stdout.splitlines()) if m]


def assert_verified(res, n=2):
    """The first n processes exited 0, rank 0 verified every byte, no row has wrong bytes."""
    assert [r.returncode for r in res[:n]] == [0] * n, describe(res)
    assert CHECK_LINE in res[0].stdout, describe(res)
    assert all(w in ("0", "N/A") for _, w in table_rows(res[0].stdout)), describe(res)


def assert_verbs(res, k):
    """Rank 0's header says the verbs provider carried it, over k rails."""
    assert f"{k} rail(s) per rank" in res[0].stdout and f"provider {PROVIDER}" in res[0].stdout, describe(res)


def dump(ev):
    out = []
    for r in (0, 1):
        try:
            out.append(f"--- {ev}.rank{r}:\n" + open(f"{ev}.rank{r}").read())
        except OSError as e:
            out.append(f"--- {ev}.rank{r}: {e}")
    return "\n".join(out)


def of(events, nic, kind):
    return [e for e in events if e["nic"] == nic and e["kind"] == kind]


def wire_bytes(dev: str) -> int:
    """Bytes sent plus received by netdev `dev` (read from sysfs: no fork, cheap under TCG)."""
    total = 0
    for d in ("tx_bytes", "rx_bytes"):
        try:
            with open(f"/sys/class/net/{dev}/statistics/{d}") as f:
                total += int(f.read())
        except (OSError, ValueError):
            return -1
    return total


class BusyTrigger:
    """Runs `argv` (an argv, or a function returning a CompletedProcess) once netdev `dev` is
    seen carrying data, so that the fault hits chunks in flight; if no data passes within `max_wait` seconds it never runs (`result` stays None):
    a NIC failed before the rails are up tests start-up, not failover.  Like
    r2ccl_testbed.BusyTrigger, for the guest's single namespace."""

    def __init__(self, dev, argv, delay, min_bytes=65536, window=0.02, max_wait=30.0):
        self.dev, self.delay = dev, delay
        self.argv = argv if callable(argv) else list(argv)
        self.min_bytes, self.window, self.max_wait = min_bytes, window, max_wait
        self.busy, self.wall_ns, self.result = False, 0, None
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        if self._cancel.wait(self.delay):
            return
        end = time.monotonic() + self.max_wait
        prev = wire_bytes(self.dev)
        while time.monotonic() < end and not self._cancel.is_set():  # bounded: max_wait
            time.sleep(self.window)
            cur = wire_bytes(self.dev)
            if prev >= 0 and cur - prev >= self.min_bytes:
                self.busy = True
                break
            prev = cur
        if self._cancel.is_set() or not self.busy:
            return
        self.wall_ns = time.time_ns()
        if callable(self.argv):
            self.result = self.argv()
            return
        try:
            self.result = subprocess.run(self.argv, stdin=subprocess.DEVNULL, capture_output=True,
                                         text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            self.result = subprocess.CompletedProcess(self.argv, -1, "", str(e))

    def start(self):
        self._thread.start()
        return self

    def finish(self, timeout=60.0):
        self._thread.join(timeout)


@pytest.fixture(autouse=True)
def clean_fabric():
    """The NICs a test faulted are healthy again afterwards, whatever happened in it
    (`rdma-vm-nic clear` takes most of a second under TCG, so only those)."""
    TOUCHED.clear()
    yield
    for nic in sorted(TOUCHED):
        subprocess.run(["rdma-vm-nic", "clear", nic], stdin=subprocess.DEVNULL, capture_output=True,
                       timeout=30, check=False)
    TOUCHED.clear()


# ---------------------------------------------------------------------------- the guest


def test_guest_fabric(perf):
    """The guest itself (no r2ccl data path): rxe devices with the IPv4 RoCE v2 GID, and
    rdma-vm-nic takes a port down and up.  When this fails, the rest says nothing."""
    assert VM_NICS >= 2 and int(os.environ.get("RDMA_VM_HOSTS", "0")) >= 2, dict(os.environ)
    topo = [ln.split() for ln in open(os.environ["RDMA_VM_TOPOLOGY"]) if not ln.startswith("#")]
    assert {t[3] for t in topo} >= {f"rxe_h{h}n{n}" for h in (0, 1) for n in range(2)}, topo
    for t in topo:
        assert t[5] == os.environ.get("RDMA_VM_GID_INDEX", "1"), topo
        a, b, c, d = (int(x) for x in t[4].split("."))
        with open(f"/sys/class/infiniband/{t[3]}/ports/1/gids/{t[5]}") as f:
            assert f.read().strip().endswith(f"ffff:{a:02x}{b:02x}:{c:02x}{d:02x}"), t

    def port_state():
        with open("/sys/class/infiniband/rxe_h0n1/ports/1/state") as f:
            return f.read().strip()

    assert port_state() == "4: ACTIVE"
    assert subprocess.run(nic_cmd("down", "h0n1"), timeout=30).returncode == 0
    assert port_state() == "1: DOWN"
    assert subprocess.run(nic_cmd("up", "h0n1"), timeout=30).returncode == 0
    for _ in range(100):  # bounded: 10 s
        if port_state() == "4: ACTIVE":
            break
        time.sleep(0.1)
    assert port_state() == "4: ACTIVE"
    r = subprocess.run([str(perf), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "sendrecv" in r.stdout, r.stderr


# ------------------------------------------------------------------------------ data path


@pytest.mark.parametrize("gid", ["auto", "1"], ids=["gid-by-address", "gid-index-1"])
def test_sendrecv_verified(perf, gid):
    """Eager (8 B), striped and multi-chunk messages over two verbs rails, every byte checked;
    the bytes crossed both rails' wires (rxe, not loopback)."""
    need_nics(2)
    if gid != "auto":
        verbs_only()
    env = {} if gid == "auto" else {"R2CCL_IB_GID_INDEX": gid}
    args = ["sendrecv", "-b", "8", "-e", "8M", "-f", "4", "-n", "3", "-w", "1", "-c", "1"]
    before = [wire_bytes(netdev(0, n)) for n in (0, 1)]
    res = launch_ranks(ranks(args, 2, **env), timeout=120 + SLACK_S)
    after = [wire_bytes(netdev(0, n)) for n in (0, 1)]
    assert_verified(res)
    assert_verbs(res, 2)
    rows = table_rows(res[0].stdout)
    assert [b for b, _ in rows] == [8 * 4 ** i for i in range(11)], res[0].stdout  # 8 B .. 8 MiB
    for n in (0, 1):
        assert after[n] - before[n] >= 4 * 2**20, (f"rail {n} (h0n{n}) carried {after[n] - before[n]} "
                                                   "bytes on the wire\n" + describe(res))


# ---------------------------------------------------------------------------------- faults


def test_nic_down_mid_transfer(perf, tmp_path):
    """`rdma-vm-nic down h0n1` while chunks are in flight on it: the transfer completes,
    verified; the rail failed on both ranks and its unconfirmed chunks were replayed."""
    need_nics(3)
    k, dur = 3, 8
    ev = ""
    in_flight = replayed = False
    # A fault that lands between rounds proves nothing about replay: long rounds (32 MiB, about
    # half a second on the emulated rails), the link taken down from this process the moment
    # traffic is seen (rdma-vm-nic takes up to a second to act under TCG), and up to five trials.
    for trial in range(5):
        ev = str(tmp_path / f"ev{trial}")
        down = BusyTrigger("h0n1", lambda: set_link_down("h0n1"), delay=2.0).start()
        try:
            res = launch_ranks(ranks(duration_args(dur, ev, size="32M"), k), timeout=dur + SLACK_S)
        finally:
            down.finish()
        assert_verified(res)
        assert_verbs(res, k)
        assert down.result is not None, "no data crossed h0n1 within 30 s: nothing to fault"
        assert down.result.returncode == 0, down.result
        for rank in (0, 1):
            events, finals = read_events(ev, rank)
            bad = rxe(rank, 1)
            failed = of(events, bad, "failed")
            assert failed, f"rank {rank}: no 'failed' event for {bad}\n" + dump(ev)
            assert all(e["wall_ns"] >= down.wall_ns for e in failed), (down.wall_ns, dump(ev))
            assert finals[bad]["state"] == "down", dump(ev)
            others = [rxe(rank, n) for n in range(k) if n != 1]
            assert all(finals[o]["state"] in USABLE for o in others), dump(ev)
            in_flight |= any("; 0 chunk(s)" not in e["detail"] for e in failed)
            replayed |= bool(of(events, bad, "replay_started"))
            replayed |= any(finals[o]["replayed_chunks"] > 0 for o in others)
        if in_flight and down.busy:
            break
        # Another trial: h0n1 must be up again first (a rail cannot be opened on a downed NIC).
        subprocess.run(nic_cmd("clear", "h0n1"), stdin=subprocess.DEVNULL, capture_output=True,
                       timeout=30, check=False)
        time.sleep(2.0)  # carrier and the port back (PORT_ACTIVE) before the next launch
    assert in_flight, "the fault never hit chunks in flight on rail 1\n" + dump(ev)
    assert replayed, "rail 1's unconfirmed chunks were not replayed on another rail\n" + dump(ev)


@pytest.mark.parametrize("fault,heal", [("cut", "uncut"), ("blackhole", "unblackhole")],
                         ids=["cable-cut", "black-hole"])
def test_fault_detected_and_readmitted(perf, tmp_path, fault, heal):
    """A cable cut (carrier lost; the requester sees only retry exhaustion) or a black hole
    (link up, packets dropped; no event at all) on h0n1 mid-transfer, healed 6 s later:
    verified throughout, the rail failed during the fault and was re-admitted (new queue
    pairs) after the heal."""
    need_nics(2)
    k, dur = 2, 26
    ev = str(tmp_path / "ev")
    procs = ranks(duration_args(dur, ev), k)
    # One script, so that the fault lasts 6 s from the moment it is in place, however long the
    # busy guest takes to run rdma-vm-nic.  It prints the wall time (ns) before the fault, after
    # it, before the heal and after it.
    TOUCHED.add("h0n1")
    script = (f'date +%s%N; rdma-vm-nic {fault} h0n1 || exit 1; date +%s%N; sleep 6; '
              f'date +%s%N; rdma-vm-nic {heal} h0n1 || exit 1; date +%s%N')
    procs.append(Proc(argv=["bash", "-c", script], delay=3.0, name=f"{fault}, 6 s, {heal}"))
    res = launch_ranks(procs, timeout=dur + SLACK_S)
    assert_verified(res)
    assert_verbs(res, k)
    assert res[2].returncode == 0, describe(res)
    t_fault, _, t_heal, _ = (int(x) for x in res[2].stdout.split()[:4])
    for rank in (0, 1):
        events, finals = read_events(ev, rank)
        bad = rxe(rank, 1)
        # Only failures during the fault: a rank that exits first may make the other log more.
        failed = [e for e in of(events, bad, "failed") if e["wall_ns"] <= t_heal]
        assert failed, f"rank {rank}: no 'failed' event for {bad} during the {fault}\n" + dump(ev)
        assert all(e["wall_ns"] >= t_fault for e in of(events, bad, "failed")), (t_fault, dump(ev))
        readmitted = of(events, bad, "readmitted")
        assert readmitted, f"rank {rank}: {bad} was not re-admitted after the {heal}\n" + dump(ev)
        assert all(e["wall_ns"] > t_heal for e in readmitted), (t_heal, dump(ev))
        assert finals[bad]["state"] in USABLE, dump(ev)
        assert finals[rxe(rank, 0)]["state"] in USABLE, dump(ev)
    if fault == "blackhole":
        # The link stayed up: no link_down from anyone; only silence revealed it.
        assert not any(e["kind"] == "link_down" for r in (0, 1) for e in read_events(ev, r)[0]), dump(ev)
    else:
        # Host 0's NIC lost carrier: rank 0 saw its link (or port) go down.
        assert of(read_events(ev, 0)[0], rxe(0, 1), "link_down"), dump(ev)


def test_flapping_nic_is_held_down(perf, tmp_path):
    """h0n1 goes down and up every 0.3 s for a few seconds: each outage counts as a flap, the
    rail is not re-admitted while it flaps, and is re-admitted once after it settles, after a
    hold-down that grew with the flaps (bounded by R2CCL_HOLDDOWN_MAX).  The flapping uses `ip
    link` itself (what `rdma-vm-nic down/up` does): rdma-vm-nic takes up to a second per call
    on a busy emulated guest, and an up period longer than the 2 s hold-down is no flap."""
    need_nics(2)
    k, dur = 2, 26
    ev = str(tmp_path / "ev")
    # The monitor starts first and outlives the flap (which is bounded by 8 cycles and 8 s).
    monitor = Proc(argv=["timeout", "14", "ip", "monitor", "link"], name="ip monitor")
    procs = [monitor] + ranks(duration_args(dur, ev), k, R2CCL_HOLDDOWN="2s", R2CCL_HOLDDOWN_MAX="6s")
    for p in procs[1:]:
        p.delay = 0.2
    flap_sh = ('date +%s%N; end=$((SECONDS + 8)); i=0; '
               'while [ $i -lt 8 ] && [ $SECONDS -lt $end ]; do '
               'ip link set dev h0n1 down || exit 1; sleep 0.3; ip link set dev h0n1 up || exit 1; '
               'sleep 0.3; '
               'i=$((i + 1)); done; date +%s%N')
    TOUCHED.add("h0n1")
    flap = Proc(argv=["bash", "-c", flap_sh], delay=3.0, name="flap")
    res = launch_ranks(procs + [flap], timeout=dur + SLACK_S)
    mon, r0, r1, fl = res
    assert_verified([r0, r1, mon, fl])
    assert_verbs([r0], k)
    assert mon.returncode == 124, mon.describe()  # ended by its time limit, as intended
    assert fl.returncode == 0, fl.describe()
    flap_start, flap_end = (int(x) for x in fl.stdout.split()[:2])

    bad = rxe(0, 1)
    downs = link_down_transitions(mon.stdout, "h0n1")
    assert downs >= 3, mon.stdout
    events, finals = read_events(ev, 0)
    assert finals[bad]["flaps"] == downs, (downs, finals[bad], mon.stdout)
    assert len(of(events, bad, "link_down")) == downs, (downs, dump(ev))

    readmitted = of(events, bad, "readmitted")
    assert readmitted, f"{bad} was not re-admitted after the flap ended\n" + dump(ev)
    assert all(e["wall_ns"] > flap_end for e in readmitted), (flap_end, dump(ev))
    last_up = max(e["wall_ns"] for e in of(events, bad, "link_up"))
    assert flap_start < last_up <= flap_end, (flap_start, last_up, flap_end)
    m = re.search(r"hold-down was (\d+)ms", readmitted[0]["detail"])
    assert m, readmitted[0]
    holddown_ms = int(m.group(1))
    assert holddown_ms > 2000, f"the hold-down did not grow with the flaps: {readmitted[0]}"
    assert holddown_ms <= 6000, readmitted[0]  # R2CCL_HOLDDOWN_MAX
    # Not re-admitted before the hold-down ran out (a lower bound, not a timing expectation).
    assert readmitted[0]["wall_ns"] - last_up >= (holddown_ms - 50) * 1_000_000, (last_up, readmitted[0])
    assert finals[bad]["state"] in USABLE, dump(ev)


def test_all_nics_down_then_one_back(perf, tmp_path):
    """Every NIC of host 0 down: each rank's round fails with a clear error ("no rail to rank
    ... survived", naming every rail) within the deadline, not a hang; one NIC back up: it is
    re-admitted and rounds complete again."""
    need_nics(2)
    k, dur, timeout_s = 2, 26, 5
    ev = str(tmp_path / "ev")
    procs = ranks(duration_args(dur, ev, keep_going=True), k, R2CCL_TIMEOUT=f"{timeout_s}s")
    down_all = " && ".join(" ".join(nic_cmd("down", netdev(0, n))) for n in range(k))
    up_one = " ".join(nic_cmd("up", netdev(0, 1)))
    # The outage is timed from the moment every NIC is down (the emulated guest took up to 4 s
    # for the two downs): longer than R2CCL_TIMEOUT, so that a round fails.  The script prints
    # the wall time (ns) before the downs and before the up.
    procs.append(Proc(argv=["sh", "-c", f"date +%s%N; {down_all} && sleep {timeout_s + 3} && "
                                        f"date +%s%N && {up_one}"],
                      delay=3.0, name="all down, then one up"))
    res = launch_ranks(procs, timeout=dur + SLACK_S)
    r0, r1 = res[0], res[1]
    assert [r0.returncode, r1.returncode] == [2, 2], describe(res)
    assert res[2].returncode == 0, describe(res)
    for r in (r0, r1):
        assert r.elapsed < dur + 40, r.describe()  # generous: no hang
    for rank, r in ((0, r0), (1, r1)):
        assert_no_rail_survived(r, [rxe(rank, n) for n in range(k)])
    up_t = int(res[2].stdout.split()[1])

    assert_rounds_resumed(r0, res)

    events, finals = read_events(ev, 0)
    back = rxe(0, 1)
    readmitted = of(events, back, "readmitted")
    assert readmitted and all(e["wall_ns"] > up_t for e in readmitted), (up_t, dump(ev))
    assert finals[back]["state"] in USABLE, dump(ev)
    assert finals[rxe(0, 0)]["state"] == "down", dump(ev)


@pytest.mark.parametrize("op", ["sendrecv", "allreduce"])
def test_perf_with_nic_failed_midway(perf, op):
    """r2ccl-perf's ordinary size sweep (-n iterations, -c 1) while host 1's NIC 1 goes down
    in the middle: exit 0, every row verified with #wrong 0."""
    need_nics(2)
    k = 2
    args = [op, "-b", "64K", "-e", "8M", "-f", "2", "-n", "4", "-w", "1", "-c", "1"]
    down = BusyTrigger("h1n1", nic_cmd("down", "h1n1"), delay=3.0).start()
    try:
        res = launch_ranks(ranks(args, k), timeout=240 + SLACK_S)
    finally:
        down.finish()
    assert down.result is not None and down.result.returncode == 0, down.result
    assert_verified(res)
    assert_verbs(res, k)
    rows = table_rows(res[0].stdout)
    assert [b for b, _ in rows] == [65536 * 2 ** i for i in range(8)], res[0].stdout
    assert all(w == "0" for _, w in rows), res[0].stdout


# ----------------------------------------------------------------------------- bad input


def test_nccl_net_plugin_over_verbs(perf, tmp_path):
    """NCCL's network plugin over the verbs provider, driven through NCCL's ABI by
    r2ccl-test-nccl-net (tests/system/nccl_net_harness.cc): two processes, each on its host's
    first two rxe NICs, stream tagged and grouped messages both ways for a few seconds; every
    byte is checked by the harness, and both rails' wires carried the stream."""
    need_nics(2)
    harness = perf.parent / "r2ccl-test-nccl-net"
    plugin = perf.parent.parent / "lib" / "libnccl-net-r2ccl.so"
    for f in (harness, plugin):
        if not f.exists():
            pytest.fail(f"{f} does not exist (build the targets r2ccl-test-nccl-net nccl-net-r2ccl)")
    handles = [str(tmp_path / f"handle{i}") for i in (0, 1)]
    before = [wire_bytes(netdev(0, n)) for n in (0, 1)]
    procs = []
    for i in (0, 1):
        env = dict(os.environ)
        env.update(VM_ENV)
        env["R2CCL_NICS"] = rank_nics(i, 2)
        argv = [str(harness), "--plugin", str(plugin), "--id", str(i), "--handle-out", handles[i],
                "--handle-in", handles[1 - i], "--size", "131072", "--seconds", "4",
                "--deadline", "150"]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=150 + SLACK_S)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    after = [wire_bytes(netdev(0, n)) for n in (0, 1)]
    text = "\n".join(f"--- process {i} (exit {p.returncode}):\n{o}" for i, (p, o) in
                     enumerate(zip(procs, outs)))
    for p, out in zip(procs, outs):
        assert p.returncode == 0, text
        assert re.search(r"^ok \d+ \d+ received", out, re.M), text
    assert re.search(rf"name=r2ccl\[{rank_nics(0, 2).replace(',', '[+]')}\]", outs[0]), text
    for n in (0, 1):
        assert after[n] - before[n] >= 1 << 20, (f"rail {n} (h0n{n}) carried "
                                                 f"{after[n] - before[n]} bytes\n" + text)


def verbs_only():
    if PROVIDER != "verbs":
        pytest.skip("verbs-only (R2CCL_TEST_RDMA_PROVIDER is not verbs)")


def test_unknown_device_is_a_clear_error(perf):
    verbs_only()
    res = launch_ranks(ranks(["sendrecv", "-b", "1M", "-e", "1M", "-n", "1", "-c", "1"], 1,
                             nics=["rxe_bogus", "rxe_bogus"], R2CCL_BOOTSTRAP_TIMEOUT="20s"),
                       timeout=60 + SLACK_S)
    assert all(r.returncode != 0 for r in res), describe(res)
    for r in res:
        assert "no verbs device named 'rxe_bogus'" in r.stderr, describe(res)


def test_missing_gid_index_is_a_clear_error(perf):
    verbs_only()
    need_nics(1)
    res = launch_ranks(ranks(["sendrecv", "-b", "1M", "-e", "1M", "-n", "1", "-c", "1"], 1,
                             R2CCL_IB_GID_INDEX="99", R2CCL_BOOTSTRAP_TIMEOUT="20s"),
                       timeout=60 + SLACK_S)
    assert all(r.returncode != 0 for r in res), describe(res)
    for r in res:
        assert "no GID at index 99" in r.stderr, describe(res)
