"""A real redis-server on loopback for the tests of the shared response store.

`redis_server` (a session fixture, registered in tests/conftest.py) is one server for the
whole session; a test that stops, pauses or restarts Redis starts its own with
`start_redis`. Each is `redis-server` on a free port with persistence off, in a temporary
directory, waited for (bounded) until it answers PING and stopped at teardown. Tests skip,
saying why, where redis-server is not installed (`make test` installs Debian's).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.waiting import WaitTimeout, wait_until

REDIS_STARTUP_S = 20.0


@dataclass
class RedisServer:
    """One redis-server process; `start` again after `stop` reuses its port."""

    directory: Path
    port: int
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.directory / "redis.log"

    def start(self) -> None:
        command = [
            "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(self.directory),
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(self._answers, REDIS_STARTUP_S, f"redis-server on port {self.port}")
        except WaitTimeout:
            self.stop()
            raise

    def _answers(self) -> bool:
        import redis

        assert self.process is not None
        if self.process.poll() is not None:
            log = self.log_path.read_text(errors="replace")
            pytest.fail(f"redis-server exited with {self.process.returncode}:\n{log}")
        try:
            with redis.Redis(port=self.port, socket_timeout=1.0) as client:
                return bool(client.ping())
        except redis.ConnectionError:
            return False

    def stop(self) -> None:
        """SIGTERM (after SIGCONT, in case the test paused it), SIGKILL if it lingers."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        os.kill(process.pid, signal.SIGCONT)
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def pause(self) -> None:
        """SIGSTOP: connections are still accepted by the kernel, nothing is answered, as
        with a hung Redis or a network that drops packets."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def flush(self) -> None:
        import redis

        with redis.Redis(port=self.port, socket_timeout=5.0) as client:
            client.flushall()


def start_redis(directory: Path) -> RedisServer:
    """A redis-server started in `directory` and answering PING; stop it yourself."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (`make test` installs Debian's)")
    from tests.helpers.processes import free_port

    server = RedisServer(directory, free_port())
    server.start()
    return server


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the session; tests flush it rather than share its keys."""
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()
