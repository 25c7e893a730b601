"""Connection-level limits on a real render server (render_server/http/connection.py):
a huge request head gets 431 while it arrives, slow or idle sockets are closed after the
header, body and keep-alive timeouts, and a request counts against --max-pending only once
its body is complete. Raw sockets on loopback, bounded in count and time."""

from __future__ import annotations

import contextlib
import json
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from tests.helpers.processes import ServerProcess, start_server, stop_server

TIMEOUT_S = 1  # --header-timeout, --body-timeout and --timeout-keep-alive of the server
MAX_PENDING = 4
HEALTH = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"
CHAT_BODY = json.dumps(
    {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}]}
).encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """render-serve --render-only with one-second connection timeouts and 4 pending slots:
    a chat request it admits gets 503 render_only, one it does not gets 429."""
    seconds = str(TIMEOUT_S)
    log = tmp_path_factory.mktemp("connections") / "render-serve.log"
    args = ["--render-only", "--max-pending", str(MAX_PENDING), "--header-timeout", seconds,
            "--body-timeout", seconds, "--timeout-keep-alive", seconds]  # fmt: skip
    server = start_server(args, log)
    yield server
    stop_server(server)
    assert "Traceback" not in server.log()


def connect(server: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5)


def readable(sock: socket.socket, timeout_s: float) -> bool:
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_READ)
        return bool(selector.select(timeout_s))


def read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, bool]:
    """What the server sent, and whether it closed the connection within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    received = b""
    while (remaining := deadline - time.monotonic()) > 0:
        if not readable(sock, remaining):
            break
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:  # closed with our bytes unread: a reset, not a FIN
            return received, True
        if not chunk:
            return received, True
        received += chunk
    return received, False


def error_of(response: bytes, status: int) -> dict:
    """The OpenAI error in a raw `status` response that closes its connection."""
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0].startswith(f"HTTP/1.1 {status} "), response[:300]
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    assert headers["x-request-id"]
    error: dict = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def health_latency(sock: socket.socket) -> float:
    """Seconds for one /health on a kept-alive connection."""
    started = time.monotonic()
    sock.sendall(HEALTH)
    received = b""
    while not received.endswith(b'{"status":"ok"}'):
        chunk = sock.recv(4096)
        assert chunk, "the /health connection was closed"
        received += chunk
    return time.monotonic() - started


@dataclass
class Attack:
    """One connection sending a request head that never ends, in 256 KiB chunks."""

    server: ServerProcess
    max_bytes: int
    sent: int = 0
    response: bytes = b""
    closed: bool = False
    seconds: float = 0.0
    thread: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        chunk = b"a" * (256 * 1024)
        with connect(self.server) as sock:
            try:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Huge: ")
                # Stop as soon as the server answers: it is not reading any more.
                while self.sent < self.max_bytes and not readable(sock, 0):
                    sock.sendall(chunk)
                    self.sent += len(chunk)
            except OSError:  # the server closed while we were still sending
                pass
            self.response, self.closed = read_until_closed(sock, 5.0)
        self.seconds = time.monotonic() - started


def test_a_huge_header_gets_431_while_it_arrives_and_health_stays_fast(
    server: ServerProcess,
) -> None:
    # Five heads of up to 32 MB that never end: without a limit applied while reading, no
    # answer ever comes, and httptools' concatenation stalls the loop as they grow.
    attacks = [Attack(server, max_bytes=32 * 1024 * 1024) for _ in range(5)]
    worst = 0.0
    with connect(server) as probe:
        while any(attack.thread.is_alive() for attack in attacks):
            worst = max(worst, health_latency(probe))
    for attack in attacks:
        assert attack.closed, attack.response[:200]
        error = error_of(attack.response, 431)
        assert error["code"] == "request_headers_too_large"
        assert attack.seconds < 3.0, attack.seconds
        assert attack.sent < 8 * 1024 * 1024, attack.sent
    assert worst < 0.1, f"/health took {worst * 1000:.0f} ms during the attack"


def test_slow_and_idle_sockets_are_closed_and_hold_no_request_slots(
    server: ServerProcess,
) -> None:
    """200 sockets: header-slow and body-slow ones trickle a byte every 0.2 s, idle ones
    send nothing. Meanwhile /health and chat requests are served (no 429: the body-slow
    chat requests, 17x --max-pending, hold no slot), and within a few timeouts every one
    of the 200 is closed, the slow ones with a 408."""
    chat_head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(CHAT_BODY)
    )
    kinds = {"header": b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nX-Slow: ",
             "body": chat_head + CHAT_BODY[:10], "idle": b""}  # fmt: skip
    sockets: dict[socket.socket, str] = {}
    outcome: dict[str, list[tuple[bytes, bool]]] = {kind: [] for kind in kinds}
    with selectors.DefaultSelector() as selector:
        for index in range(200):
            kind = list(kinds)[index % 3]
            sock = connect(server)
            sock.sendall(kinds[kind])
            sockets[sock] = kind
            selector.register(sock, selectors.EVENT_READ)
        opened = time.monotonic()
        with httpx.Client(base_url=server.base_url, timeout=5) as http:
            while selector.get_map() and time.monotonic() - opened < TIMEOUT_S * 4:
                if time.monotonic() - opened < TIMEOUT_S * 0.8:  # while the slow ones hold
                    assert http.get("/health").status_code == 200
                    chat = http.post("/v1/chat/completions", content=CHAT_BODY,
                                     headers={"content-type": "application/json"})  # fmt: skip
                    assert chat.status_code == 503, chat.text
                    assert chat.json()["error"]["code"] == "render_only"
                for key, _ in selector.select(0.2):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    selector.unregister(sock)
                    outcome[sockets[sock]].append(read_until_closed(sock, 1.0))
                    sock.close()
                for key in list(selector.get_map().values()):  # one more byte each
                    sock = key.fileobj  # type: ignore[assignment]
                    if sockets[sock] != "idle":
                        with contextlib.suppress(OSError):  # closed: read on the next turn
                            sock.send(b"x")
        for key in list(selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
    assert [len(outcome[kind]) for kind in kinds] == [67, 67, 66], "sockets left open"
    assert all(closed and response == b"" for response, closed in outcome["idle"])
    for response, closed in outcome["header"]:
        assert closed
        assert error_of(response, 408)["code"] == "header_timeout"
    for response, closed in outcome["body"]:
        assert closed
        assert error_of(response, 408)["code"] == "body_timeout"


def test_a_body_in_pieces_within_the_timeout_is_served_and_the_connection_kept(
    server: ServerProcess,
) -> None:
    body = b'{"prompt": "hello there"}'
    head = (
        b"POST /tokenize HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    with connect(server) as sock:
        # Head and body in five pieces 0.15 s apart: 0.6 s in all, under each timeout.
        pieces = [head[:20], head[20:], body[:5], body[5:12], body[12:]]
        for piece in pieces:
            assert not readable(sock, 0.15), "the server answered a request not yet sent"
            sock.sendall(piece)
        assert readable(sock, 5)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        # The same connection serves the next request: its timers were reset.
        assert health_latency(sock) < 5


def test_a_malformed_request_gets_400_in_the_error_shape(server: ServerProcess) -> None:
    with connect(server) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        response, closed = read_until_closed(sock, 5)
    assert closed
    assert error_of(response, 400)["code"] == "invalid_http_request"
