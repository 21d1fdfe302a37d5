"""pytest configuration for the r2ccl system tests (real processes, netns testbeds)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import r2ccl_testbed  # noqa: E402


@pytest.fixture
def perf() -> Path:
    """Path of r2ccl-perf (waits, bounded, if it is being rebuilt)."""
    return r2ccl_testbed.wait_for_binary()


def pytest_sessionfinish(session, exitstatus):
    # Backstop: no testbed outlives the session, whatever happened in a test.
    r2ccl_testbed._destroy_all()
