"""The OpenAI error body: every non-2xx response of the render server has this shape."""

from __future__ import annotations

from pydantic import BaseModel


class ErrorInfo(BaseModel):
    """What went wrong, as the OpenAI API and SDKs expect it."""

    message: str
    """Human-readable explanation; never a traceback."""
    type: str
    """Error class: `invalid_request_error`, `authentication_error`, `server_error`, ..."""
    param: str | None = None
    """Dotted path of the offending request field (e.g. `messages.0.role`), if any."""
    code: str | None = None
    """Machine-readable code (e.g. `model_not_found`, `invalid_api_key`), if any."""


class ErrorResponse(BaseModel):
    """Top-level error body: `{"error": {...}}`."""

    error: ErrorInfo
