"""What every generating endpoint shares: the one path from a validated request to its
answer, driving the endpoint's `ResponseFormatter` (render_server.http.formatter).

An endpoint is a schema, a way to turn the request into prompts (a chat template, a
completion prompt, token ids), and a `ResponseFormatter`. Everything else is here:
admission (`admit`), limits and sampling (`new_generation`), and `respond`, which starts
the `Generation`, streams it as SSE or folds it into one body, maps worker errors to HTTP
ones, and closes it (abort and metrics) however the request ends.

A stream's status waits until the workers have taken the request, so a refusal (a full
queue) is a real 503, not a 200 with an error event. Once the 200 went out, every stream
ends with the API's terminator, after an error event if it could not finish.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import msgspec
from fastapi import Request
from fastapi.responses import Response

from render_server.generation.lifecycle import Generation, PromptSpec
from render_server.generation.sampling_params import (
    bad_words_token_ids,
    build_choices,
    check_priority,
    check_prompt_length,
    reject_unsupported,
    resolve_max_tokens,
    truncate_prompt,
)
from render_server.generation.structured import ConstraintValidator
from render_server.http.formatter import ResponseFormatter
from render_server.http.middleware import presented_api_key
from render_server.http.serving import (
    SseResponse,
    json_response,
    until_disconnect,
    worker_error_to_api,
)
from render_server.parsing.reasoning import get_reasoning_parser
from render_server.schemas.errors import SERVER_ERROR, ApiError
from render_server.schemas.generation import SamplingFields
from render_server.worker_client.pool import WorkerError, WorkerPool
from shared.protocol import Constraint

if TYPE_CHECKING:
    # Only a type here: the api package imports this module while it initializes.
    from render_server.http.api.deps import RenderState
    from render_server.templating.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def constraint_validator(request: Request, tokenizer: Tokenizer) -> ConstraintValidator:
    """The app's validator, made on first use and kept on `app.state`."""
    app_state = request.app.state
    validator = getattr(app_state, "constraint_validator", None)
    if validator is None or validator.tokenizer is not tokenizer:
        validator = ConstraintValidator(tokenizer)
        app_state.constraint_validator = validator
    return validator


def check_request(state: RenderState, body: SamplingFields) -> None:
    """The checks of `admit` that need no worker, so a render answers them as a generating
    request would: supported fields, the served model, a priority the workers honour."""
    reject_unsupported(body)
    state.check_model(body.model)
    card = state.workers.model_card if state.workers is not None else None
    check_priority(body.priority, card)


def admit(state: RenderState, body: SamplingFields) -> WorkerPool:
    """The checks every generating request passes before its prompt is built:
    `check_request`, then a worker to run on."""
    check_request(state, body)
    return state.require_workers()


def prompt_specs(
    state: RenderState, body: SamplingFields, prompts: list[list[int]], *, prompt_param: str
) -> list[PromptSpec]:
    """Each prompt with its choices' sampling, every limit checked: each prompt (from the
    field `prompt_param`) fits the context with room for the requested output (unset: the
    rest of that prompt's context). A render (http/api/render.py) shows exactly these."""
    max_model_len = state.max_model_len
    requested, param = body.requested_max_tokens()
    logprobs = body.num_logprobs()
    bad_words = bad_words_token_ids(state.tokenizer, body.bad_words) if body.bad_words else None
    specs = []
    for prompt_ids in prompts:
        prompt_ids = truncate_prompt(
            prompt_ids, body.truncate_prompt_tokens, max_model_len, requested
        )
        check_prompt_length(len(prompt_ids), max_model_len, prompt_param)
        choices = build_choices(
            body,
            max_tokens=resolve_max_tokens(requested, param, len(prompt_ids), max_model_len),
            logprobs=logprobs,
            vocab_size=state.tokenizer.vocab_size,
            max_n=state.settings.max_n,
            bad_words=bad_words,
        )
        specs.append(PromptSpec(prompt_ids, choices))
    return specs


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
    """A request's Generation over `prompt_specs`."""
    specs = prompt_specs(state, body, prompts, prompt_param=prompt_param)
    # A client's request_id may repeat one still running, or one whose last tokens are
    # still on their way after an abort: its worker requests get ids of their own.
    worker_request_id = f"{request_id}-{uuid.uuid4().hex[:8]}" if body.request_id else None
    return Generation(
        pool,
        state.tokenizer,
        request_id,
        specs,
        priority=body.priority,
        cache_salt=body.cache_salt,
        lora_name=state.lora_name_of(body.model),
        worker_request_id=worker_request_id,
        constraint=constraint,
        recorder=state.generation_metrics,
        timeout_s=state.settings.request_timeout_s,
        live=state.live_generations,
    )


