"""bench/baseline.sh's Open MPI benchmark (bench/src/mpi_allreduce.c), two ranks on loopback:
its per-operation percentiles (-l 1), which put r2ccl-perf --latency beside Open MPI."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASELINE = ROOT / "bench" / "baseline.sh"

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None or shutil.which("mpicc") is None,
                                reason="needs openmpi-bin and libopenmpi-dev (scripts/run installs them)")


def run_openmpi(args, timeout=180):
    return subprocess.run([str(BASELINE), "--impl", "openmpi", "--net", "loopback", "--timeout", "150", "--",
                           *args], capture_output=True, text=True, timeout=timeout)


def json_lines(stdout):
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_openmpi_per_operation_percentiles():
    r = run_openmpi(["-b", "8", "-e", "512", "-f", "8", "-n", "30", "-w", "2", "-c", "1", "-l", "1"])
    assert r.returncode == 0, r.stdout + r.stderr
    lines = json_lines(r.stdout)
    assert [d["bytes"] for d in lines] == [8, 64, 512], r.stdout
    for d in lines:
        assert d["wrong"] == 0, d
        lat = d["latency_us"]
        p = [lat[k] for k in ("p1", "p50", "p90", "p99", "max")]
        assert all(x > 0 for x in p) and p == sorted(p), d


def test_openmpi_percentiles_only_when_asked():
    r = run_openmpi(["-b", "8", "-e", "8", "-n", "5", "-w", "1", "-c", "1"])
    assert r.returncode == 0, r.stdout + r.stderr
    lines = json_lines(r.stdout)
    assert len(lines) == 1 and "latency_us" not in lines[0], r.stdout


def test_openmpi_bad_latency_flag_is_named():
    r = run_openmpi(["-b", "8", "-e", "8", "-l", "2"])
    assert r.returncode != 0, r.stdout + r.stderr
    assert "invalid argument (-l: 0 or 1)" in r.stderr, r.stderr
    assert json_lines(r.stdout) == [], r.stdout
