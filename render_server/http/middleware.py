"""Pure ASGI middlewares: request context (id, metrics, last-resort 500), limits, API keys.

Pure ASGI rather than BaseHTTPMiddleware: these run on every request, and a plain
`__call__` that only wraps `send`/`receive` when it must costs a few microseconds, where
BaseHTTPMiddleware adds a task group and a streaming response per layer.

Order, outermost first (see app.py): RequestContext -> CORS -> Limits -> ApiKey -> app.
RequestContext is outermost so every response, errors from the inner layers included,
carries X-Request-Id and is counted; CORS sits outside the key check so browsers can
preflight without a key and can read a 401.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import time
import traceback
from collections.abc import Iterable, Sequence

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from render_server.http.errors import anthropic_error_body, error_body, is_anthropic_route
from render_server.http.metrics import UNMATCHED_ROUTE, RenderMetrics
from render_server.schemas.errors import SERVER_ERROR

logger = logging.getLogger(__name__)

# The only paths served without an API key. Compared for equality against the path the
# router will match (root_path stripped), so `/health/../x`, `//health` or `/health/`
# are simply not public; everything not listed here needs a key (default deny).
PUBLIC_PATHS = frozenset({"/health", "/ready", "/version"})

REQUEST_ID_HEADER = b"x-request-id"
_REQUEST_ID_MAX_CHARS = 128
# Request ids end up in logs and response headers: keep only characters that cannot
# split a log line or a header.
_REQUEST_ID_UNSAFE = re.compile(rb"[^A-Za-z0-9._:\-]")


async def send_error(
    send: Send,
    status: int,
    message: str,
    *,
    code: str | None = None,
    type: str = "invalid_request_error",
    headers: Iterable[tuple[bytes, bytes]] = (),
    path: str | None = None,
) -> None:
    """Answer with an error body straight from ASGI (no FastAPI involved): OpenAI's, or
    Anthropic's when `path` (the route path) is one of the Messages API's."""
    if path is not None and is_anthropic_route(path):
        body = anthropic_error_body(status, message)
    else:
        body = error_body(message, type=type, code=code)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def route_path(scope: Scope) -> str:
    """The path the router matches: scope["path"] minus root_path, as Starlette does it."""
    path: str = scope["path"]
    root_path: str = scope.get("root_path", "")
    if root_path and path.startswith(root_path):
        rest = path[len(root_path) :]
        if rest == "" or rest.startswith("/"):
            return rest
    return path


def _client_request_id(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == REQUEST_ID_HEADER:
            cleaned = _REQUEST_ID_UNSAFE.sub(b"", value[: _REQUEST_ID_MAX_CHARS * 4])
            return cleaned[:_REQUEST_ID_MAX_CHARS].decode("ascii") or None
    return None


class _RequestIds:
    """Random 32-hex-digit request ids (as uuid4().hex reads), cut from os.urandom output
    drawn 2 KiB at a time: one system call per 128 requests instead of one each. Used from
    the event loop's thread only."""

    def __init__(self) -> None:
        self._hex = ""
        self._at = 0

    def next(self) -> str:
        if self._at >= len(self._hex):
            self._hex = os.urandom(2048).hex()
            self._at = 0
        at = self._at
        self._at = at + 32
        return self._hex[at : at + 32]


# How much of a 5xx body its log line may quote, and how many frames of an unhandled
# exception's traceback are logged.
_CAUSE_BYTES = 1024
_TRACEBACK_FRAMES = 40
# /ready's 503 reports a state (no worker yet, draining) that probes poll for: no failure.
_STATE_PROBES = frozenset({"/ready"})


def _error_cause(body: bytes) -> str:
    """What a 5xx body says went wrong, for the log line: `code: 'message'` of an OpenAI
    error body, else the body's first bytes (repr: a log line stays one line)."""
    try:
        error = json.loads(body)["error"]
        return f"{error.get('code') or error.get('type')}: {error['message']!r}"
    except (ValueError, TypeError, KeyError):
        return repr(body[:_CAUSE_BYTES])


def _bounded_traceback(exc: BaseException) -> str:
    # The innermost frames say what failed; a deep recursion would otherwise log a
    # thousand frames per request.
    return "".join(traceback.format_exception(exc, limit=-_TRACEBACK_FRAMES)).rstrip()


