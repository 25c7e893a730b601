"""POST /v1/chat/completions/derender and POST /v1/completions/derender (vLLM's derender
API): the token ids /inference/v1/generate produced, as the answer the generating
endpoint gives for them.

Nothing is copied from the generating path: the request's prompt and choices come from
the same prepare step and `prompt_specs`, a `Generation` with no workers is fed each
generated choice as a worker delta (`Choice.replay`: detokenizer, stop strings), and the
endpoint's own formatter (tool calls, reasoning, logprobs, usage) writes the body.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from render_server.generation.lifecycle import Choice, ChoiceDelta, Generation, PromptGeneration
from render_server.http.api.chat import (
    ChatPrompt,
    chat_formatter,
    chat_request_id,
    prepare_chat,
)
from render_server.http.api.completions import (
    CompletionFormatter,
    completion_request_id,
    prepare_completion,
)
from render_server.http.api.deps import RenderState, StateDep
from render_server.http.endpoint import check_request, prompt_specs
from render_server.http.formatter import OpenAIFormatter
from render_server.http.serving import REQUEST_ERRORS, json_response
from render_server.schemas.derender_api import (
    ChatDerenderRequest,
    ChoiceState,
    CompletionDerenderRequest,
    DerenderStreamResponse,
    DerenderStreamState,
    GeneratedChoice,
    GeneratedChunk,
    GeneratedResponse,
)
from render_server.schemas.errors import ApiError
from render_server.schemas.generation import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from shared.protocol import RequestDelta, TokenLogprobs

router = APIRouter(tags=["render"])


_PLAIN_CHAT = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": ""}]})
"""The chat body of a derender that names none: no stops, tools or options."""
_PLAIN_COMPLETION = CompletionRequest.model_validate({"prompt": ""})


@router.post(
    "/v1/chat/completions/derender",
    responses=REQUEST_ERRORS,
)
async def derender_chat(body: ChatDerenderRequest, request: Request, state: StateDep) -> Response:
    """The chat completion /v1/chat/completions answers for these generated tokens."""
    state.check_model(body.model)
    chat = body.chat_request or _PLAIN_CHAT
    check_request(state, chat)
    prompt = await prepare_chat(request, state, chat)
    if body.stream:
        return _stream_chat(state, body, chat, prompt)
    response = body.generate_response
    if response is None:
        raise ApiError(
            400, "generate_response: required unless stream is true.", param="generate_response"
        )
    prompt_ids = _chat_prompt_ids(body, prompt, response.prompt_token_ids)
    # Ids from the body (prompt_token_ids, or the generate response's) are the client's:
    # the detokenizer would overflow on one past the vocabulary.
    _check_vocabulary(state, prompt_ids, "prompt_token_ids")
    specs = prompt_specs(state, chat, [prompt_ids], prompt_param="messages")
    generation = Generation(None, state.tokenizer, chat_request_id(chat), specs)
    _replay(state, generation.prompts[0], response, "generate_response")
    formatter = chat_formatter(state, chat, prompt, len(generation.choices))
    return json_response(formatter.body(generation))


def _chat_prompt_ids(
    body: ChatDerenderRequest, prompt: ChatPrompt, generated: list[int] | None
) -> list[int]:
    """The prompt that was generated from: named, else the generate response's, else the
    chat request rendered again."""
    prompt_ids = body.prompt_token_ids or generated
    if prompt_ids is None:
        if body.chat_request is None:
            raise ApiError(
                400,
                "prompt_token_ids: needed when chat_request is unset.",
                param="prompt_token_ids",
            )
        prompt_ids = prompt.prompt_ids
    if body.prompt_tokens is not None and body.prompt_tokens != len(prompt_ids):
        raise ApiError(
            400,
            f"prompt_tokens: {body.prompt_tokens}, but the prompt has {len(prompt_ids)} tokens.",
            param="prompt_tokens",
        )
    return prompt_ids


def _stream_chat(
    state: RenderState, body: ChatDerenderRequest, chat: ChatCompletionRequest, prompt: ChatPrompt
) -> Response:
    """One generate chunk as the chat stream's events."""
    prompts = None if body.stream_state is not None else [_chat_prompt_ids(body, prompt, None)]
    return _stream(
        state,
        chat,
        chat_request_id(chat),
        prompts,
        body.stream_state,
        body.generate_chunk,
        0,
        "messages",
        lambda n: chat_formatter(state, chat, prompt, n),
    )


