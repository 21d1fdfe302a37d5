"""Shared helpers of the monitor system tests (test_monitor.py, test_job_metrics.py): processes
killed at the end of a test, bounded polling, and a real Prometheus server queried through
PromQL from inside a testbed host namespace.

Not a test module (pytest collects test_*.py only).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "system"))

from r2ccl_testbed import Testbed  # noqa: E402

PROMETHEUS = Path("/usr/bin/prometheus")
ALERTS = REPO / "deploy" / "prometheus" / "r2ccl-alerts.yml"
PYTHON = "/usr/bin/python3"
POLL_LIMIT = 30.0  # seconds any condition may take to show


class Procs:
    """Processes started by a test, each in its own session; all killed on exit."""

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.procs: List[Tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: Sequence[str], **kw) -> subprocess.Popen:
        out = open(self.logdir / f"{name}.log", "w")
        p = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT,
                             stdin=kw.pop("stdin", subprocess.DEVNULL), start_new_session=True, **kw)
        out.close()
        self.procs.append((name, p))
        return p

    def adopt(self, name: str, p: subprocess.Popen) -> None:
        """Kills `p` with the others (its output is the caller's)."""
        self.procs.append((name, p))

    def log(self, name: str) -> str:
        path = self.logdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        parts = []
        for name, _ in self.procs:
            path = self.logdir / f"{name}.log"
            if not path.exists():
                continue
            text = path.read_text(errors="replace")
            parts.append(f"--- {name}\n{text[-4000:]}")
        return "\n".join(parts)

    def stop(self, p: subprocess.Popen, timeout: float = 10.0) -> Optional[int]:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code after SIGTERM (None if
        it had to be killed)."""
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except OSError:
                pass
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            p.wait(timeout=10)
            return None

    def close(self) -> None:
        for _, p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass


def http_get(url: str, timeout: float = 5.0) -> Tuple[int, str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def wait_until(what: str, check: Callable[[], object], limit: float = POLL_LIMIT,
               step: float = 0.25, context: Callable[[], str] = lambda: ""):
    """Polls `check` until it returns something truthy (returned), at most `limit` seconds."""
    deadline = time.monotonic() + limit
    last = None
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {limit:.0f}s waiting for {what}\n{context()}")
        time.sleep(step)


def metric_value(text: str, series: str) -> Optional[float]:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


# ------------------------------------------------------------------------------ Prometheus


QUERY_HELPER = r"""
import json, sys, urllib.parse, urllib.request
base = sys.argv[1]
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
for line in sys.stdin:
    q = line.rstrip("\n")
    try:
        with opener.open(base + "/api/v1/query?" + urllib.parse.urlencode({"query": q}),
                         timeout=5) as r:
            out = json.load(r)
    except Exception as e:  # reported to the test, which retries (bounded)
        out = {"status": "error", "error": repr(e)}
    print(json.dumps(out), flush=True)
"""


class PromQL:
    """Runs PromQL queries through a small helper inside host 0's namespace (where Prometheus
    listens on 127.0.0.1)."""

    def __init__(self, procs: Procs, tb: Testbed, url: str):
        self.p = subprocess.Popen(tb.exec_argv(0, [PYTHON, "-u", "-c", QUERY_HELPER, url]),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        procs.adopt("promql", self.p)

    def raw(self, query: str) -> dict:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(query + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()  # the helper answers within its 5 s HTTP timeout
        if not line:
            pytest.fail("the PromQL helper exited")
        return json.loads(line)

    def vector(self, query: str) -> Optional[List[Tuple[Dict[str, str], float]]]:
        """The query's instant vector, or None while Prometheus cannot answer."""
        r = self.raw(query)
        if r.get("status") != "success":
            return None
        return [(s["metric"], float(s["value"][1])) for s in r["data"]["result"]]

    def labels(self, query: str, *names: str) -> Optional[Set[Tuple[str, ...]]]:
        """The values of labels `names` of every series the query returns."""
        v = self.vector(query)
        return None if v is None else {tuple(m.get(n, "?") for n in names) for m, _ in v}

    def values(self, query: str, *names: str) -> Optional[Dict[Tuple[str, ...], float]]:
        """{values of labels `names`: sample value} of the query's series."""
        v = self.vector(query)
        return None if v is None else {tuple(m.get(n, "?") for n in names): x for m, x in v}

    def devices(self, query: str) -> Optional[Set[Tuple[str, str]]]:
        """(host, device) of every series the query returns."""
        return self.labels(query, "host", "device")


def prometheus_config(path: Path, targets: Dict[str, str], job: str = "r2ccl-monitor",
                      label: str = "host") -> None:
    """Scrapes every target each second as `job`, the target tagged {label: key}; the alert
    rules are loaded and evaluated every second."""
    lines = ["global:", "  scrape_interval: 1s", "  scrape_timeout: 1s",
             "  evaluation_interval: 1s", "rule_files:", f"  - {json.dumps(str(ALERTS))}",
             "scrape_configs:", f"  - job_name: {job}", "    static_configs:"]
    for key, target in targets.items():
        lines += [f"      - targets: [{json.dumps(target)}]", f"        labels: {{{label}: {key}}}"]
    path.write_text("\n".join(lines) + "\n")


def start_prometheus(procs: Procs, tb: Testbed, cfg: Path, tsdb: Path, port: int) -> PromQL:
    """Prometheus in host 0's namespace on 127.0.0.1:`port`, and a PromQL client for it."""
    tsdb.mkdir(exist_ok=True)
    procs.start("prometheus", tb.exec_argv(0, [
        str(PROMETHEUS), f"--config.file={cfg}", f"--storage.tsdb.path={tsdb}",
        f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]))
    return PromQL(procs, tb, f"http://127.0.0.1:{port}")
