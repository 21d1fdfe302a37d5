"""pytest configuration of the verbs tests (run inside the Soft-RoCE guest by tests/rdma/run.sh)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import skip_status  # noqa: E402


def pytest_configure(config):
    # A run whose tests all skipped exits 77, which ctest reports as skipped (not passed).
    skip_status.register(config)
