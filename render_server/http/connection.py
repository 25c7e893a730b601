"""One HTTP/1.1 connection: uvicorn's httptools protocol, with limits the app cannot apply.

By the time a request reaches the ASGI app its headers are parsed and its connection is
held, so three things are decided here, while the bytes arrive:
- a request head (request line and headers) larger than the header limit is answered 431
  and the connection closed as soon as it passes the limit, instead of being buffered
  whole: httptools grows a header value by concatenation, so parsing a huge one costs
  time quadratic in its size, all of it on the event loop;
- a head that does not arrive within `header_timeout_s`, or a body that does not arrive
  within `body_timeout_s` of its headers, is answered 408 and the connection closed, so a
  slow client cannot hold a socket (or, see admission.py, a request slot) forever;
- a connection that never sends a byte is closed after the keep-alive timeout, as an idle
  one between requests already is.

The common request costs an int add and three attribute checks per chunk read: the timers
are armed only when a chunk leaves a head or a body incomplete. The exact header count and
size (names and values, once parsed) stay with LimitsMiddleware; the bound here also counts
the request line and the framing, so it sits a little above the limit.

httptools (in the `render` extra, which render-serve needs) is used, not "auto": the limits
live in these callbacks, and an h11 twin would be a second copy of them for a parser we
never pick. This leans on uvicorn's protocol internals (`cycle`, `timeout_keep_alive_task`,
the parser callbacks), which have not changed in years; the tests run it over real sockets.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from render_server.http.errors import error_body
from render_server.settings import RenderSettings

# The head bound counts bytes as sent, LimitsMiddleware only names and values: leave room
# for the request line and the ": " and CRLF around each header.
REQUEST_LINE_AND_FRAMING_BYTES = 16 * 1024


@dataclass(frozen=True)
class ConnectionLimits:
    """What one connection may take: the head size and how long its parts may take."""

    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float

    @property
    def max_head_bytes(self) -> int:
        return self.max_header_bytes + REQUEST_LINE_AND_FRAMING_BYTES


class HttpProtocol(HttpToolsProtocol):
    """See the module docstring. Built by uvicorn per connection; `limits` is set on the
    subclass that `http_protocol` makes."""

    limits: ClassVar[ConnectionLimits]

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._in_body = False  # between a request's headers and the end of its body
        self._head_bytes = 0  # read since the last complete head, while outside a body
        self._timer: asyncio.TimerHandle | None = None  # the header or the body timeout

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # uvicorn arms the keep-alive timer only after a response: without this a socket
        # that never sends a byte stays open.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._in_body:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_body:
            if self._timer is None:
                self._timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)
        elif self._head_bytes > self.limits.max_head_bytes:
            limit = self.limits.max_header_bytes
            self._refuse(
                431,
                f"Request headers too large: the limit is {limit} bytes.",
                "request_headers_too_large",
            )
        elif self._timer is None and self._head_bytes and not self._is_responding():
            # Part of a head arrived (a complete one reset the count). While a response is
            # still being written the client may send ahead; its timer starts with the next
            # chunk after that response, or the keep-alive timer closes the connection.
            self._timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def on_headers_complete(self) -> None:
        self._in_body = True
        self._head_bytes = 0
        self._cancel_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        self._cancel_timer()
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, msg, "invalid_http_request")

    def _is_responding(self) -> bool:
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timed_out(self) -> None:
        self._timer = None
        timeout = self.limits.header_timeout_s
        self._refuse(408, f"The request headers took longer than {timeout:g}s.", "header_timeout")

    def _body_timed_out(self) -> None:
        self._timer = None
        if self.cycle.response_complete:  # answered without its body: nothing left to say
            self.transport.close()
            return
        timeout = self.limits.body_timeout_s
        self._refuse(408, f"The request body took longer than {timeout:g}s.", "body_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer `status` from the connection itself and close it. A request the app is
        still handling here sees a disconnect, as if the client had left."""
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # nothing the app sends from now on goes out
            cycle.message_event.set()  # and a pending receive() returns http.disconnect
            if cycle.response_started:  # mid-response: no status line can follow
                self.transport.close()
                return
        body = error_body(message, code=code)
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            # No request reached RequestContextMiddleware, which gives every other
            # response its id: make one, so this response can be quoted in a report too.
            b"x-request-id: %s\r\n" % os.urandom(16).hex().encode(),
            b"connection: close\r\n\r\n",
            body,
        ]
        self.transport.write(b"".join(head))
        self.transport.close()


def http_protocol(settings: RenderSettings) -> type[HttpProtocol]:
    """The protocol class for `uvicorn.Config(http=...)`, bound to `settings`' limits."""

    class BoundHttpProtocol(HttpProtocol):
        limits = ConnectionLimits(
            max_header_bytes=settings.max_header_bytes,
            header_timeout_s=settings.header_timeout_s,
            body_timeout_s=settings.body_timeout_s,
        )

    return BoundHttpProtocol
