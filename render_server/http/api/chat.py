"""POST /v1/chat/completions: render the chat, generate on the workers, answer as OpenAI."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from render_server.generation.lifecycle import ChoiceDelta, Generation
from render_server.generation.sampling_params import (
    build_choices,
    check_prompt_length,
    reject_unsupported,
    resolve_max_tokens,
)
from render_server.generation.structured import check_constraint, resolve_constraint
from render_server.http.api.deps import RenderState, StateDep
from render_server.http.errors import ApiError
from render_server.http.schemas.generation import MAX_CHAT_LOGPROBS, ChatCompletionRequest
from render_server.http.schemas.responses import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessageOut,
    ChatTokenLogprob,
    TopLogprob,
)
from render_server.http.serving import (
    GENERATION_ERRORS,
    json_response,
    new_request_id,
    sse_event,
    stream_with_errors,
    until_disconnect,
    usage_of,
    worker_error_to_api,
)
from render_server.parsing.chat_output import ChoicePiece, ChoiceProcessor
from render_server.parsing.reasoning import get_reasoning_parser
from render_server.parsing.tool_choice import plan_tools
from render_server.templating.chat_template import ChatTemplateError, RequestTemplateNotAllowed
from render_server.templating.token_text import TokenText
from render_server.worker_client.pool import WorkerError
from shared.protocol import TokenLogprobs

router = APIRouter(tags=["generation"])


def _chat_logprobs(
    token_text: TokenText, token_ids: list[int], entries: list[TokenLogprobs] | None, top: int
) -> ChatChoiceLogprobs | None:
    if entries is None:
        return None
    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        text, raw = token_text.lookup(token_id)
        alternatives = []
        for alt_id, alt_logprob in zip(entry.top_token_ids[:top], entry.top_logprobs, strict=False):
            alt_text, alt_raw = token_text.lookup(alt_id)
            alternatives.append(TopLogprob(alt_text, alt_logprob, alt_raw))
        content.append(ChatTokenLogprob(text, entry.logprob, raw, alternatives))
    return ChatChoiceLogprobs(content)


async def _render(
    state: RenderState, body: ChatCompletionRequest, tools: list[dict] | None
) -> list[int]:
    started = time.perf_counter()
    try:
        rendered = await state.renderer.render_async(
            [message.to_template_dict() for message in body.messages],
            tools=tools,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            documents=body.documents,
            chat_template_kwargs=body.chat_template_kwargs,
            chat_template=body.chat_template,
        )
    except RequestTemplateNotAllowed as exc:
        raise ApiError(400, exc.message, param="chat_template") from exc
    except ChatTemplateError as exc:
        raise ApiError(400, exc.message, param="messages", code="chat_template_error") from exc
    finally:
        state.metrics.render_seconds.observe(time.perf_counter() - started)
    return rendered.token_ids


@router.post("/v1/chat/completions", responses=GENERATION_ERRORS)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, state: StateDep
) -> Response:
    """OpenAI's chat completions, streamed (SSE) or not."""
    reject_unsupported(body)
    state.check_model(body.model)
    pool = state.require_workers()
    if body.continue_final_message and body.add_generation_prompt:
        raise ApiError(
            400,
            "continue_final_message and add_generation_prompt cannot both be true.",
            param="continue_final_message",
        )
    if body.top_logprobs is not None:
        if not 0 <= body.top_logprobs <= MAX_CHAT_LOGPROBS:
            raise ApiError(
                400, f"top_logprobs must be in [0, {MAX_CHAT_LOGPROBS}].", param="top_logprobs"
            )
        if not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true.", param="top_logprobs")
    settings = state.settings
    plan = plan_tools(
        [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None,
        body.tool_choice,
        body.parallel_tool_calls,
        enable_auto_tool_choice=settings.enable_auto_tool_choice,
        tool_call_parser=settings.tool_call_parser,
    )
    constraint = await resolve_constraint(request, state, body)
    if plan.constraint is not None:
        if constraint is not None:
            raise ApiError(
                400,
                'tool_choice "required" or a named function cannot be combined with '
                "another structured-output constraint.",
                param="tool_choice",
            )
        constraint = await check_constraint(request, state, plan.constraint, "tools")
    thinking = (body.chat_template_kwargs or {}).get("enable_thinking", True) is not False
    if (
        constraint is not None
        and settings.reasoning_parser is not None
        and thinking
        and not settings.structured_outputs_in_reasoning
    ):
        # Reasoning is free text: the constraint holds only for the answer after it.
        end_tag = get_reasoning_parser(settings.reasoning_parser).end_tag
        constraint = msgspec.structs.replace(constraint, start_after=end_tag)
    prompt_ids = await _render(state, body, plan.tools)
    max_model_len = state.max_model_len
    check_prompt_length(len(prompt_ids), max_model_len, "messages")
    if body.max_completion_tokens is not None:
        requested, param = body.max_completion_tokens, "max_completion_tokens"
    else:
        requested, param = body.max_tokens, "max_tokens"
    max_tokens = resolve_max_tokens(requested, param, len(prompt_ids), max_model_len)
    top = body.top_logprobs or 0
    choices = build_choices(
        body,
        max_tokens=max_tokens,
        logprobs=top if body.logprobs else None,
        vocab_size=state.tokenizer.vocab_size,
        max_n=state.settings.max_n,
    )
    generation = Generation(
        pool,
        state.tokenizer,
        new_request_id("chatcmpl"),
        prompt_ids,
        choices,
        priority=body.priority,
        constraint=constraint,
    )
    try:
        await generation.__aenter__()
    except WorkerError as exc:
        state.generation_metrics.record(generation)
        raise worker_error_to_api(exc) from exc
    created = int(time.time())
    processors = [
        ChoiceProcessor(plan, settings.reasoning_parser, enable_thinking=thinking) for _ in choices
    ]
    output = _Output(processors, body.include_reasoning)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        chunks = _stream(state, generation, created, top, include_usage, output)
        return StreamingResponse(
            stream_with_errors(state.generation_metrics.recorded(generation, chunks)),
            media_type="text/event-stream",
            background=BackgroundTask(generation.abort),
        )
    try:
        result = await until_disconnect(request, _collect(state, generation, created, top, output))
    except WorkerError as exc:
        raise worker_error_to_api(exc) from exc
    finally:
        await generation.abort()
        state.generation_metrics.record(generation)
    return json_response(result)


class _Output:
    """Per-choice processors and the request's reasoning preference."""

    def __init__(self, processors: list[ChoiceProcessor], include_reasoning: bool) -> None:
        self.processors = processors
        self.include_reasoning = include_reasoning

    def finish_reason(self, index: int, reason: str | None) -> str | None:
        if reason == "stop" and self.processors[index].called_tools:
            return "tool_calls"
        return reason

    def delta(self, piece: ChoicePiece) -> ChatDelta:
        reasoning = piece.reasoning if self.include_reasoning else None
        return ChatDelta(
            content=piece.content or None,
            reasoning_content=reasoning or None,
            reasoning=reasoning or None,
            tool_calls=piece.tool_calls or None,
        )


async def _collect(
    state: RenderState, generation: Generation, created: int, top: int, output: _Output
) -> ChatCompletion:
    async for _ in generation.deltas():
        pass
    choices = []
    for index, totals in enumerate(generation.totals):
        logprobs = None
        if generation.choices[index].sampling.logprobs is not None:
            logprobs = _chat_logprobs(state.token_text, totals.token_ids, totals.logprobs, top)
        result = output.processors[index].whole("".join(totals.text))
        reasoning = result.reasoning if output.include_reasoning else None
        message = ChatMessageOut(
            role="assistant",
            content=result.content,
            tool_calls=result.tool_calls,
            reasoning_content=reasoning,
            reasoning=reasoning,
        )
        choices.append(
            ChatChoice(
                index=index,
                message=message,
                logprobs=logprobs,
                finish_reason=output.finish_reason(index, totals.finish_reason),
                stop_reason=totals.stop_reason,
            )
        )
    return ChatCompletion(
        id=generation.request_id,
        created=created,
        model=state.model_id,
        choices=choices,
        usage=usage_of(generation),
    )


async def _stream(
    state: RenderState,
    generation: Generation,
    created: int,
    top: int,
    include_usage: bool,
    output: _Output,
) -> AsyncIterator[bytes]:
    request_id, model = generation.request_id, state.model_id
    wants_logprobs = generation.choices[0].sampling.logprobs is not None

    def chunk(choice: ChatChunkChoice) -> bytes:
        return sse_event(ChatCompletionChunk(request_id, created, model, [choice]))

    for index in range(len(generation.choices)):
        yield chunk(ChatChunkChoice(index, ChatDelta(role="assistant", content="")))
    delta: ChoiceDelta
    async for delta in generation.deltas():
        if not delta.text and delta.finish_reason is None and not wants_logprobs:
            continue  # held back (a partial character or a possible stop string)
        logprobs = None
        if wants_logprobs:
            logprobs = _chat_logprobs(state.token_text, delta.token_ids, delta.logprobs, top)
        processor = output.processors[delta.index]
        piece = processor.feed(delta.text)
        if delta.finish_reason is not None:
            piece = processor._merge(piece, processor.finish())
        if piece.is_empty and delta.finish_reason is None and logprobs is None:
            continue
        finish = output.finish_reason(delta.index, delta.finish_reason)
        yield chunk(
            ChatChunkChoice(delta.index, output.delta(piece), logprobs, finish, delta.stop_reason)
        )
    if include_usage:
        yield sse_event(
            ChatCompletionChunk(request_id, created, model, [], usage=usage_of(generation))
        )
