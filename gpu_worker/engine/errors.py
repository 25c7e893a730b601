"""Errors the engine raises toward the server."""

from __future__ import annotations


class RequestRejected(Exception):
    """The engine will not take a request; `code` is a `shared.protocol.Rejected.code`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
