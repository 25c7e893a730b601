"""Every error leaves the server as `{"error": {"message", "type", "param", "code"}}`,
but on Anthropic's routes (/v1/messages...), whose clients read
`{"type": "error", "error": {"type", "message"}}` with Anthropic's error types.

Routes raise `ApiError`; FastAPI's own errors (unknown route, wrong method, invalid JSON,
validation) are translated by the handlers installed here; the ASGI middlewares build
their bodies with `error_body` (or `anthropic_error_body`, which `send_error` picks by
route). Nothing here ever puts a traceback in a response.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from render_server.http.serving import ClientDisconnected
from render_server.schemas.body import MAX_JSON_DEPTH
from render_server.schemas.errors import (
    INVALID_REQUEST,
    SERVER_ERROR,
    ApiError,
    ErrorInfo,
    ErrorResponse,
)

logger = logging.getLogger(__name__)


# Where FastAPI says a value came from; the client only cares about the path below it.
_LOCATION_ROOTS = frozenset({"body", "query", "path", "header", "cookie"})
# Pydantic's messages for "this is not an object", seen when the body is `[1]` or `"x"`.
_NOT_AN_OBJECT = frozenset({"model_type", "model_attributes_type", "dict_type", "missing"})


def error_body(
    message: str, *, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> bytes:
    """Serialized error body, for the ASGI middlewares that answer without FastAPI."""
    info = ErrorInfo(message=message, type=type, param=param, code=code)
    return ErrorResponse(error=info).model_dump_json().encode()


def error_response(
    status_code: int, info: ErrorInfo, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """A JSONResponse carrying the OpenAI error body."""
    return JSONResponse(
        ErrorResponse(error=info).model_dump(), status_code=status_code, headers=headers
    )


ANTHROPIC_PREFIX = "/v1/messages"


def is_anthropic_route(path: str) -> bool:
    """Whether `path` (as the router matches it) is one of the Messages API's."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


_ANTHROPIC_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_type(status_code: int) -> str:
    """Anthropic's error type for a status: its SDKs and agents branch on it."""
    default = "api_error" if status_code >= 500 else "invalid_request_error"
    return _ANTHROPIC_TYPES.get(status_code, default)


def anthropic_error(status_code: int, message: str) -> dict[str, object]:
    """Anthropic's error body, as a stream's `event: error` carries it too."""
    return {
        "type": "error",
        "error": {"type": anthropic_error_type(status_code), "message": message},
    }


def anthropic_error_body(status_code: int, message: str) -> bytes:
    """Serialized Anthropic error body, for the ASGI middlewares."""
    return json.dumps(anthropic_error(status_code, message), separators=(",", ":")).encode()


def _error_for(
    request: Request,
    status_code: int,
    info: ErrorInfo,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """The error response in the shape of the API `request` called."""
    path: str = request.scope["path"]
    # As the router matches it: behind a proxy's root_path, scope["path"] starts with it.
    if is_anthropic_route(path.removeprefix(request.scope.get("root_path", ""))):
        return JSONResponse(
            anthropic_error(status_code, info.message), status_code=status_code, headers=headers
        )
    return error_response(status_code, info, headers)


def is_json_content_type(content_type: str | None) -> bool:
    """True for `application/json` and `application/*+json`, as FastAPI parses them."""
    if not content_type:
        return False
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )


_SCALAR_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none"})


def _is_union_tag(part: Any) -> bool:
    """A step pydantic adds to a location for the member of a union it tried (`str`,
    `list[int]`, `constrained-int`): a type, not a field of the request."""
    if not isinstance(part, str):
        return False
    return part in _SCALAR_UNION_TAGS or any(mark in part for mark in "<[-")


def _param_path(loc: Sequence[Any]) -> list[str]:
    parts = [str(part) for part in loc if not _is_union_tag(part)]
    if parts and parts[0] in _LOCATION_ROOTS:
        parts = parts[1:]
    return parts


def validation_error_info(errors: Sequence[Any], content_type: str | None) -> ErrorInfo:
    """Turn FastAPI/pydantic validation errors into one OpenAI error naming the field."""
    if not errors:
        return ErrorInfo(message="Invalid request.", type=INVALID_REQUEST)
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "invalid JSON")
        position = first["loc"][-1] if first.get("loc") else "?"
        return ErrorInfo(
            message=f"We could not parse the JSON body of your request: {detail} "
            f"(at character {position}).",
            type=INVALID_REQUEST,
            code="invalid_json",
        )
    # Without a JSON content type FastAPI never parses the body, so every body error is
    # really this one; vLLM and the OpenAI API answer it with a 400 as well.
    if first.get("loc", ("",))[0] == "body" and not is_json_content_type(content_type):
        return ErrorInfo(
            message="Unsupported Content-Type: send the body as application/json.",
            type=INVALID_REQUEST,
            code="unsupported_media_type",
        )
    path = _param_path(first.get("loc", ()))
    if not path and first.get("type") in _NOT_AN_OBJECT:
        return ErrorInfo(message="The request body must be a JSON object.", type=INVALID_REQUEST)
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    # Checks of the whole body (schemas/body.py) name the field they found in `ctx`.
    param = ".".join(path) or first.get("ctx", {}).get("param")
    if param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return ErrorInfo(message=message, type=INVALID_REQUEST, param=param)


_HTTP_CODES: dict[int, str] = {
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    431: "request_headers_too_large",
}


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return _error_for(request, exc.status_code, exc.info, exc.headers)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    if status == 404:
        # The router's "Not Found" says nothing; OpenAI names the method and path.
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif status == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}."
    else:
        message = str(exc.detail)
    code = _HTTP_CODES.get(status)
    if isinstance(exc.__cause__, RecursionError):
        # FastAPI's JSON decoder gave up on the nesting before schemas/body.py could look.
        message = f"The JSON body nests objects and arrays deeper than {MAX_JSON_DEPTH} levels."
        code = "invalid_json"
    kind = SERVER_ERROR if status >= 500 else INVALID_REQUEST
    info = ErrorInfo(message=message, type=kind, code=code)
    return _error_for(request, status, info, exc.headers)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    info = validation_error_info(exc.errors(), request.headers.get("content-type"))
    return _error_for(request, 400, info)


async def _client_disconnected(request: Request, exc: Exception) -> Response:
    # The client left before its answer was ready: nobody reads this, and it is no server
    # error (logging it as one put a traceback in the log per impatient client).
    # 499 is what RequestContextMiddleware counts for a client that went away.
    return Response(status_code=499)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    # Reached only if an exception escapes RequestContextMiddleware, which normally
    # answers 500s itself (so they carry the request id).
    logger.error("unhandled error", exc_info=exc)
    return _error_for(request, 500, ErrorInfo(message="Internal server error.", type=SERVER_ERROR))


def install_exception_handlers(app: FastAPI) -> None:
    """Route every FastAPI/Starlette error through the API's error shape."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ClientDisconnected, _client_disconnected)
    app.add_exception_handler(Exception, _unexpected_error)
