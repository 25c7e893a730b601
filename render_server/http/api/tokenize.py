"""POST /tokenize and POST /detokenize (the shape vLLM serves).

/tokenize is the render tier's hottest endpoint, and FastAPI's request machinery (routing,
dependency solving, body parsing, response validation) costs several times what rendering a
short chat does. So `TokenizeFastPath` serves the common case — a JSON body that parses and
validates — as a bare ASGI app in front of the router; anything else (another content type,
malformed JSON, a validation error) is handed to the FastAPI route below with the body
replayed, so every error comes out exactly as FastAPI and `errors.py` make it.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Body, Response
from pydantic import TypeAdapter, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from render_server.http.admission import read_body, replay
from render_server.http.api.deps import RenderState, StateDep
from render_server.http.errors import error_response
from render_server.http.middleware import route_path
from render_server.http.serving import REQUEST_ERRORS
from render_server.schemas.errors import ApiError
from render_server.schemas.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizePromptRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from render_server.templating.chat_template import ChatTemplateError, RequestTemplateNotAllowed

router = APIRouter(tags=["tokenize"])


async def _render_chat(state: RenderState, request: TokenizeChatRequest) -> list[int]:
    started = time.perf_counter()
    try:
        rendered = await state.renderer.render_async(
            [message.to_template_dict() for message in request.messages],
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            tools=[tool.model_dump(exclude_none=True) for tool in request.tools]
            if request.tools is not None
            else None,
            chat_template_kwargs=request.chat_template_kwargs,
            chat_template=request.chat_template,
            # The same template a chat completion with these tools would render with.
            with_tools_template=state.tool_setup().uses_builtin_template,
        )
    except RequestTemplateNotAllowed as exc:
        raise ApiError(400, exc.message, param="chat_template") from exc
    except ChatTemplateError as exc:
        raise ApiError(400, exc.message, code="chat_template_error") from exc
    finally:
        state.metrics.render_seconds.observe(time.perf_counter() - started)
    token_ids = rendered.token_ids
    tokenizer = state.tokenizer
    if (
        request.add_special_tokens
        and tokenizer.add_bos_token
        and tokenizer.bos_token_id is not None
        and token_ids[:1] != [tokenizer.bos_token_id]
    ):
        # The template's text is already tokenized (with content escaping); adding the
        # special tokens means the BOS the tokenizer would put in front, if any.
        token_ids = [tokenizer.bos_token_id, *token_ids]
    return token_ids


async def _token_ids(state: RenderState, request: TokenizeRequest) -> list[int]:
    """What both /tokenize paths answer: the ids of the prompt or of the rendered chat."""
    state.check_model(request.model)
    tokenizer = state.tokenizer
    if isinstance(request, TokenizePromptRequest):
        token_ids = await tokenizer.encode_async(request.prompt, request.add_special_tokens)
    else:
        token_ids = await _render_chat(state, request)
    state.metrics.tokens_tokenized.inc(len(token_ids))
    return token_ids


async def _answer(state: RenderState, request: TokenizeRequest) -> bytes:
    """The body both /tokenize paths answer with, encoded by msgspec: a long prompt has a
    million ids, which msgspec writes in milliseconds where FastAPI's response validation
    and encoder would hold the event loop for half a second."""
    token_ids = await _token_ids(state, request)
    tokenizer = state.tokenizer
    token_strs = await tokenizer.token_strs_async(token_ids) if request.return_token_strs else None
    return msgspec.json.encode(
        {
            "count": len(token_ids),
            "max_model_len": tokenizer.max_model_len,
            "tokens": token_ids,
            "token_strs": token_strs,
        }
    )


@router.post("/tokenize", responses=REQUEST_ERRORS, response_model=TokenizeResponse)
async def tokenize(request: Annotated[TokenizeRequest, Body()], state: StateDep) -> Response:
    """Token ids of a prompt, or of messages rendered through the chat template."""
    return Response(await _answer(state, request), media_type="application/json")


# Content types the fast path reads as JSON; FastAPI reads these as JSON too, and any other
# spelling (or none) goes to the route, which knows every rule.
_JSON_CONTENT_TYPES = frozenset(
    {b"application/json", b"application/json; charset=utf-8", b"application/json;charset=utf-8"}
)
# How FastAPI validates the body: the same annotated type, from_attributes as FastAPI does.
_TOKENIZE_REQUEST: TypeAdapter[TokenizeRequest] = TypeAdapter(TokenizeRequest)
_RESPONSE_HEADERS = (b"content-type", b"application/json")


class TokenizeFastPath:
    """Serves `POST /tokenize` without FastAPI's per-request machinery; added as the
    innermost middleware, so request ids, metrics, CORS, limits and API keys all apply.

    The body is parsed with `json.loads` and validated with pydantic exactly as FastAPI does;
    a request that would fail either is passed, body replayed, to the FastAPI route."""

    path = "/tokenize"
    """The route label metrics see (RequestContextMiddleware reads `scope["route"].path`)."""

    def __init__(self, app: ASGIApp, state: RenderState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or route_path(scope) != self.path
            or _content_type(scope["headers"]) not in _JSON_CONTENT_TYPES
        ):
            await self.app(scope, receive, send)
            return
        scope["route"] = self  # the router sets its own route if the request falls through
        body = await read_body(receive)
        if body is None:  # the client went away mid-body: nobody to answer
            return
        request = _parse(body)
        if request is None:
            await self.app(scope, replay(body, receive), send)
            return
        try:
            payload = await _answer(self.state, request)
        except ApiError as exc:
            await error_response(exc.status_code, exc.info, exc.headers)(scope, receive, send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [_RESPONSE_HEADERS, (b"content-length", b"%d" % len(payload))],
            }
        )
        await send({"type": "http.response.body", "body": payload})


def _content_type(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name == b"content-type":
            return value.lower()
    return None


def _parse(body: bytes) -> TokenizeRequest | None:
    """The validated request, or None where FastAPI would answer with an error."""
    try:
        data: Any = json.loads(body)
    except (ValueError, RecursionError):  # bad JSON, bad UTF-8, or nested too deep
        return None
    if type(data) is not dict:
        return None
    try:
        return _TOKENIZE_REQUEST.validate_python(data, from_attributes=True)
    except ValidationError:
        return None


@router.post("/detokenize", responses=REQUEST_ERRORS)
async def detokenize(request: DetokenizeRequest, state: StateDep) -> DetokenizeResponse:
    """Text of a list of token ids; special tokens are kept so /tokenize output round-trips."""
    state.check_model(request.model)
    tokenizer = state.tokenizer
    vocab_size = tokenizer.vocab_size
    tokens = request.tokens
    # min and max scan a million ids in C; the loop that names the bad one runs only if needed.
    if tokens and not (min(tokens) >= 0 and max(tokens) < vocab_size):
        index, token_id = next((i, t) for i, t in enumerate(tokens) if not 0 <= t < vocab_size)
        raise ApiError(
            400,
            f"tokens.{index}: token id {token_id} is outside the vocabulary [0, {vocab_size}).",
            param="tokens",
        )
    text = await tokenizer.decode_async(tokens, skip_special_tokens=False)
    return DetokenizeResponse(prompt=text)
