"""Fixtures shared by the monitor's pytest files."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prom_harness import Procs  # noqa: E402


@pytest.fixture
def procs(tmp_path):
    """Processes a test starts; all stopped when it ends."""
    ps = Procs(tmp_path)
    yield ps
    ps.close()