def _stream(
    state: RenderState,
    body: SamplingFields,
    request_id: str,
    prompts: list[list[int]] | None,
    stream_state: DerenderStreamState | None,
    chunk: GeneratedChunk | None,
    prompt_index: int,
    prompt_param: str,
    make_formatter: Callable[[int], OpenAIFormatter[Any, Any]],
) -> Response:
    """One generate chunk (of prompt `prompt_index`'s stream) as the generating endpoint's
    events: `stream_state` (None on the first chunk: a new one over `prompts`) is replayed
    through fresh choices and the formatter's parsers, then the chunk is fed."""
    if chunk is None:
        raise ApiError(400, "generate_chunk: required when stream is true.", param="generate_chunk")
    first = stream_state is None
    if stream_state is None:
        assert prompts is not None
        for number, ids in enumerate(prompts):
            _check_vocabulary(state, ids, f"prompt_token_ids.{number}")
        specs = prompt_specs(state, body, prompts, prompt_param=prompt_param)
        stream_state = DerenderStreamState(
            request_id=request_id,
            created=int(time.time()),
            prompt_token_ids=[spec.prompt_token_ids for spec in specs],
            choices=[ChoiceState() for spec in specs for _ in spec.choices],
        )
    else:
        for number, ids in enumerate(stream_state.prompt_token_ids):
            _check_vocabulary(state, ids, f"stream_state.prompt_token_ids.{number}")
        specs = prompt_specs(state, body, stream_state.prompt_token_ids, prompt_param=prompt_param)
    generation = Generation(None, state.tokenizer, stream_state.request_id, specs)
    if prompt_index >= len(generation.prompts):
        raise ApiError(
            400,
            f"prompt_index: {prompt_index}, but there are {len(generation.prompts)} prompts.",
            param="prompt_index",
        )
    formatter = make_formatter(len(generation.choices))
    formatter.created = stream_state.created
    prompt = generation.prompts[prompt_index]
    events = _replay_stream(state, generation, formatter, stream_state, chunk, prompt)
    if first:
        events = formatter.opening(generation) + events
    return json_response(
        DerenderStreamResponse(
            events.decode(), _next_state(stream_state, generation).model_dump(mode="json")
        )
    )


def _replay_stream(
    state: RenderState,
    generation: Generation,
    formatter: OpenAIFormatter[Any, Any],
    stream_state: DerenderStreamState,
    chunk: GeneratedChunk,
    prompt: PromptGeneration,
) -> bytes:
    """Replay `stream_state` (its events are sent already), then `chunk` of `prompt`: its
    events, and the stream's end once every choice ended."""
    _replay_state(state, generation, formatter, stream_state)
    if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
        cached = chunk.usage.prompt_tokens_details.cached_tokens
        for choice in prompt.choices:
            stream_state.choices[choice.index].cached_tokens = cached
            prompt.num_cached_tokens = max(prompt.num_cached_tokens, cached)
    if stream_state.ended:
        return b""
    events = b""
    for generated in chunk.choices:
        param = f"generate_chunk.choices.{generated.index}"
        if generated.index >= len(prompt.choices):
            raise ApiError(400, f"{param}: no such choice.", param=f"{param}.index")
        choice = prompt.choices[generated.index]
        if choice.finish_reason is not None:
            continue  # a stop string ended it here first
        sent = stream_state.choices[choice.index]
        _check_length(choice, sent.token_ids + generated.token_ids, f"{param}.token_ids")
        _check_vocabulary(state, generated.token_ids, f"{param}.token_ids")
        sent.finish_reason = generated.finish_reason
        if isinstance(generated.stop_reason, int) and generated.stop_reason >= 0:
            sent.stop_token_id = generated.stop_reason
        delta = replay_choice(choice, generated, sent.cached_tokens, state, param)
        events += formatter.delta_events(generation, delta) or b""
    if all(choice.finish_reason is not None for choice in generation.choices):
        # With usage asked for, a generate stream ends on a usage chunk (its cache hits
        # are the closing usage's): the stream ends there, as the generating one does.
        if not formatter.include_usage:
            events += formatter.done_event
            stream_state.ended = True
        elif chunk.usage is not None and not chunk.choices:
            events += formatter.closing(generation) + formatter.done_event
            stream_state.ended = True
    return events