class RequestContextMiddleware:
    """Gives each request an id (echoed in X-Request-Id), times and counts it, turns an
    unhandled exception into a 500 error body without leaking the traceback, and logs
    every 5xx answer once, with its request id and cause."""

    def __init__(self, app: ASGIApp, metrics: RenderMetrics) -> None:
        self.app = app
        self.metrics = metrics
        self._request_ids = _RequestIds()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started_at = time.perf_counter()
        request_id = _client_request_id(scope["headers"]) or self._request_ids.next()
        scope.setdefault("state", {})["request_id"] = request_id
        id_header = (REQUEST_ID_HEADER, request_id.encode("ascii"))
        status = 0
        error_body_start: bytes | None = None  # of a 5xx answer, for its log line
        logged = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, error_body_start
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), id_header]
            elif status >= 500 and error_body_start is None and message.get("body"):
                error_body_start = message["body"][:_CAUSE_BYTES]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            logger.error("request %s failed: %s", request_id, _bounded_traceback(exc))
            logged = True
            if status:
                # The response has started: nothing sane can be sent any more. Returning
                # lets uvicorn close the connection without logging the traceback again.
                return
            await send_error(
                send_with_id,
                500,
                "Internal server error.",
                type=SERVER_ERROR,
                path=route_path(scope),
            )
        finally:
            if status >= 500 and not logged and route_path(scope) not in _STATE_PROBES:
                logger.log(
                    logging.WARNING if status == 503 else logging.ERROR,
                    "request %s: %s %.200r answered %d, %s",
                    request_id,
                    scope["method"],
                    scope["path"],
                    status,
                    _error_cause(error_body_start or b""),
                )
            route = scope.get("route")
            self.metrics.observe_request(
                scope["method"],
                getattr(route, "path", UNMATCHED_ROUTE),
                status or 499,  # no response at all: the client went away first
                time.perf_counter() - started_at,
            )


class BodyTooLarge(HTTPException):
    """Raised from `receive` once a streamed body passes the limit; FastAPI lets
    HTTPExceptions from body reading through, and the handler turns it into a 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"Request body too large: the limit is {limit} bytes.")


class LimitsMiddleware:
    """431 for too many or too large headers, 413 for a body over the size limit.

    The header checks here are the exact ones (count, names + values); a head far past
    the size limit never gets this far: the connection (http/connection.py) answers 431
    while it arrives."""

    def __init__(
        self, app: ASGIApp, max_body_bytes: int, max_header_bytes: int, max_header_count: int
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.max_header_count = max_header_count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        if len(headers) > self.max_header_count:
            await send_error(
                send,
                431,
                f"Too many request headers: the limit is {self.max_header_count}.",
                code="request_headers_too_large",
                path=route_path(scope),
            )
            return
        header_bytes = 0
        content_length: bytes | None = None
        chunked = False
        for name, value in headers:
            header_bytes += len(name) + len(value)
            if name == b"content-length":
                content_length = value
            elif name == b"transfer-encoding":
                chunked = True
        if header_bytes > self.max_header_bytes:
            await send_error(
                send,
                431,
                f"Request headers too large: the limit is {self.max_header_bytes} bytes.",
                code="request_headers_too_large",
                path=route_path(scope),
            )
            return
        declared = int(content_length) if content_length and content_length.isdigit() else None
        if declared is not None and declared > self.max_body_bytes:
            await send_error(
                send,
                413,
                f"Request body too large: the limit is {self.max_body_bytes} bytes.",
                code="request_too_large",
                path=route_path(scope),
            )
            return
        if declared is not None and not chunked:
            # The HTTP parser never hands over more than Content-Length bytes, so a body
            # within its declared length needs no counting (the common, fast path).
            await self.app(scope, receive, send)
            return
        await self._counted(scope, receive, send)

    async def _counted(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.max_body_bytes
        received = 0
        response_started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge as exc:
            # Normally FastAPI's handler answers it; this covers reads outside a route.
            if response_started:
                raise
            await send_error(
                send, 413, str(exc.detail), code="request_too_large", path=route_path(scope)
            )


def presented_api_key(headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
    """The API key a request presents: `Authorization: Bearer <key>` (OpenAI's clients)
    or `x-api-key: <key>` (Anthropic's); None without one, or with another scheme."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    for name, value in headers:
        if name == b"x-api-key":
            return value.strip()
    return None


class ApiKeyMiddleware:
    """Default-deny Bearer-token check: every path but PUBLIC_PATHS needs a valid key.

    Keys are compared as SHA-256 digests with hmac.compare_digest, against every
    configured key without stopping early, so timing reveals neither the key nor which
    key matched.
    """

    def __init__(self, app: ASGIApp, api_keys: Sequence[str]) -> None:
        self.app = app
        self._digests = [hashlib.sha256(key.encode()).digest() for key in api_keys]
        self._unauthorized = [(b"www-authenticate", b"Bearer")]

    def _is_authorized(self, headers: Sequence[tuple[bytes, bytes]]) -> bool:
        token = presented_api_key(headers)
        if token is None:
            return False
        presented = hashlib.sha256(token).digest()
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(presented, digest)
        return matched

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if (
            kind == "lifespan"
            or route_path(scope) in PUBLIC_PATHS
            or self._is_authorized(scope["headers"])
        ):
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send_error(
            send,
            401,
            "Missing or invalid API key: send it as `Authorization: Bearer <key>` "
            "(or `x-api-key: <key>`).",
            code="invalid_api_key",
            headers=self._unauthorized,
            path=route_path(scope),
        )


class CorsMiddleware(CORSMiddleware):
    """Starlette's CORS middleware, with refused preflights in the OpenAI error shape."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        # Starlette answers "Disallowed CORS origin" as text/plain; keep its message and
        # its Access-Control-* headers, swap in our body.
        body = error_body(bytes(response.body).decode() + ".", code="cors_preflight_refused")
        headers = {
            name: value
            for name, value in response.headers.items()
            if name not in ("content-length", "content-type")
        }
        return Response(body, response.status_code, headers, media_type="application/json")
