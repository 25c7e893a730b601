"""POST /tokenize and POST /detokenize (the shape vLLM serves)."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Body
from starlette.concurrency import run_in_threadpool

from render_server.api.deps import RenderState, StateDep
from render_server.chat_template import ChatTemplateError, RequestTemplateNotAllowed
from render_server.errors import ApiError
from render_server.schemas.errors import ErrorResponse
from render_server.schemas.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizePromptRequest,
    TokenizeRequest,
    TokenizeResponse,
)

router = APIRouter(tags=["tokenize"])

# Encoding a short text takes microseconds, less than a thread hop; long ones (up to the
# body limit, megabytes) would stall the event loop for everyone, so they go to a thread.
_INLINE_MAX_CHARS = 16_384
_INLINE_MAX_IDS = 4_096

_ERRORS = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
}


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


@router.post("/tokenize", responses=_ERRORS)
async def tokenize(
    request: Annotated[TokenizeRequest, Body()], state: StateDep
) -> TokenizeResponse:
    """Token ids of a prompt, or of messages rendered through the chat template."""
    state.check_model(request.model)
    tokenizer = state.tokenizer
    if isinstance(request, TokenizePromptRequest):
        if len(request.prompt) <= _INLINE_MAX_CHARS:
            token_ids = tokenizer.encode(request.prompt, request.add_special_tokens)
        else:
            token_ids = await run_in_threadpool(
                tokenizer.encode, request.prompt, request.add_special_tokens
            )
    else:
        token_ids = await _render_chat(state, request)
    state.metrics.tokens_tokenized.inc(len(token_ids))
    return TokenizeResponse(
        count=len(token_ids),
        max_model_len=tokenizer.max_model_len,
        tokens=token_ids,
        token_strs=tokenizer.token_strs(token_ids) if request.return_token_strs else None,
    )


@router.post("/detokenize", responses=_ERRORS)
async def detokenize(request: DetokenizeRequest, state: StateDep) -> DetokenizeResponse:
    """Text of a list of token ids; special tokens are kept so /tokenize output round-trips."""
    state.check_model(request.model)
    tokenizer = state.tokenizer
    vocab_size = tokenizer.vocab_size
    for index, token_id in enumerate(request.tokens):
        if not 0 <= token_id < vocab_size:
            raise ApiError(
                400,
                f"tokens.{index}: token id {token_id} is outside the vocabulary [0, {vocab_size}).",
                param="tokens",
            )
    if len(request.tokens) <= _INLINE_MAX_IDS:
        text = tokenizer.decode(request.tokens, skip_special_tokens=False)
    else:
        text = await run_in_threadpool(tokenizer.decode, request.tokens, False)
    return DetokenizeResponse(prompt=text)
