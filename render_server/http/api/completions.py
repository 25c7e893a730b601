"""POST /v1/completions: the legacy text completions API (prompt in, text out)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from render_server.generation.lifecycle import ChoiceDelta, Generation
from render_server.generation.sampling_params import (
    build_choices,
    check_prompt_length,
    reject_unsupported,
    resolve_max_tokens,
)
from render_server.generation.structured import resolve_constraint
from render_server.http.api.deps import RenderState, StateDep
from render_server.http.errors import ApiError
from render_server.http.schemas.generation import MAX_COMPLETION_LOGPROBS, CompletionRequest
from render_server.http.schemas.responses import (
    CompletionChoice,
    CompletionLogprobs,
    TextCompletion,
    Usage,
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
from render_server.templating.token_text import TokenText
from render_server.worker_client.pool import WorkerError
from shared.protocol import TokenLogprobs

router = APIRouter(tags=["generation"])
MAX_PROMPTS = 64


async def _prompts(state: RenderState, body: CompletionRequest) -> list[list[int]]:
    """Every prompt form as token ids: a string, strings, ids, or lists of ids."""
    prompt = body.prompt
    tokenizer = state.tokenizer
    if isinstance(prompt, str):
        texts: list[str] = [prompt]
    elif not prompt:
        raise ApiError(400, "prompt: must not be empty.", param="prompt")
    elif isinstance(prompt[0], str):
        texts = list(prompt)  # type: ignore[arg-type]
    else:
        texts = []
    if texts:
        if len(texts) > MAX_PROMPTS:
            raise ApiError(400, f"prompt: at most {MAX_PROMPTS} prompts.", param="prompt")
        encode = tokenizer.encode_batch
        if sum(len(t) for t in texts) > 16_384:
            return await run_in_threadpool(encode, texts, body.add_special_tokens)
        return encode(texts, body.add_special_tokens)
    id_lists = [prompt] if isinstance(prompt[0], int) else prompt
    if len(id_lists) > MAX_PROMPTS:
        raise ApiError(400, f"prompt: at most {MAX_PROMPTS} prompts.", param="prompt")
    vocab_size = tokenizer.vocab_size
    for ids in id_lists:
        for token_id in ids:  # type: ignore[union-attr]
            if not 0 <= token_id < vocab_size:
                raise ApiError(
                    400,
                    f"prompt: token id {token_id} is outside the vocabulary [0, {vocab_size}).",
                    param="prompt",
                )
    return [list(ids) for ids in id_lists]  # type: ignore[arg-type]


def _logprobs(
    token_text: TokenText,
    token_ids: list[int],
    entries: list[TokenLogprobs] | None,
    top: int,
    offset: int,
    prompt_ids: list[int] | None = None,
) -> CompletionLogprobs:
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for token_id in prompt_ids or []:  # echoed prompt tokens carry no logprobs
        text, _ = token_text.lookup(token_id)
        tokens.append(text)
        token_logprobs.append(None)
        top_logprobs.append(None)
        text_offset.append(offset)
        offset += len(text)
    for token_id, entry in zip(token_ids, entries or [], strict=False):
        text, _ = token_text.lookup(token_id)
        tokens.append(text)
        token_logprobs.append(entry.logprob)
        top_logprobs.append(
            {
                token_text.lookup(alt)[0]: lp
                for alt, lp in zip(entry.top_token_ids[:top], entry.top_logprobs, strict=False)
            }
        )
        text_offset.append(offset)
        offset += len(text)
    return CompletionLogprobs(tokens, token_logprobs, top_logprobs, text_offset)


@router.post("/v1/completions", responses=GENERATION_ERRORS)
async def completions(body: CompletionRequest, request: Request, state: StateDep) -> Response:
    """OpenAI's text completions, streamed (SSE) or not; several prompts allowed."""
    reject_unsupported(body)
    state.check_model(body.model)
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(400, "best_of other than n is not supported.", param="best_of")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise ApiError(
            400, f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}].", param="logprobs"
        )
    pool = state.require_workers()
    constraint = await resolve_constraint(request, state, body)
    prompts = await _prompts(state, body)
    max_model_len = state.max_model_len
    generations = []
    for index, prompt_ids in enumerate(prompts):
        check_prompt_length(len(prompt_ids), max_model_len, "prompt")
        max_tokens = resolve_max_tokens(
            body.max_tokens, "max_tokens", len(prompt_ids), max_model_len
        )
        choices = build_choices(
            body,
            max_tokens=max_tokens,
            logprobs=body.logprobs,
            vocab_size=state.tokenizer.vocab_size,
            max_n=state.settings.max_n,
        )
        generations.append(
            Generation(
                pool,
                state.tokenizer,
                f"{new_request_id('cmpl')}-{index}",
                prompt_ids,
                choices,
                priority=body.priority,
                constraint=constraint,
            )
        )
    try:
        for generation in generations:
            await generation.__aenter__()
    except WorkerError as exc:
        for generation in generations:
            await generation.abort()
            state.generation_metrics.record(generation)
        raise worker_error_to_api(exc) from exc
    response_id = generations[0].request_id.rsplit("-", 1)[0]
    created = int(time.time())
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        chunks = _stream(state, body, generations, response_id, created, include_usage)
        return StreamingResponse(
            stream_with_errors(chunks),
            media_type="text/event-stream",
            background=BackgroundTask(_abort_all, generations),
        )
    try:
        result = await until_disconnect(
            request, _collect(state, body, generations, response_id, created)
        )
    except WorkerError as exc:
        raise worker_error_to_api(exc) from exc
    finally:
        await _abort_all(generations)
        for generation in generations:
            state.generation_metrics.record(generation)
    return json_response(result)


