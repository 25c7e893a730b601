"""vLLM's derender API: the token ids a /inference/v1/generate call produced, turned back
into the OpenAI answer the generating endpoint would have given for them.

The generated output is read in /inference/v1/generate's own shapes (schemas/generate_api.py),
bounded as every body is; token ids are checked against the vocabulary by the route, which
knows it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from render_server.schemas.body import JsonBody
from render_server.schemas.generation import (
    MAX_COMPLETION_LOGPROBS,
    ChatCompletionRequest,
    CompletionRequest,
)
from render_server.schemas.vllm_fields import RequestIdText
from shared.sampling import INT64_MAX, INT64_MIN, MAX_TOKENS_LIMIT

MAX_DERENDER_CHOICES = 128
"""Choices one generate response may carry (as `n` is bounded for generating)."""
MAX_DERENDER_PROMPTS = 128
"""Generate responses one completions derender may carry, one per prompt."""

# Every number is bounded: each may be written back into an answer (a JSON integer).
TokenIdIn = Annotated[int, Field(ge=0, le=INT64_MAX)]
TokenIds = Annotated[list[TokenIdIn], Field(max_length=MAX_TOKENS_LIMIT)]
PromptIds = Annotated[list[TokenIdIn], Field(min_length=1, max_length=MAX_TOKENS_LIMIT)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
Rank = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]


class GeneratedTopLogprob(BaseModel):
    """One alternative at a position, as /inference/v1/generate spells it."""

    token_id: TokenIdIn
    logprob: float
    rank: Rank | None = None


class GeneratedTokenLogprob(BaseModel):
    """One generated token's logprob, rank and top alternatives."""

    token_id: TokenIdIn
    logprob: float
    rank: Rank | None = None
    top_logprobs: list[GeneratedTopLogprob] = Field(
        default_factory=list, max_length=MAX_COMPLETION_LOGPROBS
    )


class GeneratedLogprobs(BaseModel):
    content: list[GeneratedTokenLogprob] = Field(max_length=MAX_TOKENS_LIMIT)


class GeneratedChoice(BaseModel):
    """One choice of a generate response (or its part in a streamed chunk)."""

    model_config = ConfigDict(extra="ignore")

    index: int = Field(ge=0, lt=MAX_DERENDER_CHOICES)
    token_ids: TokenIds
    finish_reason: Literal["stop", "length", "abort", "error"] | None = None
    stop_reason: TokenIdIn | Annotated[str, Field(max_length=4096)] | None = None
    """A stop token id, or the stop string that ended the choice."""
    logprobs: GeneratedLogprobs | None = None


class GeneratedCachedTokens(BaseModel):
    model_config = ConfigDict(extra="ignore")

    cached_tokens: Count = 0


class GeneratedUsage(BaseModel):
    """What a derender reads of the generate response's usage: the prefix-cache hits."""

    model_config = ConfigDict(extra="ignore")

    prompt_tokens_details: GeneratedCachedTokens | None = None


class GeneratedResponse(BaseModel):
    """A non-streamed /inference/v1/generate response (its id, model and times are not
    read: the derendered answer has its own)."""

    model_config = ConfigDict(extra="ignore")

    choices: list[GeneratedChoice] = Field(min_length=1, max_length=MAX_DERENDER_CHOICES)
    usage: GeneratedUsage | None = None
    prompt_token_ids: PromptIds | None = None


class GeneratedChunk(BaseModel):
    """One event of a streamed /inference/v1/generate response."""

    model_config = ConfigDict(extra="ignore")

    choices: list[GeneratedChoice] = Field(max_length=MAX_DERENDER_CHOICES)
    usage: GeneratedUsage | None = None


class ChoiceState(BaseModel):
    """One choice of a streamed derender so far: what the worker generated (as its
    deltas said it) and how much text that released, which a replay must find again."""

    model_config = ConfigDict(extra="forbid")

    token_ids: TokenIds = Field(default_factory=list)
    finish_reason: Literal["stop", "length", "abort", "error"] | None = None
    stop_token_id: TokenIdIn | None = None
    text_chars: Count = 0
    cached_tokens: Count = 0
    """Its prompt's prefix-cache hits, as the generate stream's usage said."""


class DerenderStreamState(BaseModel):
    """What a streamed derender needs to go on: the client carries it from one call to the
    next. Each call replays it through fresh choices and sends only what is new."""

    model_config = ConfigDict(extra="forbid")

    request_id: RequestIdText
    created: Count
    prompt_token_ids: list[PromptIds] = Field(min_length=1, max_length=MAX_DERENDER_PROMPTS)
    """Each prompt (a chat has one)."""
    choices: list[ChoiceState] = Field(
        min_length=1, max_length=MAX_DERENDER_CHOICES * MAX_DERENDER_PROMPTS
    )
    """Every choice, prompt by prompt."""
    ended: bool = False
    """The stream's end went out."""


class DerenderStreamResponse(msgspec.Struct):
    """A streamed derender's answer: `chunk`, the SSE text of the generating endpoint's
    stream for this generate chunk (the chunks concatenated are that stream), and the
    state to send with the next chunk."""

    chunk: str
    stream_state: dict[str, Any]


class ChatDerenderRequest(JsonBody):
    """POST /v1/chat/completions/derender: a `generate_response`, or with `stream` one
    `generate_chunk` at a time."""

    generate_response: GeneratedResponse | None = None
    stream: bool = False
    generate_chunk: GeneratedChunk | None = None
    stream_state: DerenderStreamState | None = None
    """Unset on the first chunk of a stream; then the previous answer's."""
    prompt_tokens: Count | None = None
    """The prompt's length, checked against the prompt's token ids when both are known."""
    prompt_token_ids: PromptIds | None = None
    """The prompt that was generated from; unset: the generate response's, else
    `chat_request` rendered again."""
    chat_request: ChatCompletionRequest | None = None
    """The chat body that was rendered: its stop strings, tools, reasoning and logprobs
    options shape the answer. Unset: a plain answer (prompt_token_ids then needed)."""
    model: str | None = None


class CompletionDerenderRequest(JsonBody):
    """POST /v1/completions/derender: one generate response per prompt, in order."""

    generate_responses: list[GeneratedResponse] | None = Field(
        default=None, min_length=1, max_length=MAX_DERENDER_PROMPTS
    )
    stream: bool = False
    generate_chunk: GeneratedChunk | None = None
    """With `stream`: one event of the generate stream of prompt `prompt_index`."""
    prompt_index: int = Field(default=0, ge=0, lt=MAX_DERENDER_PROMPTS)
    stream_state: DerenderStreamState | None = None
    prompt_token_ids: list[PromptIds] | None = Field(
        default=None, min_length=1, max_length=MAX_DERENDER_PROMPTS
    )
    """Each prompt; unset: each generate response's, else `completion_request`'s prompts.
    Never empty: a streamed derender would have no prompt to stream for."""
    completion_request: CompletionRequest | None = None
    """The completions body that was rendered (stop strings, echo, logprobs)."""
    model: str | None = None
