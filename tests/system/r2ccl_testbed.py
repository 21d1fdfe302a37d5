"""Helpers for r2ccl system tests: netns testbeds and multi-process rank launches.

* ``Testbed``: a context manager around ``tests/testbed/testbed``.  Each instance gets
  a unique name ("st" + pid + counter), is created on enter and destroyed on exit,
  and is also destroyed from atexit and SIGTERM/SIGHUP handlers, so interrupted runs
  leave no namespaces behind.  If ``testbed check`` exits 77 the test is skipped with
  its reason.
* ``launch_ranks``: starts one process per rank (``r2ccl-perf`` by default) either in a
  testbed host namespace or in the current namespace (loopback), each in its own
  process group, with a hard wall-clock limit.  On expiry every process group (and
  any stray descendant) is killed and the test fails with the collected output.

Every wait here is bounded.  The binaries come from ``$R2CCL_TEST_BIN`` (default:
``<repo>/build/bin``).
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN_DIR = Path(os.environ.get("R2CCL_TEST_BIN", str(REPO / "build" / "bin")))
PERF = BIN_DIR / "r2ccl-perf"
TESTBED = REPO / "tests" / "testbed" / "testbed"

# Testbed subcommands are bounded internally (a few seconds); these are backstops.
TESTBED_CMD_TIMEOUT = 60.0
BINARY_WAIT = 120.0  # the binary may be relinked under us; wait at most this long

_counter = itertools.count(1)
_live: Dict[str, "Testbed"] = {}
_live_lock = threading.Lock()
_check_result: Optional[tuple] = None


# --------------------------------------------------------------------------- binaries


def wait_for_binary(path: Path = PERF, timeout: float = BINARY_WAIT) -> Path:
    """Returns `path` once it exists and is executable (it may be briefly missing
    while it is rebuilt); fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if path.is_file() and os.access(path, os.X_OK):
            return path
        if time.monotonic() >= deadline:
            pytest.fail(f"{path} does not exist (set R2CCL_TEST_BIN or build the project)")
        time.sleep(0.5)


# ---------------------------------------------------------------------------- testbed


def _run(argv: Sequence[str], timeout: float = TESTBED_CMD_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout, check=False)


def testbed_check() -> None:  # noqa: D401 (not a test despite the name)
    """Skips the calling test if the testbed cannot run here (exit 77), fails on
    other errors.  The result is cached for the session."""
    global _check_result
    if _check_result is None:
        try:
            r = _run([str(TESTBED), "check"])
            _check_result = (r.returncode, r.stderr.strip() or r.stdout.strip())
        except (OSError, subprocess.TimeoutExpired) as e:
            _check_result = (1, f"testbed check failed to run: {e}")
    rc, why = _check_result
    if rc == 77:
        pytest.skip(f"testbed unavailable: {why}")
    if rc != 0:
        pytest.fail(f"testbed check exited {rc}: {why}")


def _destroy_all() -> None:
    with _live_lock:
        beds = list(_live.values())
    for tb in beds:
        tb.destroy()


def _on_signal(signum, _frame):
    _destroy_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


testbed_check.__test__ = False
atexit.register(_destroy_all)
if threading.current_thread() is threading.main_thread():
    for _sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(_sig) in (signal.SIG_DFL, None):
            signal.signal(_sig, _on_signal)


def _unique_name() -> str:
    # ^[a-z][a-z0-9]{0,11}$: "st" + 4 pid digits + counter (up to 6 digits).
    return f"st{os.getpid() % 10000:04d}{next(_counter)}"


