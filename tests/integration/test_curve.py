"""CURVE encryption with a ZAP allow-list: only listed render keys reach the worker; secret
keys are private; a worker open to the network without CURVE says so."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq.auth

from render_server.worker_client.pool import WorkerError, WorkerPool
from shared.curve import generate, render_keys, worker_keys
from shared.tokenizer_digest import tokenizer_digest
from shared.transport import InsecureKeyFileError
from tests.helpers.processes import SMALL_WORKER, free_port, start_worker, stop_worker

WORKER = [sys.executable, "-m", "gpu_worker.cli", "--device", "cpu"]


@pytest.fixture(scope="module")
def curve_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    keys = tmp_path_factory.mktemp("curve")
    generate(keys)
    worker = start_worker(None, ["--zmq-curve-dir", str(keys)], startup_s=180, **SMALL_WORKER)
    yield worker.address, keys
    stop_worker(worker, timeout_s=30)


def _connect(address: str, curve: object, digest: str, timeout_s: float) -> bool:
    async def main() -> bool:
        pool = WorkerPool([address], tokenizer_digest=digest, curve=curve)
        try:
            await pool.start(ready_timeout_s=timeout_s)
            return pool.is_ready()
        except WorkerError:
            return False
        finally:
            await pool.close()

    return asyncio.run(main())


def test_listed_render_key_is_admitted(curve_worker, smollm2_source) -> None:
    address, keys = curve_worker
    assert _connect(address, render_keys(keys), tokenizer_digest(smollm2_source), 30)


def test_unlisted_render_key_is_refused(curve_worker, smollm2_source, tmp_path: Path) -> None:
    address, keys = curve_worker
    _, secret = zmq.auth.create_certificates(tmp_path, "render")  # one the worker never saw
    os.chmod(secret, 0o600)
    shutil.copy(keys / "worker.key", tmp_path / "worker.key")
    assert not _connect(address, render_keys(tmp_path), tokenizer_digest(smollm2_source), 3)


def test_plaintext_client_is_refused(curve_worker, smollm2_source) -> None:
    address, _ = curve_worker
    assert not _connect(address, None, tokenizer_digest(smollm2_source), 3)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_generated_secret_keys_are_private_whatever_the_umask(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    done = subprocess.run(
        [sys.executable, "-m", "shared.curve", str(keys)],
        capture_output=True, timeout=30, check=True, umask=0,
    )  # fmt: skip
    assert b"wrote worker and render keys" in done.stdout
    assert _mode(keys / "worker.key_secret") == 0o600
    assert _mode(keys / "render.key_secret") == 0o600
    assert sorted(path.name for path in keys.iterdir()) == [
        "authorized", "render.key", "render.key_secret", "worker.key", "worker.key_secret",
    ]  # fmt: skip
    worker_keys(keys)
    render_keys(keys)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_secret_key_others_can_read_is_refused(tmp_path: Path, mode: int) -> None:
    generate(tmp_path)
    secret = tmp_path / "render.key_secret"
    secret.chmod(mode)
    with pytest.raises(InsecureKeyFileError, match=f"chmod 600 {secret}"):
        render_keys(tmp_path)


def test_worker_refuses_a_readable_secret_key_before_loading(tmp_path: Path) -> None:
    generate(tmp_path)
    secret = tmp_path / "worker.key_secret"
    secret.chmod(0o644)
    done = subprocess.run(
        [*WORKER, "--zmq-curve-dir", str(tmp_path)], capture_output=True, timeout=60
    )
    assert done.returncode == 2
    assert f"{secret} is readable by other users" in done.stderr.decode()
    assert f"chmod 600 {secret}" in done.stderr.decode()


def test_worker_bound_to_all_interfaces_without_curve_warns(tmp_path: Path) -> None:
    """The warning comes at startup; a missing model then ends each worker early, so the
    loopback one shows that nothing was logged before it got as far."""
    missing = ["--model", str(tmp_path / "missing.gguf")]
    binds = {"open": "tcp://0.0.0.0", "loopback": "tcp://127.0.0.1"}
    workers = {
        name: subprocess.Popen(
            [*WORKER, *missing, "--bind", f"{host}:{free_port()}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for name, host in binds.items()
    }
    stderr = {name: worker.communicate(timeout=60)[1].decode() for name, worker in workers.items()}
    for name, worker in workers.items():
        assert worker.returncode == 2, stderr[name]
        assert "missing.gguf" in stderr[name]
    assert "WARNING" in stderr["open"]
    assert "UNPROTECTED: binding tcp://0.0.0.0:" in stderr["open"]
    assert "anyone who can reach this port" in stderr["open"].lower()
    assert "WARNING" not in stderr["loopback"]
