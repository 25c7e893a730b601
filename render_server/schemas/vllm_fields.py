"""vLLM's request fields beyond OpenAI's, shared by chat and completions.

Each is honoured (render_server.generation.sampling_params and the formatters read it) or
named in `UNSUPPORTED_FIELDS`: declared with vLLM's default so a client that sends the
default still works, and refused with a 400 naming it when set to anything else.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field, field_validator

from render_server.schemas.body import JsonBody
from shared.sampling import MAX_ALLOWED_TOKEN_IDS, MAX_LOGPROBS

MAX_CACHE_SALT_CHARS = 256
"""As the wire carries it."""
MAX_REQUEST_ID_CHARS = 128
MAX_BAD_WORDS = 512
MAX_BAD_WORD_CHARS = 256

XargValue = str | int | float | list[str | int | float]


def _printable_ascii(text: str) -> str:
    if not (text.isascii() and text.isprintable()):
        raise ValueError("must be printable ASCII.")
    return text


RequestIdText = Annotated[
    str, Field(min_length=1, max_length=MAX_REQUEST_ID_CHARS), AfterValidator(_printable_ascii)
]
"""A client's request id: it ends up in response ids, worker request ids and logs."""


class VllmFields(JsonBody):
    """vLLM's extra sampling and request fields."""

    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    """Salts the prefix-cache hashes: requests share cached blocks only when their salts
    are equal (and, under --prefix-cache-isolation per-key, their API keys too)."""
    request_id: RequestIdText | None = None
    """The response id's suffix and the worker request ids' prefix (printable ASCII);
    requests may share one."""
    truncate_prompt_tokens: int | None = None
    """Keep only the last N prompt tokens; -1 keeps as many as fit the context with room
    for the output."""
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """Each prompt token's logprob plus the top N at its position (not streamed)."""
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS
    )
    """Only these tokens may be sampled."""
    bad_words: list[str] = Field(default_factory=list, max_length=MAX_BAD_WORDS)
    """Words never generated, as token sequences (each with and without a leading space)."""
    return_token_ids: bool | None = None
    """Also return the prompt's and each choice's token ids."""
    return_tokens_as_token_ids: bool | None = None
    """Logprob tokens spelled `token_id:N` (for tokens that are not valid text alone)."""
    vllm_xargs: dict[str, XargValue] | None = None
    """Arguments of custom extensions; duet has none, so any key is refused."""

    # Declared to be refused (UNSUPPORTED_FIELDS), with vLLM's defaults.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    spaces_between_special_tokens: bool = True
    logits_processors: list[Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: str | None = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncate(cls, value: int | None) -> int | None:
        if value is not None and value != -1 and value < 1:
            raise ValueError("must be -1 (fit the context) or at least 1.")
        return value

    @field_validator("bad_words")
    @classmethod
    def _check_bad_words(cls, words: list[str]) -> list[str]:
        if any(not 0 < len(word.strip()) <= MAX_BAD_WORD_CHARS for word in words):
            raise ValueError(f"each word must have 1 to {MAX_BAD_WORD_CHARS} characters.")
        return words

    @field_validator("vllm_xargs")
    @classmethod
    def _check_xargs(cls, xargs: dict[str, XargValue] | None) -> dict[str, XargValue] | None:
        if xargs:
            raise ValueError(
                f"unknown key {next(iter(xargs))!r}: this server runs no extension that "
                "takes arguments."
            )
        return xargs


UNSUPPORTED_FIELDS: dict[str, str] = {
    "suffix": "suffix (insertion) is not supported",
    "use_beam_search": "beam search is not supported",
    "length_penalty": "length_penalty applies to beam search, which is not supported",
    "spaces_between_special_tokens": (
        "special tokens are decoded as the tokenizer joins them; false is not supported"
    ),
    "logits_processors": "custom logits processors are not supported",
    "kv_transfer_params": "disaggregated KV transfer is not supported",
    "guided_decoding_backend": (
        "the structured-output backend is the server's (llguidance); it cannot be chosen "
        "per request"
    ),
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported",
    "structural_tag": "structural tags are not supported",
    "reasoning_effort": "reasoning_effort is not supported by this model's chat template",
    "mm_processor_kwargs": "multimodal inputs are not supported",
    "prompt_embeds": "prompt embeddings are not supported",
}
"""Field -> why it is refused, when a request sets it to anything but its default."""
