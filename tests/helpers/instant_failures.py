"""A pytest plugin that prints each failure's traceback as soon as the test fails.

pytest prints failures at the end of the session, so a run cut off by an outer time limit
(bench/gpu_check.sh's steps on a lent GPU, where every second is counted) would lose every
traceback. Loaded there with `-p tests.helpers.instant_failures`.
"""

from __future__ import annotations

import sys

import pytest


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        print(f"\n----- {report.nodeid} ({report.when}) failed -----", file=sys.stderr)
        print(report.longreprtext, file=sys.stderr, flush=True)