def _replay_state(
    state: RenderState,
    generation: Generation,
    formatter: OpenAIFormatter[Any, Any],
    stream_state: DerenderStreamState,
) -> None:
    """Feed each choice what it generated before (through the formatter, whose parsers
    keep state; its events were sent then) and check the text it releases."""
    if len(stream_state.choices) != len(generation.choices):
        raise ApiError(
            400,
            f"stream_state.choices: {len(stream_state.choices)} for n={len(generation.choices)}.",
            param="stream_state.choices",
        )
    for index, (choice, sent) in enumerate(
        zip(generation.choices, stream_state.choices, strict=True)
    ):
        param = f"stream_state.choices.{index}"
        _check_length(choice, sent.token_ids, f"{param}.token_ids")
        _check_vocabulary(state, sent.token_ids, f"{param}.token_ids")
        if sent.token_ids or sent.finish_reason is not None:
            old = GeneratedChoice(
                index=index,
                token_ids=sent.token_ids,
                finish_reason=sent.finish_reason,
                stop_reason=sent.stop_token_id,
            )
            delta = replay_choice(choice, old, sent.cached_tokens, state, param)
            formatter.delta_events(generation, delta)
        if len(choice.text) != sent.text_chars:
            raise ApiError(
                400,
                f"{param}.text_chars: {sent.text_chars}, but its tokens make {len(choice.text)}.",
                param=f"{param}.text_chars",
            )


def _next_state(stream_state: DerenderStreamState, generation: Generation) -> DerenderStreamState:
    for choice, sent in zip(generation.choices, stream_state.choices, strict=True):
        sent.token_ids = list(choice.token_ids)
        sent.text_chars = len(choice.text)
    return stream_state


@router.post(
    "/v1/completions/derender",
    responses=REQUEST_ERRORS,
)
async def derender_completion(
    body: CompletionDerenderRequest, request: Request, state: StateDep
) -> Response:
    """The text completion /v1/completions answers for these generated tokens, one
    generate response per prompt."""
    state.check_model(body.model)
    completion = body.completion_request or _PLAIN_COMPLETION
    check_request(state, completion)
    if body.stream:
        prompts = body.prompt_token_ids
        if prompts is None and body.stream_state is None:
            if body.completion_request is None:
                raise ApiError(
                    400,
                    "prompt_token_ids: needed when completion_request is unset.",
                    param="prompt_token_ids",
                )
            prompts, _ = await prepare_completion(request, state, completion)
        return _stream(
            state,
            completion,
            completion_request_id(completion),
            prompts,
            body.stream_state,
            body.generate_chunk,
            body.prompt_index,
            "prompt",
            lambda _: CompletionFormatter(state, completion),
        )
    responses = body.generate_responses
    if responses is None:
        raise ApiError(
            400, "generate_responses: required unless stream is true.", param="generate_responses"
        )
    prompts = body.prompt_token_ids
    if prompts is None:
        given = [response.prompt_token_ids for response in responses]
        if all(ids is not None for ids in given):
            prompts = [ids for ids in given if ids is not None]
        elif body.completion_request is not None:
            prompts, _ = await prepare_completion(request, state, completion)
        else:
            raise ApiError(
                400,
                "prompt_token_ids: needed when completion_request is unset.",
                param="prompt_token_ids",
            )
    if len(prompts) != len(responses):
        raise ApiError(
            400,
            f"generate_responses: {len(responses)} for {len(prompts)} prompts.",
            param="generate_responses",
        )
    for number, ids in enumerate(prompts):
        _check_vocabulary(state, ids, f"prompt_token_ids.{number}")
    specs = prompt_specs(state, completion, prompts, prompt_param="prompt")
    generation = Generation(None, state.tokenizer, completion_request_id(completion), specs)
    for number, (prompt, response) in enumerate(zip(generation.prompts, responses, strict=True)):
        _replay(state, prompt, response, f"generate_responses.{number}")
    return json_response(CompletionFormatter(state, completion).body(generation))


