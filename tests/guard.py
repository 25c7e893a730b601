"""Run the test suite under a wall-clock limit that names what was stuck.

`python -m tests.guard --limit-s N -- COMMAND...` runs COMMAND (pytest) in a process group of
its own. pytest-timeout ends a test that runs too long, but a run can still outlive every
test's timeout (a fixture's teardown, a worker that never reports back); so past N seconds
this asks every pytest process of the run to dump its threads' stacks (SIGUSR1, registered
by tests/conftest.py), prints the tests that were running, their ages and those stacks,
kills the group and exits 124. When COMMAND ends in time, whatever it left running (a server
from a crashed xdist worker) is killed too, so `make test` always returns.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.running import RUNNING_DIR_ENV, running_tests, stack_dumps

DUMP_WAIT_S = 5.0


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _report_stuck(directory: Path, limit_s: float, pgid: int) -> None:
    """The running tests and every pytest process's stacks, printed before the kill."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGUSR1)
    # Every registered process has a .stacks file; one that died since never fills its own.
    registered = len(list(directory.glob("*.stacks")))
    deadline = time.monotonic() + DUMP_WAIT_S
    while time.monotonic() < deadline and len(stack_dumps(directory)) < registered:
        time.sleep(0.1)
    print(f"\ntests.guard: the run passed its {limit_s:.0f} s limit; running then:")
    for worker, nodeid, age_s in running_tests(directory):
        print(f"  [{worker}] {nodeid} (for {age_s:.0f} s)")
    for name, text in stack_dumps(directory):
        print(f"\n--- stacks of {name} ---\n{text}")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.guard")
    parser.add_argument("--limit-s", type=float, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run")
    with tempfile.TemporaryDirectory(prefix="duet-tests-running-") as scratch:
        directory = Path(scratch)
        env = {**os.environ, RUNNING_DIR_ENV: str(directory)}
        process = subprocess.Popen(command, env=env, start_new_session=True)
        try:
            return process.wait(timeout=args.limit_s)
        except subprocess.TimeoutExpired:
            _report_stuck(directory, args.limit_s, process.pid)
            return 124
        finally:
            _kill_group(process.pid)
            process.wait()


if __name__ == "__main__":
    sys.exit(main())
