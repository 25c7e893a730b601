"""The OpenAI Responses API: POST /v1/responses (and its render), GET, DELETE and cancel.

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
from typing import Any

import anyio
import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from render_server.generation.lifecycle import Generation
from render_server.http.api.chat import prepare_chat
from render_server.http.api.deps import RenderState, StateDep
from render_server.http.api.render import generate_request
from render_server.http.api.responses_stream import ResponsesFormatter, new_item_id
from render_server.http.endpoint import (
    admit,
    check_request,
    new_generation,
    prompt_specs,
    respond,
    tenant_id,
)
from render_server.http.errors import validation_error_info
from render_server.http.serving import GENERATION_ERRORS, REQUEST_ERRORS, json_response
from render_server.parsing.chat_output import ChoiceProcessor
from render_server.schemas.errors import SERVER_ERROR, ApiError, quoted
from render_server.schemas.generate_api import GenerateRequest
from render_server.schemas.generation import ChatCompletionRequest, SamplingFields
from render_server.schemas.responses_api import (
    DeletedResponse,
    FunctionCallItem,
    FunctionCallOut,
    FunctionCallOutputItem,
    ItemContent,
    MessageItem,
    OutputMessage,
    ReasoningOut,
    ResponseObject,
    ResponsesRequest,
    ResponseStatus,
    StoredResponse,
)
from render_server.store import RecordTooLarge, ResponseStore, StoreError

logger = logging.getLogger(__name__)
router = APIRouter(tags=["responses"])

_encode = msgspec.json.Encoder().encode
_decode_record = msgspec.json.Decoder(StoredResponse).decode

# The sampling fields a Responses body hands to chat as they are; the rest are this
# API's own (text.format, max_output_tokens) or not chat's (stream_options).
_FORWARDED = frozenset(SamplingFields.model_fields) - {
    "stream",
    "stream_options",
    "response_format",
    "n",
    "best_of",
}
_HARMLESS_INCLUDES = frozenset(
    {
        # About hosted tools, which are refused anyway: nothing to include.
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
    }
)
CANCEL_WAIT_S = 5.0
"""How long a cancel waits for the running response to record its end."""


class _ResponsesChat(ChatCompletionRequest):
    """The chat body a Responses body becomes: limits name the Responses field."""

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_output_tokens"
        return self.max_tokens, "max_tokens"


# ---- translation ----------------------------------------------------------------------


def _refuse_unsupported(body: ResponsesRequest) -> None:
    if body.background:
        raise ApiError(400, "background responses are not supported.", param="background")
    if body.truncation == "auto":
        raise ApiError(
            400, 'truncation "auto" is not supported; use "disabled".', param="truncation"
        )
    if body.n != 1:
        raise ApiError(400, "a response has one output: n must be 1.", param="n")
    for name in ("conversation", "prompt"):
        if getattr(body, name) is not None:
            raise ApiError(400, f"{name} is not supported by this server.", param=name)
    if body.top_logprobs:
        raise ApiError(400, "logprobs are not supported by /v1/responses.", param="top_logprobs")
    if body.reasoning is not None and body.reasoning.effort is not None:
        raise ApiError(
            400, "reasoning.effort is not supported by this model.", param="reasoning.effort"
        )
    for index, include in enumerate(body.include or []):
        if include not in _HARMLESS_INCLUDES:
            raise ApiError(
                400,
                f"include value {quoted(include)!r} is not supported.",
                param=f"include.{index}",
            )


def _text(content: ItemContent) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return content
    if len(content) == 1:
        return content[0].as_text
    return [{"type": "text", "text": part.as_text} for part in content]


def _plain_text(content: ItemContent) -> str:
    return content if isinstance(content, str) else "".join(p.as_text for p in content)


def _known_calls(messages: list[dict[str, Any]]) -> set[str]:
    return {
        call["id"]
        for message in messages
        for call in message.get("tool_calls") or ()
        if isinstance(call, dict) and "id" in call
    }


def _input_messages(body: ResponsesRequest, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as chat messages (instructions not included: they hold for this
    response only, and are not carried over to the next)."""
    if body.input is None:
        return []
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    calls = _known_calls(history)
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None
    for index, item in enumerate(body.input):
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            message: dict[str, Any] = {"role": role, "content": _text(item.content)}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"] = reasoning
                reasoning = None
            messages.append(message)
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            calls.add(item.call_id)
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                if reasoning is not None:
                    last["reasoning_content"] = reasoning
                    reasoning = None
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise ApiError(
                    400,
                    f"No function call with call_id {quoted(item.call_id)!r} precedes this "
                    "function_call_output.",
                    param=f"input.{index}.call_id",
                )
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": _plain_text(item.output)}
            )
        else:
            reasoning = "".join(part.text for part in item.summary)
    return messages


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if isinstance(name, str) and name:
            return {"type": "function", "function": {"name": name}}
    raise ApiError(
        400,
        'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}.',
        param="tool_choice",
    )


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    form = body.text.format if body.text is not None else None
    if form is None or form.type == "text":
        return None
    if form.type == "json_object":
        return {"type": "json_object"}
    if form.schema_ is None:
        raise ApiError(400, "a json_schema format needs a schema.", param="text.format.schema")
    schema = {"name": form.name or "response", "schema": form.schema_, "strict": form.strict}
    if form.description is not None:
        schema["description"] = form.description
    return {"type": "json_schema", "json_schema": schema}