async def _abort_all(generations: list[Generation]) -> None:
    for generation in generations:
        await generation.abort()


def _total_usage(generations: list[Generation]) -> Usage:
    usages = [usage_of(g) for g in generations]
    total = usages[0]
    for usage in usages[1:]:
        total.prompt_tokens += usage.prompt_tokens
        total.completion_tokens += usage.completion_tokens
        total.total_tokens += usage.total_tokens
        if total.prompt_tokens_details and usage.prompt_tokens_details:
            total.prompt_tokens_details.cached_tokens += usage.prompt_tokens_details.cached_tokens
    return total


async def _collect(
    state: RenderState,
    body: CompletionRequest,
    generations: list[Generation],
    response_id: str,
    created: int,
) -> TextCompletion:
    async def drain(generation: Generation) -> None:
        async for _ in generation.deltas():
            pass

    await asyncio.gather(*(drain(g) for g in generations))
    choices = []
    n = body.n
    for prompt_index, generation in enumerate(generations):
        prompt_text = ""
        if body.echo:
            prompt_text = state.tokenizer.decode(
                generation.prompt_token_ids, skip_special_tokens=False
            )
        for choice_index, totals in enumerate(generation.totals):
            logprobs = None
            if body.logprobs is not None:
                logprobs = _logprobs(
                    state.token_text,
                    totals.token_ids,
                    totals.logprobs,
                    body.logprobs,
                    0,
                    generation.prompt_token_ids if body.echo else None,
                )
            choices.append(
                CompletionChoice(
                    index=prompt_index * n + choice_index,
                    text=prompt_text + "".join(totals.text),
                    logprobs=logprobs,
                    finish_reason=totals.finish_reason,
                    stop_reason=totals.stop_reason,
                )
            )
    return TextCompletion(
        id=response_id,
        created=created,
        model=state.model_id,
        choices=choices,
        usage=_total_usage(generations),
    )


async def _stream(
    state: RenderState,
    body: CompletionRequest,
    generations: list[Generation],
    response_id: str,
    created: int,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    model, n = state.model_id, body.n
    queue: asyncio.Queue[tuple[int, ChoiceDelta] | BaseException | None] = asyncio.Queue()
    offsets: dict[int, int] = {}
    echoed: set[int] = set()

    async def pump(prompt_index: int, generation: Generation) -> None:
        try:
            async for delta in state.generation_metrics.recorded_deltas(generation):
                queue.put_nowait((prompt_index, delta))
        except BaseException as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            prompt_index, delta = item
            generation = generations[prompt_index]
            index = prompt_index * n + delta.index
            text = delta.text
            echo_ids = None
            if body.echo and index not in echoed:
                echoed.add(index)
                echo_ids = generation.prompt_token_ids
                text = state.tokenizer.decode(echo_ids, skip_special_tokens=False) + text
            if not text and delta.finish_reason is None and body.logprobs is None:
                continue
            logprobs = None
            if body.logprobs is not None:
                logprobs = _logprobs(
                    state.token_text,
                    delta.token_ids,
                    delta.logprobs,
                    body.logprobs,
                    offsets.get(index, 0),
                    echo_ids,
                )
                offsets[index] = offsets.get(index, 0) + len(text)
            choice = CompletionChoice(index, text, logprobs, delta.finish_reason, delta.stop_reason)
            yield sse_event(TextCompletion(response_id, created, model, [choice]))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if include_usage:
        usage = _total_usage(generations)
        yield sse_event(TextCompletion(response_id, created, model, [], usage=usage))
