"""Real `render-serve` processes on loopback, started once per test session.

`render_server` runs with no keys and trusts request chat templates (with a short render
deadline, for the hostile-template test); `secure_client` talks to tests/conftest.py's
`secure_server` (two API keys, CORS for one origin and a root_path), for the security tests.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.helpers.processes import ServerProcess, start_server, stop_server


@pytest.fixture(scope="session")
def render_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """render-serve without keys, trusting request chat templates (1 s render deadline)."""
    log = tmp_path_factory.mktemp("render") / "render-serve.log"
    server = start_server(
        ["--render-only", "--trust-request-chat-template", "--render-deadline", "1.0"], log
    )
    yield server
    stop_server(server)


@pytest.fixture
def client(render_server: ServerProcess) -> Iterator[httpx.Client]:
    """httpx client bound to the keyless server."""
    with httpx.Client(base_url=render_server.base_url, timeout=30.0) as http:
        yield http


@pytest.fixture
def secure_client(secure_server: ServerProcess) -> Iterator[httpx.Client]:
    """httpx client bound to the keyed server, sending no key unless a test adds one."""
    with httpx.Client(base_url=secure_server.base_url, timeout=30.0) as http:
        yield http
