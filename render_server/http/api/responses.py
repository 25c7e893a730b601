"""The OpenAI Responses API: POST /v1/responses (and its render), GET, DELETE, cancel
and the input items.

A Responses body is translated into a chat body (`ChatCompletionRequest`): the input
items become chat messages after the stored conversation of `previous_response_id`, and
the request runs through the chat endpoint's own steps (`prepare_chat`, `admit`,
`new_generation`, `respond`), its output split by a `ChoiceProcessor` as chat's is. Only
the answer's shape is this API's own (`responses_stream.ResponsesFormatter`). Stored
responses live in `state.response_store`, per tenant.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator
from typing import Annotated, Any, Literal, NamedTuple

import anyio
import msgspec
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse

from render_server.generation.lifecycle import Generation
from render_server.http.api.chat import prepare_chat
from render_server.http.api.deps import RenderState, StateDep
from render_server.http.api.render import generate_request
from render_server.http.api.responses_input import (
    chat_body,
    input_messages,
    output_messages,
    refuse_unsupported,
    response_template,
)
from render_server.http.api.responses_items import context_items, page
from render_server.http.api.responses_stream import ResponsesFormatter, new_item_id
from render_server.http.endpoint import (
    admit,
    check_request,
    new_generation,
    prompt_specs,
    respond,
    tenant_id,
)
from render_server.http.serving import GENERATION_ERRORS, REQUEST_ERRORS, json_response
from render_server.parsing.chat_output import ChoiceProcessor
from render_server.schemas.errors import SERVER_ERROR, ApiError, quoted
from render_server.schemas.generate_api import GenerateRequest
from render_server.schemas.generation import ChatCompletionRequest
from render_server.schemas.responses_api import (
    DeletedResponse,
    ResponsesRequest,
    ResponseStatus,
    StoredResponse,
)
from render_server.store import RecordTooLarge, ResponseStore, StoreError

logger = logging.getLogger(__name__)
router = APIRouter(tags=["responses"])

_encode = msgspec.json.Encoder().encode
_decode_record = msgspec.json.Decoder(StoredResponse).decode

CANCEL_WAIT_S = 5.0
"""How long a cancel waits for the running response to record its end."""


# ---- the store ------------------------------------------------------------------------


def _store(state: RenderState) -> ResponseStore:
    if state.response_store is None:
        raise ApiError(503, "No response store is configured.", type=SERVER_ERROR)
    return state.response_store


def _store_error(exc: StoreError) -> ApiError:
    if isinstance(exc, RecordTooLarge):
        return ApiError(
            400, f"The response is too large to store: {exc}.", param="store", code="too_large"
        )
    return ApiError(
        503,
        f"The response store is unavailable: {exc}",
        type=SERVER_ERROR,
        code="store_unavailable",
        headers={"Retry-After": "1"},
    )


async def _get(store: ResponseStore, tenant: str, response_id: str) -> StoredResponse | None:
    try:
        record = await store.get(tenant, response_id)
    except StoreError as exc:
        raise _store_error(exc) from exc
    return None if record is None else _decode_record(record)


async def _put(store: ResponseStore, tenant: str, stored: StoredResponse) -> None:
    try:
        await store.put(tenant, stored.response.id, _encode(stored))
    except StoreError as exc:
        raise _store_error(exc) from exc


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    which = "Previous response" if param else "Response"
    return ApiError(
        404,
        f"{which} with id {quoted(response_id)!r} not found.",
        param=param,
        code="previous_response_not_found" if param else "not_found",
    )


async def _previous(
    state: RenderState, request: Request, body: ResponsesRequest
) -> StoredResponse | None:
    if body.previous_response_id is None:
        return None
    previous = await _get(_store(state), tenant_id(request), body.previous_response_id)
    if previous is None:
        raise _not_found(body.previous_response_id, "previous_response_id")
    if previous.response.status == "in_progress":
        raise ApiError(
            400, "The previous response is still in progress.", param="previous_response_id"
        )
    return previous


class _StoredRun:
    """A stored response while it runs: in_progress in the store (GET and cancel see it),
    stopped when cancelled, and stored once more as it ended."""

    def __init__(
        self,
        store: ResponseStore,
        tenant: str,
        generation: Generation,
        formatter: ResponsesFormatter,
        history: list[dict[str, Any]],
        items: list[dict[str, Any]],
    ) -> None:
        self.store = store
        self.tenant = tenant
        self.generation = generation
        self.formatter = formatter
        self.history = history
        self.items = items

    async def start(self) -> None:
        stored = StoredResponse(self.formatter.template, self.history, self.items)
        await _put(self.store, self.tenant, stored)

    async def _abort_when(self, cancelled: asyncio.Event) -> None:
        await cancelled.wait()
        self.formatter.cancelled = True
        await self.generation.abort()

    async def finish(self, fallback: ResponseStatus) -> None:
        """Store the response as it ended (`fallback` when it never reached its end)."""
        formatter = self.formatter
        response = formatter.final
        if response is None:
            response = formatter.snapshot("cancelled" if formatter.cancelled else fallback, None)
        stored = StoredResponse(response, self.history + output_messages(response), self.items)
        # Also when the client left and the stream is being cancelled: the record must
        # not stay in_progress.
        with anyio.CancelScope(shield=True):
            try:
                try:
                    await self.store.put(self.tenant, response.id, _encode(stored))
                except RecordTooLarge:
                    # Kept in_progress it would look alive; kept without its output it
                    # would continue a conversation that is not the one that happened.
                    await self.store.delete(self.tenant, response.id)
                    raise
            except StoreError as exc:
                logger.warning("response %s could not be stored: %s", response.id, exc)

    async def whole(self, request: Request) -> Response:
        async with self.store.running(self.tenant, self.formatter.template.id) as cancelled:
            watcher = asyncio.ensure_future(self._abort_when(cancelled))
            try:
                return await respond(request, self.generation, self.formatter, stream=False)
            finally:
                watcher.cancel()
                await self.finish("failed")

    async def stream(self, events: AsyncIterable[Any]) -> AsyncIterator[Any]:
        async with self.store.running(self.tenant, self.formatter.template.id) as cancelled:
            watcher = asyncio.ensure_future(self._abort_when(cancelled))
            try:
                async for event in events:
                    yield event
            finally:
                watcher.cancel()
                await self.finish("incomplete")


# ---- routes ---------------------------------------------------------------------------


class _Turn(NamedTuple):
    """A Responses body as it runs: the chat body, the conversation a stored response keeps
    (without its output yet), and the items it is generated from (input_items lists them)."""

    chat: ChatCompletionRequest
    conversation: list[dict[str, Any]]
    items: list[dict[str, Any]]


async def _prepare(request: Request, state: RenderState, body: ResponsesRequest) -> _Turn:
    refuse_unsupported(body)
    previous = await _previous(state, request, body)
    history = [] if previous is None else previous.history
    conversation = history + input_messages(body, history)
    return _Turn(chat_body(body, conversation), conversation, context_items(previous, body))


@router.post("/v1/responses", responses=GENERATION_ERRORS)
async def create_response(body: ResponsesRequest, request: Request, state: StateDep) -> Response:
    """OpenAI's Responses API, streamed (named SSE events) or not; stored unless
    `store` is false."""
    chat, conversation, items = await _prepare(request, state, body)
    pool = admit(state, chat)
    prompt = await prepare_chat(request, state, chat)
    response_id = new_item_id("resp")
    generation = new_generation(
        state,
        pool,
        chat,
        response_id,
        [prompt.prompt_ids],
        prompt_param="input",
        constraint=prompt.constraint,
    )
    processor = ChoiceProcessor(
        prompt.plan, state.settings.reasoning_parser, enable_thinking=prompt.thinking
    )
    created = int(time.time())
    formatter = ResponsesFormatter(
        response_template(state, body, response_id, created),
        processor,
        lambda text: len(state.tokenizer.encode_plain(text)),
    )
    if not body.store:
        return await respond(request, generation, formatter, stream=body.stream)
    run = _StoredRun(_store(state), tenant_id(request), generation, formatter, conversation, items)
    await run.start()
    if not body.stream:
        return await run.whole(request)
    try:
        response = await respond(request, generation, formatter, stream=True)
    except BaseException:
        await run.finish("failed")
        raise
    assert isinstance(response, StreamingResponse)
    response.body_iterator = run.stream(response.body_iterator)
    return response


@router.post("/v1/responses/render", responses={200: {"model": GenerateRequest}, **REQUEST_ERRORS})
async def render_response(body: ResponsesRequest, request: Request, state: StateDep) -> Response:
    """The GenerateRequest /v1/responses would run for this body."""
    chat = (await _prepare(request, state, body)).chat
    check_request(state, chat)
    prompt = await prepare_chat(request, state, chat)
    [spec] = prompt_specs(state, chat, [prompt.prompt_ids], prompt_param="input")
    rendered = generate_request(state, chat, new_item_id("resp"), spec, prompt.constraint)
    return Response(_encode(rendered), media_type="application/json")


@router.get("/v1/responses/{response_id}", responses=REQUEST_ERRORS)
async def get_response(response_id: str, request: Request, state: StateDep) -> Response:
    """A stored response, as it is now (in_progress while it runs)."""
    stored = await _get(_store(state), tenant_id(request), response_id)
    if stored is None:
        raise _not_found(response_id)
    return json_response(stored.response)


@router.get("/v1/responses/{response_id}/input_items", responses=REQUEST_ERRORS)
async def list_input_items(
    response_id: str,
    request: Request,
    state: StateDep,
    after: str | None = None,
    before: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> Response:
    """The stored response's input items, a page at a time (OpenAI's cursor list). The
    `include` values come as `include[]` (the openai SDK's form) or `include`."""
    query = request.query_params
    stored = await _get(_store(state), tenant_id(request), response_id)
    if stored is None:
        raise _not_found(response_id)
    items = page(
        stored.input_items,
        order=order,
        limit=limit,
        after=after,
        before=before,
        include=[*query.getlist("include[]"), *query.getlist("include")],
    )
    return json_response(items)


@router.delete("/v1/responses/{response_id}", responses=REQUEST_ERRORS)
async def delete_response(response_id: str, request: Request, state: StateDep) -> Response:
    """Forget a stored response."""
    try:
        deleted = await _store(state).delete(tenant_id(request), response_id)
    except StoreError as exc:
        raise _store_error(exc) from exc
    if not deleted:
        raise _not_found(response_id)
    return json_response(DeletedResponse(response_id))


@router.post("/v1/responses/{response_id}/cancel", responses=REQUEST_ERRORS)
async def cancel_response(response_id: str, request: Request, state: StateDep) -> Response:
    """Stop a running response (in whichever process runs it) and answer with it as it
    ended. One that already ended is a 400, as OpenAI answers for every response not
    created in the background (which this server has none of)."""
    store = _store(state)
    tenant = tenant_id(request)
    stored = await _get(store, tenant, response_id)
    if stored is None:
        raise _not_found(response_id)
    if stored.response.status != "in_progress":
        raise ApiError(400, "Cannot cancel a synchronous response.")
    deadline = asyncio.get_running_loop().time() + CANCEL_WAIT_S
    while stored.response.status == "in_progress":
        # Asked again each round: the runner may not have been listening yet.
        try:
            await store.cancel(tenant, response_id)
        except StoreError as exc:
            raise _store_error(exc) from exc
        if asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.05)
        stored = await _get(store, tenant, response_id) or stored
    return json_response(stored.response)
