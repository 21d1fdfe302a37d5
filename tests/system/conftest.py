"""pytest configuration for the r2ccl system tests (real processes, netns testbeds)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import r2ccl_testbed  # noqa: E402
import skip_status  # noqa: E402


def pytest_configure(config):
    # A run whose tests all skipped exits 77, which ctest reports as skipped (not passed).
    skip_status.register(config)


@pytest.fixture
def perf() -> Path:
    """Path of r2ccl-perf (waits, bounded, if it is being rebuilt)."""
    return r2ccl_testbed.wait_for_binary()


def pytest_sessionfinish(session, exitstatus):
    # Backstop: no testbed outlives the session, whatever happened in a test.
    r2ccl_testbed._destroy_all()
