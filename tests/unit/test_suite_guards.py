"""The suite cannot hang: pytest-timeout's configured method ends a test that swallows the
timeout's exception, and `tests.guard` names the tests running past the run's limit, with
their stacks, and kills every process the run left."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
RUN_BOUND_S = 90.0  # far above what each run below takes; a hang fails here instead

CONFTEST = """
from tests.running import register

def pytest_configure(config):
    register(config)
"""

# Catches whatever it is interrupted with and goes on, as a framework that retries does.
SWALLOWS_EVERYTHING = """
import time

def test_swallows_the_timeout():
    while True:
        try:
            time.sleep(0.01)
        except BaseException:
            pass
"""

STUCK_WITH_A_CHILD = """
import subprocess
import time
from pathlib import Path

def test_stuck_with_a_child():
    child = subprocess.Popen(["sleep", "600"])
    Path(__file__).with_name("child.pid").write_text(str(child.pid))
    time.sleep(600)
"""

LEAVES_A_CHILD = """
import subprocess
from pathlib import Path

def test_leaves_a_child():
    child = subprocess.Popen(["sleep", "600"])
    Path(__file__).with_name("child.pid").write_text(str(child.pid))
"""


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_XDIST_WORKER", None)  # the inner run is not one of ours
    env.pop("DUET_TEST_RUNNING_DIR", None)
    return subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_BOUND_S
    )


def write_tests(directory: Path, source: str) -> Path:
    (directory / "conftest.py").write_text(CONFTEST)
    test_file = directory / "test_inner.py"
    test_file.write_text(source)
    return test_file


def pytest_command(test_file: Path, *options: str) -> list[str]:
    # The project's own pytest settings (pyproject.toml), on a test file outside the tree.
    config = str(ROOT / "pyproject.toml")
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", config,
            f"--rootdir={test_file.parent}", *options, str(test_file)]  # fmt: skip


def is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers; it is gone once it no longer runs.
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split(") ")[1].startswith("Z")


@pytest.mark.slow
def test_the_configured_timeout_ends_a_test_that_swallows_it(tmp_path: Path) -> None:
    test_file = write_tests(tmp_path, SWALLOWS_EVERYTHING)
    started = time.monotonic()
    result = run(pytest_command(test_file, "--timeout", "2"), tmp_path)
    assert time.monotonic() - started < 30
    assert result.returncode != 0
    assert "Timeout" in result.stdout + result.stderr
    assert "test_swallows_the_timeout" in result.stdout + result.stderr


@pytest.mark.slow
def test_the_guard_names_the_stuck_test_and_kills_what_it_left(tmp_path: Path) -> None:
    test_file = write_tests(tmp_path, STUCK_WITH_A_CHILD)
    inner = pytest_command(test_file, "-n", "1", "--timeout", "0")
    result = run([sys.executable, "-m", "tests.guard", "--limit-s", "8", "--", *inner], ROOT)
    assert result.returncode == 124, result.stdout + result.stderr
    assert "passed its 8 s limit" in result.stdout
    assert "[gw0] test_inner.py::test_stuck_with_a_child" in result.stdout
    # The worker's stacks, dumped from C while it slept in the test.
    assert "--- stacks of gw0 ---" in result.stdout
    assert "in test_stuck_with_a_child" in result.stdout
    child = int((tmp_path / "child.pid").read_text())
    wait_until(lambda: is_gone(child), 10, "the stuck test's child to be killed")


@pytest.mark.slow
def test_the_guard_passes_the_exit_code_and_kills_leftovers(tmp_path: Path) -> None:
    test_file = write_tests(tmp_path, LEAVES_A_CHILD)
    inner = pytest_command(test_file)
    result = run([sys.executable, "-m", "tests.guard", "--limit-s", "60", "--", *inner], ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout
    child = int((tmp_path / "child.pid").read_text())
    wait_until(lambda: is_gone(child), 10, "the passed test's leftover child to be killed")
