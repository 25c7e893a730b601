"""POST /v1/chat/completions/render and POST /v1/completions/render (vLLM's render API).

A render answers with what the generating endpoint would send the workers for the same
body, as vLLM's `GenerateRequest` (schemas/generate_api.py): the prompt's token ids and
the sampling parameters, `max_tokens` resolved against the context. Both come from the
code the generating endpoints run (`prepare_chat`, `prepare_completion`, `prompt_specs`),
with the same checks and the same 400s, and no worker is needed.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from render_server.generation.lifecycle import PromptSpec
from render_server.http.api.chat import chat_request_id, prepare_chat
from render_server.http.api.completions import completion_request_id, prepare_completion
from render_server.http.api.deps import RenderState, StateDep
from render_server.http.endpoint import check_request, prompt_specs
from render_server.http.serving import REQUEST_ERRORS
from render_server.schemas.generate_api import GenerateRequest
from render_server.schemas.generation import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from shared.protocol import Constraint

router = APIRouter(tags=["render"])

_encode = msgspec.json.Encoder().encode


def structured_outputs(constraint: Constraint | None) -> dict[str, Any] | None:
    """A constraint as vLLM's `structured_outputs` field, which the generate endpoint reads
    back into the same constraint."""
    if constraint is None:
        return None
    if constraint.kind == "json_schema":
        return {"json": json.loads(constraint.spec)}
    if constraint.kind == "json_object":
        return {"json_object": True}
    if constraint.kind == "choice":
        return {"choice": json.loads(constraint.spec)}
    return {constraint.kind: constraint.spec}


def _sampling_params(
    body: SamplingFields, spec: PromptSpec, constraint: Constraint | None
) -> dict[str, Any]:
    # The first choice's: the others differ only by their seed (seed + index), which the
    # generate endpoint derives again from `n` and `seed`.
    first = spec.choices[0]
    sampling = first.sampling
    return {
        "n": len(spec.choices),
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "repetition_penalty": sampling.repetition_penalty,
        "seed": sampling.seed,
        "max_tokens": sampling.max_tokens,
        "min_tokens": sampling.min_tokens,
        "stop": first.stop,
        "stop_token_ids": sampling.stop_token_ids,
        "ignore_eos": sampling.ignore_eos,
        "logprobs": sampling.logprobs,
        "prompt_logprobs": sampling.prompt_logprobs,
        "logit_bias": sampling.logit_bias,
        "allowed_token_ids": sampling.allowed_token_ids,
        # As words: the generate endpoint tokenizes them as the generating ones do.
        "bad_words": body.bad_words,
        "skip_special_tokens": first.skip_special_tokens,
        "include_stop_str_in_output": first.include_stop_str_in_output,
        "structured_outputs": structured_outputs(constraint),
    }


def generate_request(
    state: RenderState,
    body: SamplingFields,
    request_id: str,
    spec: PromptSpec,
    constraint: Constraint | None,
) -> dict[str, Any]:
    options = body.stream_options
    return {
        "request_id": request_id,
        # Already truncated (truncate_prompt_tokens) and with its special tokens.
        "token_ids": spec.prompt_token_ids,
        "sampling_params": _sampling_params(body, spec, constraint),
        # An adapter's name selects it again in /inference/v1/generate (vLLM's way).
        "model": state.served_name(body.model),
        "stream": body.stream,
        "stream_options": None if options is None else options.model_dump(exclude_unset=True),
        # The client's salt: the generate endpoint mixes in the tenant's as chat does.
        "cache_salt": body.cache_salt,
        "priority": body.priority,
        "features": None,
    }


@router.post(
    "/v1/chat/completions/render",
    responses={200: {"model": GenerateRequest}, **REQUEST_ERRORS},
)
async def render_chat(body: ChatCompletionRequest, request: Request, state: StateDep) -> Response:
    """The GenerateRequest /v1/chat/completions would run for this body."""
    check_request(state, body)
    prompt = await prepare_chat(request, state, body)
    [spec] = prompt_specs(state, body, [prompt.prompt_ids], prompt_param="messages")
    rendered = generate_request(state, body, chat_request_id(body), spec, prompt.constraint)
    return Response(_encode(rendered), media_type="application/json")


@router.post(
    "/v1/completions/render",
    responses={200: {"model": list[GenerateRequest]}, **REQUEST_ERRORS},
)
async def render_completion(body: CompletionRequest, request: Request, state: StateDep) -> Response:
    """The GenerateRequests /v1/completions would run for this body, one per prompt."""
    check_request(state, body)
    prompts, constraint = await prepare_completion(request, state, body)
    specs = prompt_specs(state, body, prompts, prompt_param="prompt")
    request_id = completion_request_id(body)
    rendered = [
        generate_request(
            state,
            body,
            request_id if len(specs) == 1 else f"{request_id}-{index}",
            spec,
            constraint,
        )
        for index, spec in enumerate(specs)
    ]
    return Response(_encode(rendered), media_type="application/json")
