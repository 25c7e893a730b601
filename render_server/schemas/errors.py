"""The OpenAI error body, and `ApiError`, the exception that carries one.

Every non-2xx response of the render server has this shape. Any layer that checks a
request (schemas, templating, generation, parsing) raises `ApiError`; the HTTP layer
(render_server.http.errors) turns it into the response."""

from __future__ import annotations

from pydantic import BaseModel

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"

# Client text quoted in an error message is cut to this: a body may hold megabytes where
# a name belongs, and the error must not echo them back.
MAX_QUOTED_CHARS = 256


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


class ApiError(Exception):
    """An error a route reports to the client, with its HTTP status."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers


def quoted(text: str) -> str:
    """`text` as an error message may quote it: at most MAX_QUOTED_CHARS characters, and
    anything UTF-8 cannot encode (a lone surrogate) escaped."""
    if len(text) > MAX_QUOTED_CHARS:
        text = f"{text[:MAX_QUOTED_CHARS]}... ({len(text)} characters)"
    return text.encode("utf-8", "backslashreplace").decode()


def model_not_found(name: str) -> ApiError:
    """The 404 OpenAI returns for a `model` it does not serve."""
    return ApiError(
        404, f"The model `{quoted(name)}` does not exist.", param="model", code="model_not_found"
    )
