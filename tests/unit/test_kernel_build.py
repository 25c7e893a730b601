"""The CPU kernel build's lock: it ends with its holder, a live holder is waited for only up
to a deadline, and what a killed build leaves (torch's lock file, running compilers) is
cleared by the next holder. The whole story, a worker killed mid-build and started again,
is tests/integration/test_kernel_build_restart.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_worker.ops.kernel_build import BuildWaitTimeout, build_lock, clear_killed_build

HOLD_LOCK = """
import sys
from pathlib import Path
from gpu_worker.ops.kernel_build import build_lock
with build_lock(Path(sys.argv[1]), wait_s=1):
    print("held", flush=True)
    sys.stdin.read()
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding the build lock at tmp_path/x.lock until killed."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path / "x.lock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "held"
    yield process
    process.kill()
    process.wait()


def test_a_live_holder_is_waited_for_up_to_the_deadline_and_named(
    tmp_path: Path, holder: subprocess.Popen[str]
) -> None:
    with (
        pytest.raises(BuildWaitTimeout, match=rf"pid {holder.pid}\b"),
        build_lock(tmp_path / "x.lock", wait_s=0.5),
    ):
        pytest.fail("took a lock another process holds")


def test_the_lock_ends_with_a_killed_holder(tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    holder.kill()
    holder.wait()
    with build_lock(tmp_path / "x.lock", wait_s=5):
        assert (tmp_path / "x.lock").read_text() != str(holder.pid)


def test_torch_lock_file_left_by_a_killed_build_is_removed(tmp_path: Path) -> None:
    (tmp_path / "lock").touch()  # torch's FileBaton, which only its holder deletes
    clear_killed_build(tmp_path, wait_s=1)
    assert not (tmp_path / "lock").exists()


@pytest.fixture
def leftover_ninja(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A process named ninja working in tmp_path/build, as a killed build's ninja goes on."""
    build = tmp_path / "build"
    build.mkdir()
    sleeper = shutil.which("sleep")
    assert sleeper is not None
    ninja = tmp_path / "ninja"
    shutil.copy(sleeper, ninja)
    process = subprocess.Popen([str(ninja), "30"], cwd=build)
    yield process
    process.kill()
    process.wait()


@pytest.mark.skipif(not Path("/proc/self/cwd").exists(), reason="needs Linux's /proc")
def test_a_killed_builds_compilers_are_waited_out(
    tmp_path: Path, leftover_ninja: subprocess.Popen[bytes]
) -> None:
    with pytest.raises(BuildWaitTimeout, match=str(leftover_ninja.pid)):
        clear_killed_build(tmp_path / "build", wait_s=0.5)
    leftover_ninja.kill()
    leftover_ninja.wait()
    clear_killed_build(tmp_path / "build", wait_s=5)
