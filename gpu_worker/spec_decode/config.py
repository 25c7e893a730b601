"""`--speculative-config`: vLLM's JSON object, parsed once and resolved to a frozen config.

The JSON's fields and defaults are vLLM's (`vllm/config/speculative.py`): `method` is one
of "ngram", "suffix", "draft_model"; `num_speculative_tokens` is K, the most tokens drafted
per step. Fields that belong to another method are refused rather than ignored, so a typo
or a misplaced field fails at startup with the field's name in the message; so are vLLM's
draft-model fields this worker does not serve (`quantization`, `revision`, `code_revision`,
a `draft_tensor_parallel_size` other than 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeVar, get_args

import msgspec

SpeculativeMethod = Literal["ngram", "suffix", "draft_model"]
METHODS: tuple[SpeculativeMethod, ...] = get_args(SpeculativeMethod)
DraftLength = Literal["adaptive", "fixed"]
DRAFT_LENGTHS: tuple[DraftLength, ...] = get_args(DraftLength)

_T = TypeVar("_T")

# vLLM's defaults (its comment: "arbitrarily chosen"), used when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5


class _SpeculativeConfigJson(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The JSON object as the user wrote it: every field optional, nothing resolved yet."""

    method: str | None = None
    num_speculative_tokens: int | None = None
    model: str | None = None
    draft_tensor_parallel_size: int | None = None
    max_model_len: int | None = None
    enforce_eager: bool | None = None
    quantization: str | None = None
    revision: str | None = None
    code_revision: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    suffix_decoding_max_tree_depth: int | None = None
    suffix_decoding_max_cached_requests: int | None = None
    suffix_decoding_max_cached_nodes: int | None = None
    suffix_decoding_max_spec_factor: float | None = None
    suffix_decoding_min_token_prob: float | None = None
    draft_length: str | None = None


