"""What the Python tests share: the package from the source tree with libr2ccl.so from the build
(R2CCL_LIBRARY, which ctest sets), or with R2CCL_TEST_INSTALLED=1 the package pip installed
(scripts/run vllm-test); loopback rails; ranks as threads of this process."""

import os
import pathlib
import sys
import threading

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
os.environ.setdefault("R2CCL_SOCKET_IFNAME", "lo")
os.environ.setdefault("R2CCL_TIMEOUT", "20s")
if os.environ.get("R2CCL_TEST_INSTALLED") != "1":
    sys.path.insert(0, str(ROOT / "integrations" / "python"))
    if "R2CCL_LIBRARY" not in os.environ:
        built = ROOT / "build" / "lib" / "libr2ccl.so"
        if built.exists():
            os.environ["R2CCL_LIBRARY"] = str(built)

JOIN_TIMEOUT_S = 60


def run_ranks(n: int, body, *args):
    """Runs body(rank, *args) on n threads; returns their results in rank order, or raises the
    first exception a rank raised. A rank still running after a minute is a failure (a hang)."""
    results = [None] * n
    errors = [None] * n

    def main(rank: int) -> None:
        try:
            results[rank] = body(rank, *args)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors[rank] = e

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
        if t.is_alive():
            pytest.fail(f"a rank did not finish within {JOIN_TIMEOUT_S} s")
    for e in errors:
        if e is not None:
            raise e
    return results


@pytest.fixture
def rails(monkeypatch):
    """Two loopback rails for the communicators a test makes."""
    monkeypatch.setenv("R2CCL_NICS", "127.0.33.1,127.0.33.2")