def _replay(
    state: RenderState, prompt: PromptGeneration, response: GeneratedResponse, param: str
) -> None:
    """Feed each generated choice to its `Choice` as the one worker delta that ended it."""
    choices = prompt.choices
    indexes = sorted(choice.index for choice in response.choices)
    if indexes != list(range(len(choices))):
        raise ApiError(
            400,
            f"{param}.choices: indexes {indexes}, but the request has n={len(choices)}.",
            param=f"{param}.choices",
        )
    cached = 0
    if response.usage is not None and response.usage.prompt_tokens_details is not None:
        cached = response.usage.prompt_tokens_details.cached_tokens
    for generated in response.choices:
        at = f"{param}.choices.{generated.index}"
        _check_length(choices[generated.index], generated.token_ids, f"{at}.token_ids")
        _check_vocabulary(state, generated.token_ids, f"{at}.token_ids")
        replay_choice(choices[generated.index], generated, cached, state, at)


def replay_choice(
    choice: Choice, generated: GeneratedChoice, cached: int, state: RenderState, param: str
) -> ChoiceDelta:
    """One generated choice (or a chunk of it) fed to `choice` as a worker delta."""
    stop_token_id = generated.stop_reason if isinstance(generated.stop_reason, int) else None
    logprobs = None
    if generated.logprobs is not None:
        content = generated.logprobs.content
        if len(content) != len(generated.token_ids):
            raise ApiError(
                400,
                f"{param}.logprobs: {len(content)} entries for {len(generated.token_ids)} tokens.",
                param=f"{param}.logprobs",
            )
        logprobs = []
        for position, entry in enumerate(content):
            top_ids = [alt.token_id for alt in entry.top_logprobs]
            _check_vocabulary(state, [entry.token_id, *top_ids], f"{param}.logprobs.{position}")
            logprobs.append(
                TokenLogprobs(
                    entry.logprob,
                    entry.rank or 0,
                    top_ids,
                    [alt.logprob for alt in entry.top_logprobs],
                )
            )
    return choice.replay(
        RequestDelta(
            request_id=choice.prompt.request_id,
            new_token_ids=generated.token_ids,
            finish_reason=generated.finish_reason,
            stop_token_id=stop_token_id,
            num_prompt_tokens=len(choice.prompt.prompt_token_ids),
            num_cached_tokens=cached,
            logprobs=logprobs,
        )
    )


def _check_length(choice: Choice, token_ids: list[int], param: str) -> None:
    # More than the request's max_tokens: not what the workers generated for it.
    max_tokens = choice.spec.sampling.max_tokens
    if max_tokens is not None and len(token_ids) > max_tokens:
        raise ApiError(
            400,
            f"{param}: {len(token_ids)} tokens, more than max_tokens={max_tokens}.",
            param=param,
        )


def _check_vocabulary(state: RenderState, token_ids: list[int], param: str) -> None:
    # The schema refused negative ids; the vocabulary's size is the server's to know.
    vocab_size = state.tokenizer.vocab_size
    for position, token_id in enumerate(token_ids):
        if token_id >= vocab_size:
            raise ApiError(
                400,
                f"{param}: token id {token_id} is outside the vocabulary [0, {vocab_size}).",
                param=f"{param}.{position}",
            )
