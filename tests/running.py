"""Which test each pytest process is running, for `tests.guard` to name a stuck run.

Under the guard (its directory in DUET_TEST_RUNNING_DIR), each process running tests (every
xdist worker, or the one pytest process) keeps `<name>.running` holding its current test's
node id and start time, and every pytest process dumps its threads' stacks into
`<name>.stacks` on SIGUSR1 (faulthandler writes them from C, so a process stuck in a C call
still answers). Without the variable nothing is registered.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from pathlib import Path
from typing import IO

import pytest

RUNNING_DIR_ENV = "DUET_TEST_RUNNING_DIR"


class RunningTests:
    """The plugin one pytest process registers under the guard."""

    def __init__(self, directory: Path, name: str, tracks_tests: bool) -> None:
        self.running = directory / f"{name}.running"
        self.tracks_tests = tracks_tests
        # Kept open for the process's life: faulthandler writes to the descriptor.
        self.stacks: IO[str] = (directory / f"{name}.stacks").open("w")
        if hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, file=self.stacks, all_threads=True)

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        if self.tracks_tests:
            self.running.write_text(f"{time.time()}\n{nodeid}\n")

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        if self.tracks_tests:
            self.running.unlink(missing_ok=True)


def register(config: pytest.Config) -> None:
    """Registers `RunningTests` when the guard runs this process (from pytest_configure)."""
    value = os.environ.get(RUNNING_DIR_ENV)
    if not value:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    # An xdist controller hears every worker's test starts; the workers say their own.
    is_controller = worker is None and bool(getattr(config.option, "numprocesses", None))
    plugin = RunningTests(Path(value), worker or "main", tracks_tests=not is_controller)
    config.pluginmanager.register(plugin, "duet-running-tests")


def running_tests(directory: Path) -> list[tuple[str, str, float]]:
    """(process, node id, seconds it has run) of every test running now."""
    found = []
    for path in sorted(directory.glob("*.running")):
        try:
            started, nodeid = path.read_text().split("\n")[:2]
        except (OSError, ValueError):
            continue
        found.append((path.stem, nodeid, time.time() - float(started)))
    return found


def stack_dumps(directory: Path) -> list[tuple[str, str]]:
    """(process, its dumped stacks) for every process that has dumped any."""
    dumps = []
    for path in sorted(directory.glob("*.stacks")):
        text = path.read_text(errors="replace")
        if text.strip():
            dumps.append((path.stem, text))
    return dumps
