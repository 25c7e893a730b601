"""Errors the engine raises toward the server."""

from __future__ import annotations

from shared.protocol import RejectCode


class RequestRejected(Exception):
    """The engine will not take a request; `code` is the wire's `Rejected.code`."""

    def __init__(self, code: RejectCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