class Testbed:
    """``with Testbed(hosts=2, nics=4, rate="100mbit") as tb: ...``"""

    __test__ = False  # not a pytest test class

    def __init__(self, hosts: int, nics: int, rate: Optional[str] = None, name: Optional[str] = None,
                 mtu: Optional[int] = None):
        self.hosts = hosts
        self.nics = nics
        self.rate = rate
        self.mtu = mtu
        self.name = name or _unique_name()
        self._created = False

    # -- lifecycle
    def __enter__(self) -> "Testbed":
        testbed_check()
        with _live_lock:
            _live[self.name] = self
        argv = [str(TESTBED), "create", self.name, "--hosts", str(self.hosts), "--nics", str(self.nics)]
        if self.rate:
            argv += ["--rate", self.rate]
        if self.mtu:
            argv += ["--mtu", str(self.mtu)]
        self._created = True
        r = _run(argv)
        if r.returncode == 77:
            self.destroy()
            pytest.skip(f"testbed unavailable: {r.stderr.strip()}")
        if r.returncode != 0:
            self.destroy()
            pytest.fail(f"testbed create {self.name} exited {r.returncode}: {r.stderr.strip()}")
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def destroy(self) -> None:
        with _live_lock:
            _live.pop(self.name, None)
        if not self._created:
            return
        self._created = False
        try:
            _run([str(TESTBED), "destroy", self.name])
        except (OSError, subprocess.TimeoutExpired):
            pass

    def ns(self, host) -> str:
        return f"{self.name}-h{host}" if host != "sw" else f"{self.name}-sw"

    @staticmethod
    def mgmt_addr(host: int) -> str:
        return f"198.19.0.{host + 1}"

    @staticmethod
    def addr(host: int, nic: int) -> str:
        return f"198.18.{nic}.{host + 1}"

    def exec_argv(self, host, argv: Sequence[str]) -> List[str]:
        return [str(TESTBED), "exec", self.name, str(host), "--", *argv]

    def run(self, host, argv: Sequence[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
        return _run(self.exec_argv(host, argv), timeout=timeout)

    def tb(self, *args: str) -> subprocess.CompletedProcess:
        """Runs a testbed subcommand on this testbed, e.g. tb("down", "0", "eth2")."""
        return _run([str(TESTBED), args[0], self.name, *args[1:]])


# --------------------------------------------------------------------------- launching


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (bounded number of tries)."""
    for _ in range(50):
        port = random.randint(20000, 60999)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port found on {host}")


def random_port() -> int:
    """A port for a fresh namespace (nothing else listens there)."""
    return random.randint(20000, 60999)


# The job token of every launch from this test process (ranks on testbed addresses need one).
JOB_TOKEN = secrets.token_hex(16)


def rank_env(rank: int, nranks: int, bootstrap: str, **extra: str) -> Dict[str, str]:
    env = {"R2CCL_RANK": str(rank), "R2CCL_NRANKS": str(nranks), "R2CCL_BOOTSTRAP": bootstrap,
           "R2CCL_BOOTSTRAP_TOKEN": JOB_TOKEN}
    env.update({k: str(v) for k, v in extra.items()})
    return env


@dataclass
class Proc:
    """One process to launch.  `argv` defaults to r2ccl-perf with `args`;
    `host` is a testbed host index (None: this namespace); `delay` is seconds after
    the launch starts."""

    env: Dict[str, str] = field(default_factory=dict)
    args: Sequence[str] = ()
    host: Optional[int] = None
    delay: float = 0.0
    argv: Optional[Sequence[str]] = None
    name: str = ""


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    elapsed: float
    name: str = ""
    t_start: float = 0.0  # time.monotonic() when it was started
    t_end: float = 0.0    # time.monotonic() when it was seen to have exited (or was killed)

    def __iter__(self):  # allows: rc, out, err = result
        return iter((self.returncode, self.stdout, self.stderr))

    def describe(self) -> str:
        return (f"--- {self.name}: rc={self.returncode} after {self.elapsed:.1f}s\n"
                f"[stdout]\n{self.stdout}\n[stderr]\n{self.stderr}")


def describe(results: Sequence[Result]) -> str:
    return "\n".join(r.describe() for r in results)


def _base_env() -> Dict[str, str]:
    env = {}
    for k, v in os.environ.items():
        if k.startswith(("OMPI_", "PMI_", "PMIX_")):
            continue
        if k.startswith("R2CCL_") and not k.startswith("R2CCL_TEST_"):
            continue
        env[k] = v
    return env


def _descendants(pid: int) -> List[int]:
    children: Dict[int, List[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    for _ in range(10000):  # bounded walk
        if not todo:
            break
        p = todo.pop()
        for c in children.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def _kill_tree(p: subprocess.Popen) -> None:
    victims = _descendants(p.pid)
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except OSError:
        pass
    for v in victims:
        try:
            os.kill(v, signal.SIGKILL)
        except OSError:
            pass


def launch_ranks(procs: Sequence[Proc], testbed: Optional[Testbed] = None, timeout: float = 60.0,
                 cwd: Optional[Path] = None) -> List[Result]:
    """Starts every Proc (in order of `delay`), waits for all of them, returns their
    Results in the order given.  If they are not all done within `timeout` seconds
    of the start, every process group is killed and the test fails."""
    wait_for_binary()
    base = _base_env()
    tmp = tempfile.TemporaryDirectory(prefix="r2ccl-st-")
    n = len(procs)
    popens: List[Optional[subprocess.Popen]] = [None] * n
    files = []
    started = [0.0] * n
    ended: List[Optional[float]] = [None] * n
    names = [p.name or f"proc {i} (R2CCL_RANK={p.env.get('R2CCL_RANK', '-')})" for i, p in enumerate(procs)]
    order = sorted(range(n), key=lambda i: procs[i].delay)
    t0 = time.monotonic()
    deadline = t0 + timeout
    timed_out = False
    try:
        for i in range(n):
            files.append((open(os.path.join(tmp.name, f"{i}.out"), "w+"),
                          open(os.path.join(tmp.name, f"{i}.err"), "w+")))
        next_start = 0
        while True:
            now = time.monotonic()
            while next_start < n and now - t0 >= procs[order[next_start]].delay:
                i = order[next_start]
                p = procs[i]
                argv = list(p.argv) if p.argv is not None else [str(PERF), *p.args]
                if p.host is not None:
                    if testbed is None:
                        raise ValueError("Proc.host needs a testbed")
                    argv = testbed.exec_argv(p.host, argv)
                env = dict(base)
                env.update(p.env)
                popens[i] = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=files[i][0],
                                             stderr=files[i][1], start_new_session=True,
                                             cwd=str(cwd or REPO))
                started[i] = time.monotonic()
                next_start += 1
            for i, po in enumerate(popens):
                if po is not None and ended[i] is None and po.poll() is not None:
                    ended[i] = time.monotonic()
            if next_start == n and all(e is not None for e in ended):
                break
            if time.monotonic() >= deadline:
                timed_out = True
                break
            time.sleep(0.02)
    finally:
        for i, po in enumerate(popens):
            if po is not None and (timed_out or po.poll() is None):
                _kill_tree(po)
        for po in popens:
            if po is not None:
                try:
                    po.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
    results = []
    for i, po in enumerate(popens):
        out, err = files[i]
        out.seek(0)
        err.seek(0)
        rc = po.returncode if po is not None and po.returncode is not None else -999
        end = ended[i] if ended[i] is not None else time.monotonic()
        results.append(Result(rc, out.read(), err.read(), end - started[i] if po else 0.0, names[i],
                              started[i], end if po else 0.0))
        out.close()
        err.close()
    tmp.cleanup()
    if timed_out:
        pytest.fail(f"processes still running after the {timeout:.0f}s limit; killed them\n" + describe(results))
    return results


# ----------------------------------------------------------------------------- helpers


def perf_ranks(nranks: int, bootstrap: str, args: Sequence[str], *, hosts: Optional[Sequence[int]] = None,
               nics: Optional[Sequence[str]] = None, extra_env: Optional[Dict[str, str]] = None,
               json_path: Optional[str] = None) -> List[Proc]:
    """One r2ccl-perf Proc per rank.  `hosts[r]`: testbed host of rank r (None: here);
    `nics[r]`: R2CCL_NICS of rank r; `json_path` is added as --json to rank 0."""
    out = []
    for r in range(nranks):
        env = rank_env(r, nranks, bootstrap, **(extra_env or {}))
        if nics is not None:
            env["R2CCL_NICS"] = nics[r]
        a = list(args)
        if json_path and r == 0:
            a += ["--json", json_path]
        out.append(Proc(env=env, args=a, host=None if hosts is None else hosts[r]))
    return out


def perf_job(tb: "Testbed", nranks: int, args: Sequence[str], json_path: str, *,
             extra_env: Optional[Dict[str, str]] = None, faults: Sequence[Proc] = (),
             timeout: float = 600.0):
    """r2ccl-perf with rank r on testbed host r, rank 0 writing `json_path`, beside the `faults`
    Procs.  Returns (rank 0's JSON report, results, None), or (None, results, what went wrong)
    where a rank failed or rank 0 did not verify its results."""
    boot = f"{tb.mgmt_addr(0)}:{random_port()}"
    procs = perf_ranks(nranks, boot, args, hosts=list(range(nranks)), extra_env=extra_env,
                       json_path=json_path)
    res = launch_ranks(procs + list(faults), testbed=tb, timeout=timeout)
    if [r.returncode for r in res[:nranks]] != [0] * nranks or CHECK_LINE not in res[0].stdout:
        return None, res, "the job failed or was not verified:\n" + describe(res[:nranks])
    return load_json(json_path), res, None


def loopback_nics(rank: int, k: int) -> str:
    """R2CCL_NICS for `rank` on loopback: 127.0.0.(10*(rank+1)+i), i = 1..k."""
    return ",".join(f"127.0.0.{10 * (rank + 1) + i}" for i in range(1, k + 1))


def load_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


def read_events(prefix, rank: int):
    """Rank `rank`'s ``r2ccl-perf --events PREFIX`` file: (rail events in order, {nic: final})."""
    events, finals = [], {}
    with open(f"{prefix}.rank{rank}") as f:
        for line in f:
            if not line.strip():
                continue
            e = json.loads(line)
            if e["kind"] == "final":
                finals[e["nic"]] = e
            else:
                events.append(e)
    return events, finals


def netns_pids_of(ns: str, exe: Path) -> List[int]:
    """Pids of the processes in namespace `ns` whose executable is `exe` (the same file: in a
    chroot, the path /proc shows for a process of another mount namespace is not ours)."""
    r = _run(["ip", "netns", "pids", ns], timeout=10)
    out = []
    for tok in r.stdout.split():
        try:
            if os.path.samefile(f"/proc/{tok}/exe", exe):
                out.append(int(tok))
        except (OSError, ValueError):
            continue
    return out


def link_bytes(ns: str, dev: str) -> int:
    """Bytes received plus sent so far by `dev` in namespace `ns` (-1 if unreadable)."""
    r = _run(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", dev], timeout=10)
    try:
        st = json.loads(r.stdout)[0]["stats64"]
        return int(st["rx"]["bytes"]) + int(st["tx"]["bytes"])
    except (ValueError, LookupError, TypeError):
        return -1


# How many times slower than a release build the programs under test run (the tsan-system test
# preset sets it): the windows that judge a link busy grow with it.
SLOWDOWN = max(1.0, float(os.environ.get("R2CCL_TEST_SLOWDOWN", "1") or 1))


class BusyTrigger:
    """Runs `argv` (a fault) once `dev` in `ns` is seen carrying data, so that the fault hits
    chunks in flight rather than a pause between rounds (verification, the per-round vote).

    From `delay` seconds after start() it samples the link's byte counters every `window`
    seconds (times SLOWDOWN); once they grew by at least `min_bytes` in one window it runs
    `argv` at once.  If the link stays idle for `max_wait` seconds it runs `argv` anyway
    (`busy` stays False).
    `wall_ns` is the wall-clock time (time.time_ns) just before `argv` started."""

    def __init__(self, ns: str, dev: str, argv: Sequence[str], delay: float, min_bytes: int = 32768,
                 window: float = 0.01, max_wait: float = 5.0):
        self.ns, self.dev, self.argv = ns, dev, list(argv)
        self.delay, self.min_bytes, self.max_wait = delay, min_bytes, max_wait
        self.window = window * SLOWDOWN
        self.busy = False
        self.wall_ns = 0
        self.result: Optional[subprocess.CompletedProcess] = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._cancel = threading.Event()

    def _run(self) -> None:
        if self._cancel.wait(self.delay):
            return
        end = time.monotonic() + self.max_wait
        prev = link_bytes(self.ns, self.dev)
        while time.monotonic() < end and not self._cancel.is_set():  # bounded: max_wait
            time.sleep(self.window)
            cur = link_bytes(self.ns, self.dev)
            if prev >= 0 and cur - prev >= self.min_bytes:
                self.busy = True
                break
            prev = cur
        if self._cancel.is_set():
            return
        self.wall_ns = time.time_ns()
        try:
            self.result = _run(self.argv, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            self.result = subprocess.CompletedProcess(self.argv, -1, "", str(e))

    def start(self) -> "BusyTrigger":
        self._thread.start()
        return self

    def finish(self, timeout: float = 60.0) -> None:
        """Waits (bounded) until it has run; call after the launch (or cancel())."""
        self._thread.join(timeout)

    def cancel(self) -> None:
        self._cancel.set()
        self._thread.join(40)


# r2ccl-perf's output about rounds (sendrecv --duration with -c 1 and --keep-going).
CHECK_LINE = "# Check: every byte verified on every rank"
PARTIAL_CHECK = re.compile(r"^# Check: every byte of the (\d+) completed round\(s\) verified on every "
                           r"rank; (\d+) round\(s\) failed$", re.M)
ROUND_FAILED = re.compile(r"^r2ccl-perf: rank (\d+): round (\d+) failed: (.*)$", re.M)
ROUNDS_SUMMARY = re.compile(r"^r2ccl-perf: rank (\d+): (\d+) round\(s\) completed, (\d+) failed$", re.M)


def assert_no_rail_survived(r, nics):
    """Some round of rank result `r` failed because no rail to its peer survived, naming every NIC."""
    failures = ROUND_FAILED.findall(r.stderr)
    assert failures, r.describe()
    assert any("no rail to rank" in why and "survived" in why and all(n in why for n in nics)
               for _, _, why in failures), r.describe()


def assert_rounds_resumed(r0, res):
    """Rank 0's rounds: the verified and failed counts agree with its failures, and rounds
    completed again after the outage, up to the last one."""
    m = PARTIAL_CHECK.search(r0.stdout)
    assert m, describe(res)
    completed, failed = int(m.group(1)), int(m.group(2))
    summary = ROUNDS_SUMMARY.search(r0.stderr)
    assert summary and (int(summary.group(2)), int(summary.group(3))) == (completed, failed), r0.describe()
    failed_rounds = sorted(int(n) for _, n, _ in ROUND_FAILED.findall(r0.stderr))
    assert len(failed_rounds) == failed, r0.describe()
    total = completed + failed
    assert completed > failed_rounds[0], "no round completed after the outage: " + r0.describe()
    assert failed_rounds[-1] < total - 1, "the last round failed: " + r0.describe()


def link_down_transitions(monitor_output, dev):
    """How often `dev` went from running to not running in `ip monitor link` output.

    ip monitor prints every RTM_NEWLINK message, not transitions.  `ip link set DEV down`
    gives <BROADCAST,MULTICAST> (no UP); `ip link set DEV up` gives first
    <NO-CARRIER,...,UP,LOWER_UP> state DOWN (admin up, carrier/operstate not yet up) and then
    <...,UP,LOWER_UP> state UP.  So "down" lines are not flaps: the NO-CARRIER line after an
    `up` is still the same outage.  Like r2ccl's link watcher (IFF_UP && IFF_RUNNING, reported
    only when it changes), count running -> not running, running meaning the UP flag and no
    NO-CARRIER.  The link is running when the monitor starts."""
    pat = re.compile(r"^\d+: " + re.escape(dev) + r"(@\S+)?: <([^>]*)>")
    running, downs = True, 0
    for line in monitor_output.splitlines():
        m = pat.match(line)
        if not m:
            continue
        flags = m.group(2).split(",")
        now = "UP" in flags and "NO-CARRIER" not in flags
        if running and not now:
            downs += 1
        running = now
    return downs
