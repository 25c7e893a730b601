"""CURVE encryption with a ZAP allow-list: only listed render keys reach the worker."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq.auth

from render_server.worker_client.pool import WorkerError, WorkerPool
from shared.curve import generate, render_keys
from shared.tokenizer_digest import tokenizer_digest
from tests.helpers.processes import SMALL_WORKER, start_worker, stop_worker


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
    zmq.auth.create_certificates(tmp_path, "render")  # a key pair the worker never saw
    shutil.copy(keys / "worker.key", tmp_path / "worker.key")
    assert not _connect(address, render_keys(tmp_path), tokenizer_digest(smollm2_source), 3)


def test_plaintext_client_is_refused(curve_worker, smollm2_source) -> None:
    address, _ = curve_worker
    assert not _connect(address, None, tokenizer_digest(smollm2_source), 3)
