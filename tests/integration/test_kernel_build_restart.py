"""A gpu-worker killed in the middle of its CPU kernel build: the next start builds and
serves, instead of waiting forever on the lock file torch's build left behind."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from gpu_worker.ops.kernel_build import build_processes_in, cpu_kernels_spec
from tests.helpers.processes import (
    WorkerProcess,
    kill_worker,
    spawn_worker,
    start_worker,
    stop_worker,
)
from tests.helpers.waiting import wait_until

# A cold build is about a minute on 2 quiet cores and several on a loaded CI machine.
BUILD_STARTUP_S = 420.0

pytestmark = pytest.mark.slow


def test_a_worker_killed_mid_build_does_not_block_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    spec = cpu_kernels_spec()
    first_log = tmp_path / "first.log"
    first = WorkerProcess(spawn_worker(first_log, ["--log-level", "info"]), "", first_log)
    try:
        wait_until(
            lambda: build_processes_in(spec.build_directory),
            BUILD_STARTUP_S,
            "the first worker's compilers in the build directory",
            interval_s=0.1,
            detail=lambda: first_log.read_text(errors="replace"),
        )
        assert "building CPU kernels" in first_log.read_text()
    finally:
        kill_worker(first)
    # What made every later start wait forever: torch's lock, held by nobody.
    assert (spec.build_directory / "lock").exists()

    second_log = tmp_path / "second.log"
    second = start_worker(second_log, ["--log-level", "info"], startup_s=BUILD_STARTUP_S)
    try:
        log = second_log.read_text()
        assert "removing the lock file a killed CPU kernel build left" in log
        assert "CPU kernels unavailable" not in log
        assert spec.library.exists()
    finally:
        with contextlib.suppress(Exception):
            stop_worker(second)
