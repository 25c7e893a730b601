"""vLLM's scale-out token API: `GenerateRequest` (token ids in), its responses (token ids
out) and `AbortRequests`.

Field names are those of vLLM's `token_in_token_out/protocol.py`: `sampling_params`
carries vLLM's `SamplingParams` names, the request-level fields sit beside it. Render
endpoints produce a `GenerateRequest`; /inference/v1/generate runs one.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from render_server.schemas.body import JsonBody
from render_server.schemas.generation import (
    DISTRIBUTION_FIELDS,
    CompletionLogprobs,
    SamplingFields,
    StreamOptions,
    check_streaming_fields,
)
from render_server.schemas.responses import PromptLogprobs, Usage
from render_server.schemas.vllm_fields import (
    MAX_CACHE_SALT_CHARS,
    MAX_REQUEST_ID_CHARS,
    RequestIdText,
)
from shared.sampling import INT64_MAX, INT64_MIN, MAX_TOKENS_LIMIT

MAX_ABORT_IDS = 1024
"""Request ids one abort call may name."""

GENERATE_SAMPLING_FIELDS = frozenset(
    {
        *DISTRIBUTION_FIELDS,
        "n",
        "seed",
        "max_tokens",
        "min_tokens",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "logprobs",
        "prompt_logprobs",
        "logit_bias",
        "allowed_token_ids",
        "bad_words",
        "truncate_prompt_tokens",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "structured_outputs",
    }
)
"""The `SamplingParams` fields a GenerateRequest may carry; any other key is a 400."""


class GenerateSamplingParams(SamplingFields):
    """vLLM's `SamplingParams`, as JSON: the sampling fields of chat and completions (the
    same checks, the same defaults) under vLLM's names, and nothing else. Unset
    `max_tokens` means up to the context."""

    model_config = ConfigDict(extra="forbid")

    logprobs: CompletionLogprobs | None = None
    """Top alternatives per sampled token (0: the sampled token's own logprob only)."""

    @model_validator(mode="before")
    @classmethod
    def _only_sampling_fields(cls, data: Any) -> Any:
        # The base declares request-level fields too (model, stream, ...): inside
        # sampling_params they are as unknown as a typo (which extra="forbid" refuses),
        # and dropping either would run something other than what the client asked for.
        if type(data) is dict:
            for key in data:
                if key in cls.model_fields and key not in GENERATE_SAMPLING_FIELDS:
                    raise PydanticCustomError(
                        "extra_forbidden", "unknown sampling parameter '{key}'.", {"key": key}
                    )
        return data

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _int_keys_as_text(cls, bias: Any) -> Any:
        # vLLM's SamplingParams keys logit_bias by int; JSON spells every key as text.
        if type(bias) is dict:
            return {str(key): value for key, value in bias.items()}
        return bias

    def num_logprobs(self) -> int | None:
        return self.logprobs


class GenerateRequest(JsonBody):
    """POST /inference/v1/generate: a prompt as token ids and how to sample it."""

    model_config = ConfigDict(extra="ignore")

    request_id: RequestIdText | None = None
    """The client's id of this request: the response carries it, and
    /inference/v1/abort_requests names it (printable ASCII). Unset: the server's id."""
    token_ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1, max_length=MAX_TOKENS_LIMIT)
    """The prompt, exactly as it is run (no special tokens added)."""
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    features: None = None
    """Multimodal features: none are supported, so only null is accepted."""

    @model_validator(mode="after")
    def _check_stream_options(self) -> GenerateRequest:
        check_streaming_fields(
            self.stream,
            self.stream_options,
            self.sampling_params.prompt_logprobs,
            prompt_logprobs_param="sampling_params.prompt_logprobs",
        )
        return self

    def sampling_fields(self) -> SamplingFields:
        """The request as the fields every generating endpoint reads: the sampling
        parameters with the request-level fields set beside them."""
        update: dict[str, Any] = {
            name: getattr(self, name)
            for name in ("model", "stream", "stream_options", "cache_salt", "priority")
            if name in self.model_fields_set
        }
        update["request_id"] = self.request_id
        return self.sampling_params.model_copy(update=update)


class AbortRequests(BaseModel):
    """POST /inference/v1/abort_requests: stop these requests (by their client ids)."""

    model_config = ConfigDict(extra="ignore")

    request_ids: list[Annotated[str, Field(max_length=MAX_REQUEST_ID_CHARS)]] = Field(
        max_length=MAX_ABORT_IDS
    )


# Responses: msgspec structs, encoded on the hot path as the other APIs' are.


class GenerateTopLogprob(msgspec.Struct):
    token_id: int
    logprob: float
    rank: int


class GenerateTokenLogprob(msgspec.Struct):
    token_id: int
    logprob: float
    rank: int | None
    top_logprobs: list[GenerateTopLogprob]


class GenerateLogprobs(msgspec.Struct):
    content: list[GenerateTokenLogprob]


class GenerateChoice(msgspec.Struct):
    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: GenerateLogprobs | None = None


class GenerateResponse(msgspec.Struct):
    """The non-streamed answer."""

    request_id: str
    model: str
    created: int
    choices: list[GenerateChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None
    """With `prompt_logprobs`: the ids they score."""
    prompt_logprobs: PromptLogprobs | None = None


class GenerateChunk(msgspec.Struct):
    """One streamed event: a worker step's new tokens of one choice, or the usage."""

    request_id: str
    choices: list[GenerateChoice]
    usage: Usage | None = None
