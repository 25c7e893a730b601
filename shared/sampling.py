"""SamplingParams: the one definition of how to sample, used by both tiers.

It travels inside `Generate` on the wire, so it is a msgspec Struct. The `Meta` bounds
make the worker's typed decoder reject out-of-range values on its own; `validate()`
adds the cross-field checks and names the offending field, so the render tier can
answer 400 with `param` set before anything reaches a worker.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024
MAX_ALLOWED_TOKEN_IDS = 1024
MAX_BAD_WORDS = 1024
"""Token sequences in `bad_words_token_ids`; the render sends two per word (with and
without a leading space), so this is 512 words."""
MAX_BAD_WORD_TOKENS = 32
MAX_TOKENS_LIMIT = 1 << 20
INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1

TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
BadWord = Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_BAD_WORD_TOKENS)]


class SamplingParamsError(ValueError):
    """A sampling field is out of range; `param` names it as the API spells it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """How to pick each next token for one sequence, and when to stop."""

    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 1.0
    """0 means greedy."""
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose mass reaches top_p."""
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=1 << 20)] = 0
    """Keep the k most likely tokens; 0 or -1 disables."""
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    """Drop tokens whose probability is below min_p times the top token's."""
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = 0.0
    """Subtracted from the logit of every token already generated."""
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = 0.0
    """Subtracted once per earlier occurrence of a token in the output."""
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=10.0)] = 1.0
    """HF-style: logits of tokens seen in prompt or output are divided (or multiplied) by it."""
    seed: Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)] | None = None
    """Per-request seed: the same seed gives the same tokens whatever shares the batch."""
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS_LIMIT)] = 16
    """Upper bound on generated tokens."""
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS_LIMIT)] = 0
    """EOS and stop token ids are suppressed until this many tokens exist."""
    stop_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)] = []
    """Extra token ids that end the sequence (besides EOS)."""
    ignore_eos: bool = False
    """Keep going past EOS (benchmarks)."""
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    """None: no logprobs. n >= 0: the sampled token's logprob plus the top n."""
    logit_bias: Annotated[dict[int, float], msgspec.Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    """Token id -> bias added to its logit, in [-100, 100]."""
    prompt_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    """None: none. n >= 0: each prompt token's logprob (the first has none) plus the top n
    at its position, all on the request's first delta. Such a request skips the prefix
    cache on admission, so every prompt position is computed."""
    bad_words_token_ids: Annotated[list[BadWord], msgspec.Meta(max_length=MAX_BAD_WORDS)] = []
    """Token sequences never generated: a word's last token is banned whenever the output
    so far ends with its other tokens (the API's `bad_words`, tokenized by the render)."""
    allowed_token_ids: (
        Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)]
        | None
    ) = None
    """Only these tokens may be sampled; None allows every token."""

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Check every bound; raise SamplingParamsError naming the first bad field."""
        checks: list[tuple[str, bool, str]] = [
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "must be -1, 0 (disabled) or a positive count"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "must be in (0, 10]"),
            ("max_tokens", 1 <= self.max_tokens <= MAX_TOKENS_LIMIT, "must be at least 1"),
            ("min_tokens", self.min_tokens >= 0, "must be non-negative"),
            ("min_tokens", self.min_tokens <= self.max_tokens, "must not exceed max_tokens"),
            (
                "seed",
                self.seed is None or INT64_MIN <= self.seed <= INT64_MAX,
                "must fit in a signed 64-bit integer",
            ),
            (
                "logprobs",
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"must be in [0, {MAX_LOGPROBS}]",
            ),
            (
                "stop_token_ids",
                len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
                f"at most {MAX_STOP_TOKEN_IDS} ids",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"must be in [0, {MAX_LOGPROBS}]",
            ),
        ]
        for param, ok, message in checks:
            if not ok:
                raise SamplingParamsError(param, f"{param} {message}")
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise SamplingParamsError(
                    "logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS} entries"
                )
            for token_id, bias in self.logit_bias.items():
                if not -100.0 <= bias <= 100.0:
                    raise SamplingParamsError(
                        "logit_bias", "logit_bias values must be in [-100, 100]"
                    )
                if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                    raise SamplingParamsError(
                        "logit_bias", f"logit_bias token id {token_id} is outside the vocabulary"
                    )
        self._validate_token_filters(vocab_size)
        if vocab_size is not None:
            if self.top_k > vocab_size:
                raise SamplingParamsError("top_k", f"top_k must be at most {vocab_size}")
            for token_id in self.stop_token_ids:
                if token_id >= vocab_size:
                    raise SamplingParamsError(
                        "stop_token_ids", f"stop_token_ids: {token_id} is outside the vocabulary"
                    )

    def _validate_token_filters(self, vocab_size: int | None) -> None:
        """bad_words and allowed_token_ids: sizes, ids in the vocabulary, and at least one
        allowed token that no single-token bad word bans."""
        limit = vocab_size if vocab_size is not None else 1 << 31
        words = self.bad_words_token_ids
        if len(words) > MAX_BAD_WORDS:
            raise SamplingParamsError("bad_words", f"bad_words: at most {MAX_BAD_WORDS} sequences")
        for word in words:
            if not 1 <= len(word) <= MAX_BAD_WORD_TOKENS:
                raise SamplingParamsError(
                    "bad_words", f"bad_words: each word is 1 to {MAX_BAD_WORD_TOKENS} tokens"
                )
            if not all(0 <= t < limit for t in word):
                raise SamplingParamsError(
                    "bad_words", "bad_words hold a token outside the vocabulary"
                )
        allowed = self.allowed_token_ids
        if allowed is None:
            return
        if not 1 <= len(allowed) <= MAX_ALLOWED_TOKEN_IDS:
            raise SamplingParamsError(
                "allowed_token_ids", f"allowed_token_ids takes 1 to {MAX_ALLOWED_TOKEN_IDS} ids"
            )
        if not all(0 <= t < limit for t in allowed):
            raise SamplingParamsError(
                "allowed_token_ids", "allowed_token_ids hold a token outside the vocabulary"
            )
        banned = {word[0] for word in words if len(word) == 1}
        if banned.issuperset(allowed):
            raise SamplingParamsError(
                "allowed_token_ids", "bad_words ban every token of allowed_token_ids"
            )