_NGRAM_FIELDS = ("prompt_lookup_min", "prompt_lookup_max")
_SUFFIX_FIELDS = (
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_cached_nodes",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
)
_FIELDS_OF: dict[str, tuple[str, ...]] = {
    "ngram": _NGRAM_FIELDS,
    "suffix": _SUFFIX_FIELDS,
    "draft_model": ("model", "draft_tensor_parallel_size", "max_model_len", "enforce_eager"),
}
# vLLM's draft-model fields with nothing to serve them here: the draft is read from local
# files as they are (no hub revisions, no quantization applied at load).
_UNSERVED_FIELDS: dict[str, str] = {
    "quantization": "the draft model is loaded as its files hold it (a .gguf keeps its "
    "quantization)",
    "revision": "models are local files or built-in names, not hub revisions",
    "code_revision": "models are local files or built-in names, not hub revisions",
}


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Resolved speculative decoding settings; every field has its final value."""

    method: SpeculativeMethod
    """How tokens are drafted: prompt lookup, suffix decoding, or a small draft model."""
    num_speculative_tokens: int
    """K: the most tokens drafted per request per step (suffix decoding may draft fewer)."""
    model: str | None = None
    """draft_model only: the draft model (name, .gguf or HF directory), same tokenizer."""
    draft_tensor_parallel_size: int = 1
    """draft_model: ranks of the draft model; only 1 is served (the draft runs on the
    target's device, in the target's process)."""
    max_model_len: int | None = None
    """draft_model: the draft engine's longest sequence (default: the draft model's
    context); requests past it are verified without drafts."""
    enforce_eager: bool | None = None
    """draft_model: no CUDA graphs for the draft engine (default: the target's setting)."""
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    """ngram: the shortest n-gram whose match counts."""
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    """ngram: the longest n-gram tried first."""
    suffix_decoding_max_tree_depth: int = 24
    """suffix: depth of the request and global trees; bounds match length plus draft length."""
    suffix_decoding_max_cached_requests: int = 10000
    """suffix: finished requests' outputs kept in the global tree (oldest evicted first);
    0 turns the global tree off (each request's own tree is still used)."""
    suffix_decoding_max_cached_nodes: int = 2_000_000
    """suffix: memory bound of the global tree in nodes, about 66 bytes each, so ~130 MB
    (not a vLLM field); outputs are evicted oldest first until the tree fits."""
    suffix_decoding_max_spec_factor: float = 1.0
    """suffix: a match of length m drafts at most factor * m tokens."""
    suffix_decoding_min_token_prob: float = 0.1
    """suffix: drafting stops at the first token whose estimated probability (from the
    tree's counts) falls below this."""
    draft_length: DraftLength = "adaptive"
    """Any method (not a vLLM field): "adaptive" gives each request, each step, the drafts
    whose expected tokens pay for their rows (gpu_worker.spec_decode.draft_length), so
    speculation switches itself off where it does not pay; "fixed" always drafts up to K,
    as vLLM does."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("model is required for method 'draft_model'")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"model is only for method 'draft_model', not {self.method!r}")
        self._check(
            "draft_tensor_parallel_size",
            self.draft_tensor_parallel_size == 1,
            "1 (the draft model runs unsharded beside the target)",
        )
        self._check("max_model_len", self.max_model_len is None or self.max_model_len >= 1, ">= 1")
        self._check("prompt_lookup_min", self.prompt_lookup_min >= 1, ">= 1")
        self._check(
            "prompt_lookup_max",
            self.prompt_lookup_max >= self.prompt_lookup_min,
            f">= prompt_lookup_min={self.prompt_lookup_min}",
        )
        self._check(
            "suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth >= 1, ">= 1"
        )
        self._check(
            "suffix_decoding_max_cached_requests",
            self.suffix_decoding_max_cached_requests >= 0,
            ">= 0",
        )
        self._check(
            "suffix_decoding_max_cached_nodes", self.suffix_decoding_max_cached_nodes >= 1, ">= 1"
        )
        self._check(
            "suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor >= 0, ">= 0"
        )
        self._check(
            "suffix_decoding_min_token_prob",
            0 <= self.suffix_decoding_min_token_prob <= 1,
            "in [0, 1]",
        )
        # Last: suffix decoding's K defaults to the tree depth, whose own error comes first.
        self._check("num_speculative_tokens", self.num_speculative_tokens >= 1, ">= 1")

    def _check(self, field_name: str, holds: bool, rule: str) -> None:
        if not holds:
            raise ValueError(f"{field_name}={getattr(self, field_name)!r} must be {rule}")


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """Parse `--speculative-config`'s JSON object; raise ValueError naming the bad field."""
    try:
        raw = msgspec.json.decode(text, type=_SpeculativeConfigJson)
    except msgspec.ValidationError as error:
        raise ValueError(f"--speculative-config: {error}") from None
    except msgspec.DecodeError as error:
        raise ValueError(f"--speculative-config is not a JSON object: {error}") from None
    return _resolve(raw)


def _resolve(raw: _SpeculativeConfigJson) -> SpeculativeConfig:
    named = raw.method
    if named is None and raw.model is not None:
        named = "draft_model"  # vLLM's shorthand: a `model` without a method is a draft model
    method = next((m for m in METHODS if m == named), None)
    if method is None:
        raise ValueError(f"--speculative-config: method must be one of {METHODS}, got {named!r}")
    given = {name for name in raw.__struct_fields__ if getattr(raw, name) is not None}
    unserved = sorted(given.intersection(_UNSERVED_FIELDS))
    if unserved:
        name = unserved[0]
        raise ValueError(f"--speculative-config: {name} is not served: {_UNSERVED_FIELDS[name]}")
    for other, names in _FIELDS_OF.items():
        misplaced = sorted(given.intersection(names)) if other != method else []
        if misplaced:
            raise ValueError(
                f"--speculative-config: {misplaced[0]} belongs to method {other!r}, not {method!r}"
            )
    defaults = SpeculativeConfig
    depth = _given(raw.suffix_decoding_max_tree_depth, defaults.suffix_decoding_max_tree_depth)
    tokens = raw.num_speculative_tokens
    if tokens is None:
        if method != "suffix":
            raise ValueError(
                f"--speculative-config: num_speculative_tokens is required for method {method!r}"
            )
        tokens = depth  # vLLM: suffix decoding sizes its drafts itself; K only caps them
    # vLLM: one bound given sets the other; neither gives 5 and 5.
    lookup_min = _given(raw.prompt_lookup_min, raw.prompt_lookup_max, DEFAULT_PROMPT_LOOKUP)
    lookup_max = _given(raw.prompt_lookup_max, raw.prompt_lookup_min, DEFAULT_PROMPT_LOOKUP)
    try:
        return SpeculativeConfig(
            method=method,
            num_speculative_tokens=tokens,
            model=raw.model,
            draft_tensor_parallel_size=_given(
                raw.draft_tensor_parallel_size, defaults.draft_tensor_parallel_size
            ),
            max_model_len=raw.max_model_len,
            enforce_eager=raw.enforce_eager,
            prompt_lookup_min=lookup_min,
            prompt_lookup_max=lookup_max,
            suffix_decoding_max_tree_depth=depth,
            suffix_decoding_max_cached_requests=_given(
                raw.suffix_decoding_max_cached_requests,
                defaults.suffix_decoding_max_cached_requests,
            ),
            suffix_decoding_max_cached_nodes=_given(
                raw.suffix_decoding_max_cached_nodes, defaults.suffix_decoding_max_cached_nodes
            ),
            suffix_decoding_max_spec_factor=_given(
                raw.suffix_decoding_max_spec_factor, defaults.suffix_decoding_max_spec_factor
            ),
            suffix_decoding_min_token_prob=_given(
                raw.suffix_decoding_min_token_prob, defaults.suffix_decoding_min_token_prob
            ),
            draft_length=_draft_length(raw.draft_length),
        )
    except ValueError as error:
        raise ValueError(f"--speculative-config: {error}") from None


def _draft_length(named: str | None) -> DraftLength:
    if named is None:
        return "adaptive"
    for choice in DRAFT_LENGTHS:
        if choice == named:
            return choice
    raise ValueError(f"draft_length must be one of {DRAFT_LENGTHS}, got {named!r}")


def _given(*values: _T | None) -> _T:
    """The first value that is not None (the last one, a default, always is)."""
    return next(value for value in values if value is not None)
