"""vLLM's token-in/token-out API: POST /inference/v1/generate runs a `GenerateRequest`
(token ids and vLLM's sampling parameters) on the workers exactly as a rendered chat
runs; POST /inference/v1/abort_requests stops requests by the client's request_id.

Everything but the shapes is the shared path (http/endpoint.py): admission, limits,
routing, failover, structured outputs, n, logprobs. Stop strings apply, as in vLLM's
generate: each choice is detokenized anyway, and a match ends it with finish_reason
"stop" and the string as stop_reason.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from render_server.generation.lifecycle import Choice, ChoiceDelta, Generation
from render_server.generation.structured import resolve_constraint
from render_server.http.api.deps import RenderState, StateDep
from render_server.http.endpoint import (
    admit,
    constraint_validator,
    hold_for_reasoning,
    new_generation,
    respond,
)
from render_server.http.formatter import MIN_LOGPROB, OpenAIFormatter
from render_server.http.serving import GENERATION_ERRORS
from render_server.schemas.errors import ApiError
from render_server.schemas.generate_api import (
    GENERATE_SAMPLING_FIELDS,
    AbortRequests,
    GenerateChoice,
    GenerateChunk,
    GenerateLogprobs,
    GenerateRequest,
    GenerateResponse,
    GenerateTokenLogprob,
    GenerateTopLogprob,
)
from render_server.schemas.generation import SamplingFields
from render_server.schemas.responses import Usage
from shared.protocol import TokenLogprobs

router = APIRouter(tags=["generation"])


@router.post("/inference/v1/generate", responses=GENERATION_ERRORS)
async def generate(body: GenerateRequest, request: Request, state: StateDep) -> Response:
    """Token ids in, token ids out; streamed (SSE) or not."""
    fields = body.sampling_fields()
    try:
        pool = admit(state, fields)
        _check_vocabulary(body.token_ids, state.tokenizer.vocab_size)
        constraint = await resolve_constraint(
            constraint_validator(request, state.tokenizer), fields
        )
        constraint = hold_for_reasoning(state, constraint, body.token_ids)
        generation = new_generation(
            state,
            pool,
            fields,
            body.request_id or uuid.uuid4().hex,
            [body.token_ids],
            prompt_param="token_ids",
            constraint=constraint,
        )
    except ApiError as exc:
        raise _in_sampling_params(exc) from None
    _register(state, generation)
    return await respond(request, generation, GenerateFormatter(state, fields), stream=body.stream)


@router.post("/inference/v1/abort_requests")
@router.post("/abort_requests")
async def abort_requests(body: AbortRequests, state: StateDep) -> Response:
    """Stop the named requests on the workers (their KV is freed at once); each ends with
    finish_reason "abort". Ids of no live request are no error: it may have just ended."""
    for request_id in body.request_ids:
        for generation in list(state.generate_requests.get(request_id, ())):
            await generation.abort()
    return Response(status_code=200)


def _register(state: RenderState, generation: Generation) -> None:
    """Keep `generation` findable by its client id until it closes (ids may repeat)."""
    live = state.generate_requests
    live.setdefault(generation.request_id, set()).add(generation)

    def forget(closed: Generation) -> None:
        same_id = live.get(closed.request_id)
        if same_id is not None:
            same_id.discard(closed)
            if not same_id:
                del live[closed.request_id]

    generation.close_callbacks.append(forget)


def _check_vocabulary(token_ids: list[int], vocab_size: int) -> None:
    # The schema refused negative ids; the vocabulary's size is the server's to know.
    if max(token_ids) >= vocab_size:
        position = next(i for i, token_id in enumerate(token_ids) if token_id >= vocab_size)
        raise ApiError(
            400,
            f"token_ids: token id {token_ids[position]} is outside the vocabulary "
            f"[0, {vocab_size}).",
            param=f"token_ids.{position}",
        )


def _in_sampling_params(error: ApiError) -> ApiError:
    """The shared checks name a sampling field as chat spells it (`max_tokens`); here it
    lives under `sampling_params`."""
    param = error.info.param
    if param is not None and param.split(".", 1)[0] in GENERATE_SAMPLING_FIELDS:
        error.info.param = f"sampling_params.{param}"
    return error


class GenerateFormatter(OpenAIFormatter[GenerateChoice, GenerateChoice]):
    """vLLM's generate shapes: a choice's token ids and their logprobs by token id, one
    event per worker delta, `[DONE]` last; the usage chunk as OpenAI's APIs send it."""

    def __init__(self, state: RenderState, body: SamplingFields) -> None:
        super().__init__(state, body)
        self.num_logprobs = body.num_logprobs()
        self.wants_prompt_logprobs = body.prompt_logprobs is not None

    def chunk(
        self, generation: Generation, choices: list[GenerateChoice], usage: Usage | None = None
    ) -> GenerateChunk:
        return GenerateChunk(generation.request_id, choices, usage)

    def whole(
        self, generation: Generation, choices: list[GenerateChoice], usage: Usage
    ) -> GenerateResponse:
        response = GenerateResponse(generation.request_id, self.model, self.created, choices, usage)
        if self.wants_prompt_logprobs:
            prompt = generation.prompts[0]
            response.prompt_token_ids = prompt.prompt_token_ids
            response.prompt_logprobs = self.prompt_logprobs(prompt)
        return response

    def whole_choice(self, choice: Choice) -> GenerateChoice:
        return GenerateChoice(
            choice.index,
            choice.token_ids,
            choice.finish_reason,
            choice.stop_reason,
            self._logprobs(choice.token_ids, choice.logprobs),
        )

    def delta_events(self, generation: Generation, delta: ChoiceDelta) -> bytes | None:
        if not delta.token_ids and delta.finish_reason is None:
            return None
        return self.event(
            generation,
            GenerateChoice(
                delta.index,
                delta.token_ids,
                delta.finish_reason,
                delta.stop_reason,
                self._logprobs(delta.token_ids, delta.logprobs),
            ),
        )

    def _logprobs(
        self, token_ids: list[int], entries: list[TokenLogprobs] | None
    ) -> GenerateLogprobs | None:
        top = self.num_logprobs
        if top is None:
            return None
        content = [
            GenerateTokenLogprob(
                token_id,
                max(entry.logprob, MIN_LOGPROB),
                entry.rank,
                [
                    GenerateTopLogprob(alt_id, max(alt_logprob, MIN_LOGPROB), rank)
                    for rank, (alt_id, alt_logprob) in enumerate(
                        zip(entry.top_token_ids[:top], entry.top_logprobs, strict=False), start=1
                    )
                ],
            )
            for token_id, entry in zip(token_ids, entries or [], strict=False)
        ]
        return GenerateLogprobs(content)