PROMPT_TAIL_TOKENS = 32
"""How much of a prompt's end is read for a think block the template closed: the last
turn's generation prompt, never older turns."""


def hold_for_reasoning(
    state: RenderState, constraint: Constraint | None, prompt_ids: list[int]
) -> Constraint | None:
    """`constraint` as it applies under the server's reasoning parser: reasoning is free
    text, so the constraint holds only for the answer after the parser's end tag, unless
    the prompt closed the reasoning already or --structured-outputs-in-reasoning asks for
    the constraint from the first token. A render, a direct request and a generate of the
    rendered ids decide the same way (vLLM's engine decides from the prompt too)."""
    settings = state.settings
    if (
        constraint is None
        or settings.reasoning_parser is None
        or settings.structured_outputs_in_reasoning
    ):
        return constraint
    parser = get_reasoning_parser(settings.reasoning_parser)
    tail = state.tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    if parser.prompt_ends_reasoning(tail):
        return constraint
    return msgspec.structs.replace(constraint, start_after=parser.end_tag)


def stop_generations(generations: set[Generation]) -> None:
    """Stop every generation still open (a drain ran out of time): each stream ends with
    an error event and its terminator, each other request with a 503."""
    error = WorkerError("shutdown", "This server is shutting down; retry elsewhere.")
    for generation in list(generations):
        generation.stop(error)


def tenant_id(request: Request) -> str:
    """Who the request is for: a digest of its API key when keys are configured (the key
    itself never leaves this process), "" for the one tenant of a server without keys.
    Stored responses and, under per-key isolation, prefix-cache salts are per tenant."""
    state: RenderState = request.app.state.render
    if not state.settings.api_keys:
        return ""
    token = presented_api_key(request.scope["headers"]) or b""
    return hashlib.sha256(b"duet-tenant\0" + token).hexdigest()


def tenant_cache_salt(request: Request) -> str | None:
    """Under --prefix-cache-isolation per-key, the prefix-cache salt of the request's
    tenant."""
    state: RenderState = request.app.state.render
    if state.settings.prefix_cache_isolation != "per-key":
        return None
    return tenant_id(request)


def request_cache_salt(request: Request, salt: str | None) -> str | None:
    """The salt a request's prefix hashes take: the client's `cache_salt`, its tenant's,
    or under per-key isolation a digest of both, so no tenant can choose a salt that
    equals another tenant's."""
    tenant = tenant_cache_salt(request)
    if tenant is None or salt is None:
        return tenant or salt
    return hashlib.sha256(f"{tenant}:{salt}".encode()).hexdigest()


async def respond(
    request: Request, generation: Generation, formatter: ResponseFormatter, *, stream: bool
) -> Response:
    """Run `generation` and answer with what `formatter` makes of it."""
    generation.cache_salt = request_cache_salt(request, generation.cache_salt)
    try:
        await generation.start()
        if stream:
            await generation.accepted()
    except WorkerError as exc:
        await generation.aclose()
        raise worker_error_to_api(exc) from exc
    except BaseException:
        await generation.aclose()
        raise
    if stream:
        return SseResponse(
            _events(generation, formatter, request.scope.get("state", {}).get("request_id")),
            on_close=generation.aclose,
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


async def _events(
    generation: Generation, formatter: ResponseFormatter, request_id: str | None
) -> AsyncIterator[bytes]:
    """The SSE body: the formatter's events, an error event if generation fails midway,
    then the API's terminator. Closing the generation records it as the stream ends. A
    server-side failure is logged with the request id, as a 5xx status would be."""
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
        error = exc if isinstance(exc, ApiError) else worker_error_to_api(exc)
        if error.status_code >= 500:
            logger.warning(
                "request %s: stream ended with a %d error: %s",
                request_id,
                error.status_code,
                error.info.message[:300],
            )
        yield formatter.error_event(error)
    except Exception:
        # A bug must still end the stream properly: the client gets an error, not a cut.
        logger.exception("request %s: stream failed", request_id)
        yield formatter.error_event(ApiError(500, "Internal server error.", type=SERVER_ERROR))
    finally:
        await generation.aclose()
    if formatter.done_event:
        yield formatter.done_event
