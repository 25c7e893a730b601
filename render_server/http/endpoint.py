"""What every generating endpoint shares: the one path from a validated request to its
answer, driving the endpoint's `ResponseFormatter` (render_server.http.formatter).

An endpoint is a schema, a way to turn the request into prompts (a chat template, a
completion prompt, token ids), and a `ResponseFormatter`. Everything else is here:
admission (`admit`), limits and sampling (`new_generation`), and `respond`, which starts
the `Generation`, streams it as SSE or folds it into one body, maps worker errors to HTTP
ones, and closes it (abort and metrics) however the request ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from render_server.generation.lifecycle import Generation, PromptSpec
from render_server.generation.sampling_params import (
    build_choices,
    check_prompt_length,
    reject_unsupported,
    resolve_max_tokens,
)
from render_server.generation.structured import ConstraintValidator
from render_server.http.formatter import ResponseFormatter
from render_server.http.serving import json_response, until_disconnect, worker_error_to_api
from render_server.schemas.errors import ApiError
from render_server.schemas.generation import SamplingFields
from render_server.worker_client.pool import WorkerError, WorkerPool
from shared.protocol import Constraint

if TYPE_CHECKING:
    # Only a type here: the api package imports this module while it initializes.
    from render_server.http.api.deps import RenderState
    from render_server.templating.tokenizer import Tokenizer


def constraint_validator(request: Request, tokenizer: Tokenizer) -> ConstraintValidator:
    """The app's validator, made on first use and kept on `app.state`."""
    app_state = request.app.state
    validator = getattr(app_state, "constraint_validator", None)
    if validator is None or validator.tokenizer is not tokenizer:
        validator = ConstraintValidator(tokenizer)
        app_state.constraint_validator = validator
    return validator


def admit(state: RenderState, body: SamplingFields) -> WorkerPool:
    """The checks every generating request passes before its prompt is built: supported
    fields, the served model, a worker to run on."""
    reject_unsupported(body)
    state.check_model(body.model)
    return state.require_workers()


def new_generation(
    state: RenderState,
    pool: WorkerPool,
    body: SamplingFields,
    request_id: str,
    prompts: list[list[int]],
    *,
    prompt_param: str,
    constraint: Constraint | None,
) -> Generation:
    """A request's Generation, every limit checked: each prompt (from the field
    `prompt_param`) fits the context with room for the requested output (unset: the rest
    of that prompt's context)."""
    max_model_len = state.max_model_len
    requested, param = body.requested_max_tokens()
    logprobs = body.num_logprobs()
    specs = []
    for prompt_ids in prompts:
        check_prompt_length(len(prompt_ids), max_model_len, prompt_param)
        choices = build_choices(
            body,
            max_tokens=resolve_max_tokens(requested, param, len(prompt_ids), max_model_len),
            logprobs=logprobs,
            vocab_size=state.tokenizer.vocab_size,
            max_n=state.settings.max_n,
        )
        specs.append(PromptSpec(prompt_ids, choices))
    return Generation(
        pool,
        state.tokenizer,
        request_id,
        specs,
        priority=body.priority,
        constraint=constraint,
        recorder=state.generation_metrics,
    )


async def respond(
    request: Request, generation: Generation, formatter: ResponseFormatter, *, stream: bool
) -> Response:
    """Run `generation` and answer with what `formatter` makes of it."""
    try:
        await generation.start()
    except WorkerError as exc:
        raise worker_error_to_api(exc) from exc
    if stream:
        return StreamingResponse(
            _events(generation, formatter),
            media_type="text/event-stream",
            background=BackgroundTask(generation.aclose),
        )
    try:
        body = await until_disconnect(request, _whole(generation, formatter))
    except WorkerError as exc:
        raise worker_error_to_api(exc) from exc
    finally:
        await generation.aclose()
    return json_response(body)


async def _whole(generation: Generation, formatter: ResponseFormatter) -> msgspec.Struct:
    async for _ in generation.deltas():
        pass
    return formatter.body(generation)


async def _events(generation: Generation, formatter: ResponseFormatter) -> AsyncIterator[bytes]:
    """The SSE body: the formatter's events, an error event if generation fails midway,
    then the API's terminator. Closing the generation records it as the stream ends."""
    try:
        if opening := formatter.opening(generation):
            yield opening
        async for delta in generation.deltas():
            events = formatter.delta_events(generation, delta)
            if events:
                yield events
        if closing := formatter.closing(generation):
            yield closing
    except (WorkerError, ApiError) as exc:
        yield formatter.error_event(exc if isinstance(exc, ApiError) else worker_error_to_api(exc))
    finally:
        await generation.aclose()
    if formatter.done_event:
        yield formatter.done_event
