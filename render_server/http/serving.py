"""What the generation endpoints share: worker errors as HTTP errors, SSE framing, running a
non-streamed request until the client disconnects, and usage."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Any, TypeVar

import anyio
import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from render_server.generation.lifecycle import Generation
from render_server.schemas.errors import SERVER_ERROR, ApiError, ErrorInfo, ErrorResponse
from render_server.schemas.responses import PromptTokensDetails, Usage
from render_server.worker_client.pool import WorkerError

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"
_encode_json = msgspec.json.Encoder().encode


REQUEST_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
}
"""The error answers of every endpoint that reads a model's request, for the OpenAPI
document."""
GENERATION_ERRORS: dict[int | str, dict[str, Any]] = {
    **REQUEST_ERRORS,
    503: {"model": ErrorResponse, "description": "No worker available"},
}
"""The error answers of the generation endpoints, for the OpenAPI document."""


def json_response(body: msgspec.Struct) -> Response:
    """A response body encoded by msgspec: Structs go straight to bytes, where FastAPI's
    encoder walks the value in Python first (bench/RESULTS.md, Design choices)."""
    return Response(_encode_json(body), media_type="application/json")


class ClientDisconnected(Exception):
    """The client went away before its response was ready."""


def new_request_id(prefix: str, requested: str | None = None) -> str:
    """The response id: the client's `request_id` (vLLM's field) after `prefix`, or a
    fresh one."""
    return f"{prefix}-{requested or uuid.uuid4().hex}"


def worker_error_to_api(error: WorkerError) -> ApiError:
    """The HTTP answer to a request its workers could not serve."""
    if error.code == "rejected":
        if error.reject_code in ("invalid_request", "too_long", "lora_disabled"):
            return ApiError(400, error.message, code=error.reject_code)
        if error.reject_code == "lora_not_found":
            # Known here but not to the worker (unloaded meanwhile, or its load failed).
            return ApiError(404, error.message, param="model", code="model_not_found")
        if error.reject_code == "queue_full":
            return ApiError(
                503,
                f"The workers are busy: {error.message}. Retry shortly.",
                type=SERVER_ERROR,
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        # Else "protocol": the worker kept forgetting this render server; a retry may land.
    if error.code == "timeout":
        return ApiError(504, error.message, type=SERVER_ERROR, code="timeout")
    if error.code == "shutdown":
        return ApiError(
            503, error.message, type=SERVER_ERROR, code="draining", headers={"Retry-After": "1"}
        )
    return ApiError(
        503,
        f"No worker could serve this request: {error.message}",
        type=SERVER_ERROR,
        code=error.reject_code or error.code,
        headers={"Retry-After": "1"},
    )


def sse_event(body: object) -> bytes:
    return b"data: " + _encode_json(body) + b"\n\n"


class SseResponse(StreamingResponse):
    """An SSE stream that closes its body and then calls `on_close` however it ends.

    Starlette leaves the body iterator suspended when a send raises (a client cut off by
    the write timeout, see admission.py) and then skips the background task, so the
    generation behind it would run on, holding its worker's KV blocks, for nobody."""

    def __init__(self, body: AsyncIterable[bytes], on_close: Callable[[], Awaitable[None]]):
        super().__init__(body, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Shielded: a stream cancelled by the client's disconnect still closes.
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                await self.on_close()


def sse_error(error: ApiError | WorkerError) -> bytes:
    """An error after the 200 went out: an SSE event in the OpenAI error shape."""
    api_error = error if isinstance(error, ApiError) else worker_error_to_api(error)
    info: ErrorInfo = api_error.info
    return sse_event({"error": info.model_dump()})


def usage_of(generation: Generation) -> Usage:
    """OpenAI's usage of a whole request (every prompt, every choice)."""
    counts = generation.usage()
    return Usage(
        prompt_tokens=counts.prompt_tokens,
        completion_tokens=counts.completion_tokens,
        total_tokens=counts.prompt_tokens + counts.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=counts.cached_tokens),
    )


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (non-streamed requests:
    nothing else would notice, and the workers would keep generating for nobody)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected
