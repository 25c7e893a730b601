"""Admission control, draining and slow-client protection for the generation routes.

A pure ASGI middleware around the generating routes (GENERATION_PATHS):
- at most `max_pending` of them in flight per render process; beyond that 429 with
  Retry-After, so a load balancer or client backs off instead of piling up. A request
  counts only once its body is complete: its body is read first (within --body-timeout,
  which the connection enforces) and replayed to the app, so clients trickling their
  bodies in cannot fill the slots and turn every other request into a 429;
- once draining (SIGTERM), new ones get 503 while the in-flight ones finish;
- every body write to the client must complete within `write_timeout_s`: a client that
  stops reading is cut off, which cancels its stream and aborts its worker request, so it
  cannot pin KV blocks on a worker.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from render_server.http.errors import anthropic_error_body, error_body, is_anthropic_route
from render_server.http.middleware import route_path
from render_server.schemas.errors import SERVER_ERROR

logger = logging.getLogger(__name__)

GENERATION_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/inference/v1/generate",
    "/v1/responses",
    "/v1/messages",
)
"""Routes that generate (matched as path suffixes: /v1/messages/count_tokens is not one)."""


class ClientTooSlow(Exception):
    """The client did not take a response chunk within the write timeout."""


class Admission:
    """In-flight generation requests of this process, and whether it is draining."""

    def __init__(self, max_pending: int, write_timeout_s: float) -> None:
        self.max_pending = max_pending
        self.write_timeout_s = write_timeout_s
        self.in_flight = 0
        self.draining = False
        self.rejected = 0
        self.slow_clients = 0
        self._idle: asyncio.Event | None = None

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is in flight; False if `timeout_s` passed first."""
        if self.in_flight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def _finished_one(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None if the client disconnected first."""
    message = await receive()
    if message["type"] != "http.request":
        return None
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        return body  # the usual case: the body came in one piece
    chunks = [body]
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands out `body` (already read) once, then defers to `receive`,
    which then reports the client's disconnect as usual."""
    pending = True

    async def replayed() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _refuse(
    scope: Scope, send: Send, status: int, message: str, code: str, kind: str
) -> None:
    if is_anthropic_route(route_path(scope)):
        body = anthropic_error_body(status, message)
    else:
        body = error_body(message, type=kind, code=code)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", b"1"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class AdmissionMiddleware:
    """See the module docstring."""

    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].endswith(GENERATION_PATHS):
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:  # the client left (or timed out) before its body was complete
            return
        admission = self.admission
        if admission.draining:
            await _refuse(
                scope, send, 503, "This server is shutting down; retry elsewhere.", "draining",
                SERVER_ERROR,
            )  # fmt: skip
            return
        if admission.in_flight >= admission.max_pending:
            admission.rejected += 1
            await _refuse(
                scope,
                send,
                429,
                f"Too many requests in flight on this server ({admission.max_pending}); "
                "retry shortly.",
                "too_many_pending",
                "rate_limit_error",
            )
            return
        timeout = admission.write_timeout_s

        async def timed_send(message: Message) -> None:
            if message["type"] != "http.response.body":
                await send(message)
                return
            # asyncio.timeout, not wait_for: no task per chunk on the hot path.
            try:
                async with asyncio.timeout(timeout):
                    await send(message)
            except TimeoutError:
                raise ClientTooSlow from None

        admission.in_flight += 1
        try:
            await self.app(scope, replay(body, receive), timed_send)
        except ClientTooSlow:
            admission.slow_clients += 1
            logger.warning("a client stopped reading for %.0fs: its stream was cut", timeout)
        finally:
            admission._finished_one()
