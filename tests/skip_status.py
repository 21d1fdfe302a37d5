"""Makes pytest exit 77 (ctest's SKIP_RETURN_CODE) when every test it ran was skipped.

pytest exits 0 when all its tests skip, so ctest would report a test that never ran as
passed. The conftest of each suite that ctest runs registers this plugin.
"""

from __future__ import annotations

import collections

import pytest

SKIPPED_ALL = 77


class SkipStatus:
    def __init__(self) -> None:
        self.outcomes: collections.Counter[str] = collections.Counter()

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or report.skipped:
            self.outcomes[report.outcome] += 1

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus) -> None:
        if exitstatus == 0 and self.outcomes["skipped"] and not (
            self.outcomes["passed"] or self.outcomes["failed"]
        ):
            session.exitstatus = SKIPPED_ALL


def register(config) -> None:
    config.pluginmanager.register(SkipStatus(), "r2ccl-skip-status")
