"""Request fields chat and completions share: sampling, stops, limits (OpenAI + vLLM).

Every field of vLLM's request schemas is declared here: honoured, or named in
`UNSUPPORTED_FIELDS` and answered with a 400 naming it when the client sets it to anything
but its default (tests/e2e/test_vllm_field_walk.py walks them all). Keys in neither vLLM's
nor OpenAI's schemas are ignored, as vLLM ignores them.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from render_server.schemas.tokenize import ChatMessage, ToolDefinition
from render_server.schemas.vllm_fields import VllmFields
from shared.sampling import INT64_MAX, INT64_MIN

# Bounds checked in the render tier before anything reaches a worker.
MAX_MESSAGES = 4096
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_CHAT_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 20
MAX_PROMPTS = 64
CompletionLogprobs = Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)]
"""A completion's `logprobs`: top alternatives per token (0: the sampled token only)."""

StopField = Annotated[
    str | list[str] | None,
    Field(description="Up to 16 strings; generation stops before the first that appears."),
]


class StreamOptions(BaseModel):
    """Options of a streamed response."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool | None = None
    """Send a last chunk with `usage` (and empty `choices`) before `[DONE]`; unset means
    false, or true with `continuous_usage_stats` (as in vLLM, where it defaults to true)."""
    continuous_usage_stats: bool = False
    """vLLM's: every chunk carries the usage so far."""

    @property
    def wants_final_usage(self) -> bool:
        if self.include_usage is None:
            return self.continuous_usage_stats
        return self.include_usage

    @property
    def wants_usage_per_chunk(self) -> bool:
        return self.continuous_usage_stats and self.include_usage is not False


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` request field; render_server.generation.structured reads it."""

    model_config = ConfigDict(extra="ignore")

    json_: Any = Field(default=None, alias="json")
    """A JSON schema, as an object or as JSON text."""
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    """A Lark grammar (as llguidance extends it) or a GBNF one."""
    json_object: bool | None = None
    structural_tag: Any = None
    """Not supported: refused when set."""
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    """Close the JSON schema's objects that list properties without saying
    `additionalProperties` (vLLM's rule); the other backend options above are refused when
    set to anything but their defaults (the grammar engine has one whitespace rule and no
    fallback backend to disable)."""


DISTRIBUTION_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
"""The fields that reshape the next-token distribution, named as vLLM's SamplingParams
names them too."""


class SamplingFields(VllmFields):
    """Fields of both endpoints that become SamplingParams, stops and limits."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    """Upper bound on generated tokens; unset means up to max_model_len minus the prompt."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    """Choice i samples with seed + i, so a seeded request with n > 1 is reproducible."""
    n: int = 1
    stop: StopField = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    """Token id (as a string key, as OpenAI sends it) to a bias in [-100, 100]."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    """Accepted for compatibility; unused."""
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    """vLLM's scheduling priority (lower runs first) under the workers'
    --scheduling-policy priority; under fcfs anything but 0 is refused. Bounded to a
    signed 64-bit integer, as the wire carries it."""
    response_format: Any = None
    """OpenAI's structured outputs: {"type": "text" | "json_object" | "json_schema", ...}."""
    structured_outputs: StructuredOutputsField | None = None
    """vLLM's structured outputs: exactly one of json, regex, choice, grammar, json_object."""
    guided_json: Any = None
    """vLLM's older names of the same constraints (a JSON schema, as an object or text)."""
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    best_of: int | None = None
    """Only equal to n: choices are sampled independently, none is ranked out."""

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        if best_of is not None and best_of != info.data.get("n", 1):
            raise ValueError("best_of other than n is not supported.")
        return best_of

    @model_validator(mode="after")
    def _check_streaming_fields(self) -> SamplingFields:
        check_streaming_fields(self.stream, self.stream_options, self.prompt_logprobs)
        return self

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings.")
        if any(not 0 < len(s) <= MAX_STOP_STRING_CHARS for s in stops):
            raise ValueError(f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters.")
        return stop

    @field_validator("min_tokens")
    @classmethod
    def _check_min_tokens(cls, min_tokens: int) -> int:
        if min_tokens < 0:
            raise ValueError("must be non-negative.")
        return min_tokens

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            try:
                int(key)
            except ValueError:
                raise ValueError(f"key {key!r} is not a token id.") from None
        return bias

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The output limit the client set (None: unset) and the field it set it in."""
        return self.max_tokens, "max_tokens"

    def num_logprobs(self) -> int | None:
        """Top alternatives to return per token, or None without logprobs."""
        return None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = None
    """OpenAI's newer name for max_tokens; wins when both are set."""
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None
    """"none", "auto", "required", or {"type": "function", "function": {"name": ...}}."""
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True
    """Return the reasoning the --reasoning-parser splits off (reasoning_content)."""
    echo: bool = False
    """vLLM's: the answer starts with the last message's content when that message has
    the answer's role (an assistant message to continue)."""
    add_special_tokens: bool = False
    """Add the tokenizer's special tokens (BOS) on top of the template's."""
    reasoning_effort: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top is not None:
            if not 0 <= top <= MAX_CHAT_LOGPROBS:
                raise ValueError(f"must be in [0, {MAX_CHAT_LOGPROBS}].")
            if not info.data.get("logprobs"):
                raise ValueError("needs logprobs: true.")
        return top

    @field_validator("continue_final_message")
    @classmethod
    def _check_continue(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt"):
            raise ValueError("cannot be true together with add_generation_prompt.")
        return value


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: Prompt
    logprobs: CompletionLogprobs | None = None
    echo: bool = False
    add_special_tokens: bool = True
    suffix: str | None = None
    prompt_embeds: Any = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: Prompt) -> Prompt:
        if isinstance(prompt, str):
            return prompt
        if not prompt:
            raise ValueError("must not be empty.")
        if not isinstance(prompt[0], int) and len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts.")
        return prompt

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_texts(self) -> list[str] | None:
        """The prompts as strings, or None when they are token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        return [p for p in prompt if isinstance(p, str)] if isinstance(prompt[0], str) else None

    def prompt_token_ids(self) -> list[list[int]]:
        """The prompts as token ids (when they are not strings)."""
        prompt = self.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], str):
            return []
        if isinstance(prompt[0], int):
            return [[t for t in prompt if isinstance(t, int)]]
        return [list(ids) for ids in prompt if isinstance(ids, list)]


def check_streaming_fields(
    stream: bool,
    options: StreamOptions | None,
    prompt_logprobs: int | None,
    *,
    prompt_logprobs_param: str = "prompt_logprobs",
) -> None:
    """As vLLM: options of a stream need a stream, and prompt logprobs are not streamed."""
    if options is not None and options.model_fields_set and not stream:
        raise _field_error("stream_options", "only allowed when stream is true.")
    if prompt_logprobs is not None and stream:
        raise _field_error(prompt_logprobs_param, "not available when stream is true.")


def _field_error(param: str, message: str) -> PydanticCustomError:
    """A whole-body check's error, naming the field it is about."""
    return PydanticCustomError("invalid_field", message, {"param": param})