def chat_body(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat body that runs for a Responses body whose conversation is `messages`."""
    if not messages:
        raise ApiError(400, "input is required (or a previous_response_id).", param="input")
    if body.instructions is not None:
        messages = [{"role": "system", "content": body.instructions}, *messages]
    forwarded = body.model_dump(include=set(_FORWARDED & body.model_fields_set), by_alias=True)
    chat = {
        **forwarded,
        "messages": messages,
        "stream": body.stream,
        "max_completion_tokens": body.max_output_tokens,
        "tools": [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in body.tools
        ]
        if body.tools
        else None,
        "tool_choice": _tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body),
    }
    try:
        return _ResponsesChat.model_validate(chat)
    except ValidationError as exc:
        info = validation_error_info(exc.errors(), "application/json")
        raise ApiError(400, info.message, param=info.param) from exc


def _template(
    state: RenderState, body: ResponsesRequest, response_id: str, created: int
) -> ResponseObject:
    text_format = body.text.format if body.text is not None else None
    reasoning = body.reasoning
    return ResponseObject(
        id=response_id,
        created_at=created,
        status="in_progress",
        model=state.model_id,
        instructions=body.instructions,
        tools=[tool.model_dump() for tool in body.tools or ()],
        tool_choice=body.tool_choice or "auto",
        parallel_tool_calls=body.parallel_tool_calls is not False,
        temperature=body.temperature,
        top_p=body.top_p,
        max_output_tokens=body.max_output_tokens,
        previous_response_id=body.previous_response_id,
        text={
            "format": text_format.model_dump(by_alias=True, exclude_none=True)
            if text_format is not None
            else {"type": "text"}
        },
        reasoning=None if reasoning is None else {"effort": None, "summary": reasoning.summary},
        metadata=body.metadata or {},
        store=body.store,
        user=body.user,
    )


def _output_messages(response: ResponseObject) -> list[dict[str, Any]]:
    """A response's output as the assistant message the next turn's template sees."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    texts: list[str] = []
    for item in response.output:
        if isinstance(item, ReasoningOut):
            message["reasoning_content"] = "".join(part.text for part in item.summary)
        elif isinstance(item, OutputMessage):
            texts += [part.text for part in item.content]
        elif isinstance(item, FunctionCallOut):
            call = {"name": item.name, "arguments": item.arguments}
            message.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": call}
            )
    if texts or "tool_calls" not in message:
        message["content"] = "".join(texts)
    return [message]


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


async def _history(
    state: RenderState, request: Request, body: ResponsesRequest
) -> list[dict[str, Any]]:
    if body.previous_response_id is None:
        return []
    previous = await _get(_store(state), tenant_id(request), body.previous_response_id)
    if previous is None:
        raise _not_found(body.previous_response_id, "previous_response_id")
    if previous.response.status == "in_progress":
        raise ApiError(
            400, "The previous response is still in progress.", param="previous_response_id"
        )
    return previous.history


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
    ) -> None:
        self.store = store
        self.tenant = tenant
        self.generation = generation
        self.formatter = formatter
        self.history = history

    async def start(self) -> None:
        await _put(self.store, self.tenant, StoredResponse(self.formatter.template, self.history))

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
        stored = StoredResponse(response, self.history + _output_messages(response))
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


async def _prepare(
    request: Request, state: RenderState, body: ResponsesRequest
) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat body to run, and the conversation a stored response keeps (without the
    output yet)."""
    _refuse_unsupported(body)
    history = await _history(state, request, body)
    conversation = history + _input_messages(body, history)
    return chat_body(body, conversation), conversation


@router.post("/v1/responses", responses=GENERATION_ERRORS)
async def create_response(body: ResponsesRequest, request: Request, state: StateDep) -> Response:
    """OpenAI's Responses API, streamed (named SSE events) or not; stored unless
    `store` is false."""
    chat, conversation = await _prepare(request, state, body)
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
        _template(state, body, response_id, created),
        processor,
        lambda text: len(state.tokenizer.encode_plain(text)),
    )
    if not body.store:
        return await respond(request, generation, formatter, stream=body.stream)
    run = _StoredRun(_store(state), tenant_id(request), generation, formatter, conversation)
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
    chat, _ = await _prepare(request, state, body)
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
    ended; a response that already ended is answered as it is."""
    store = _store(state)
    tenant = tenant_id(request)
    stored = await _get(store, tenant, response_id)
    if stored is None:
        raise _not_found(response_id)
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
