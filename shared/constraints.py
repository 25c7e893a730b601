"""Structured-output constraints -> llguidance grammars and matchers, for both tiers.

Why llguidance (over outlines, xgrammar, lm-format-enforcer): its core is Rust behind a
small wheel with no torch dependency, so the CPU render tier validates a constraint with
the very compiler the worker runs; one engine covers JSON schema, regex, Lark/GBNF
grammars and choice lists; the token mask is computed lazily from a lexer DFA walked
over a token trie, typically 10-100 us per request per step, with no per-schema
precompilation over the whole vocabulary; and its parser limits ("fuel") bound the work
any single grammar can cost, deterministically, so both tiers reject the same grammar
bombs.

Both tiers build matchers with the same `parser_limits()`. The render tier calls
`validate` before sending (it also walks the first few tokens, where lazy lexer
construction happens, so a regex bomb fails there and not on a worker); the worker calls
`new_matcher` and refuses whatever fails.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import llguidance

from shared.protocol import Constraint

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer

MAX_CHOICES = 1024
MAX_ERROR_CHARS = 1024
"""Errors are cut to this length: llguidance's can quote the whole grammar."""
VALIDATION_WALK_TOKENS = 8
"""Tokens `validate` feeds the matcher after compiling it (see there)."""
INITIAL_LEXER_FUEL = 200_000
"""A fifth of llguidance's default: a regex bomb runs out in ~0.1-0.2 s of CPU, while
nested schemas, 2,000-value enums and bounded repeats like [0-9]{1,1000} still compile."""

# Compact, fixed whitespace: a small model given free whitespace may fill its budget with
# newlines before closing the object. `x-guidance` in a schema can override this.
JSON_OPTIONS: llguidance.JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class ConstraintError(ValueError):
    """The constraint does not compile; `message` says why (safe to show the client)."""

    def __init__(self, message: str) -> None:
        message = message.replace("<non-verbose/>", "").strip()
        if len(message) > MAX_ERROR_CHARS:
            message = message[:MAX_ERROR_CHARS] + "..."
        super().__init__(message)
        self.message = message


def parser_limits() -> llguidance.LLParserLimits:
    """The resource limits every matcher is built with, in both tiers."""
    return llguidance.LLParserLimits(initial_lexer_fuel=INITIAL_LEXER_FUEL, verbose_errors=False)


def lltokenizer_from_hf(
    hf: HFTokenizer, *, vocab_size: int, eos_token_ids: list[int] | None
) -> llguidance.LLTokenizer:
    """The llguidance view of a `tokenizers.Tokenizer` (slow, ~1 s: build once per app).

    `eos_token_ids` are the tokens that end an accepted output (None: the tokenizer's own).
    """
    return llguidance.LLTokenizer(hf.to_str(), n_vocab=vocab_size, eos_token=eos_token_ids)


def grammar_of(constraint: Constraint) -> str:
    """The llguidance grammar text of a constraint; ConstraintError when malformed."""
    kind, spec = constraint.kind, constraint.spec
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=JSON_OPTIONS
            )
        if kind == "json_schema":
            schema = _parse_json(spec, "the JSON schema")
            if not isinstance(schema, dict):
                raise ConstraintError("the JSON schema must be an object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            choices = _parse_json(spec, "the choices")
            if (
                not isinstance(choices, list)
                or not choices
                or not all(isinstance(choice, str) for choice in choices)
            ):
                raise ConstraintError("choice must be a non-empty list of strings")
            if len(choices) > MAX_CHOICES:
                raise ConstraintError(f"choice takes at most {MAX_CHOICES} strings")
            return llguidance.grammar_from("choice", spec)
        if kind == "grammar":
            # Lark as llguidance extends it, or GBNF (llama.cpp's), converted to Lark.
            return llguidance.grammar_from("grammar", spec)
    except ConstraintError:
        raise
    except ValueError as exc:
        raise ConstraintError(str(exc)) from exc
    raise ConstraintError(f"unknown constraint kind {kind!r}")


def new_matcher(constraint: Constraint, tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    """A fresh matcher at the start of the output; ConstraintError if it cannot be built."""
    matcher = llguidance.LLMatcher(
        tokenizer, grammar_of(constraint), log_level=0, limits=parser_limits()
    )
    if matcher.is_error():
        raise ConstraintError(matcher.get_error())
    return matcher


def validate(constraint: Constraint, tokenizer: llguidance.LLTokenizer | HFTokenizer) -> str | None:
    """None if the constraint compiles against `tokenizer`, else why not.

    Beyond compiling, it walks a few tokens: lexers are built lazily, so a regex bomb
    (`a{1000000}`) only exhausts its fuel on the first masks and consumes. Each step takes
    an allowed token from the middle of the mask. A bomb placed deeper than the walk still
    fails on the worker, after at most one fuel's worth of work (~0.2 s), ending only
    that request. Call it off the event loop. A `tokenizers.Tokenizer` is converted first
    (slow).
    """
    if not isinstance(tokenizer, llguidance.LLTokenizer):
        vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        tokenizer = lltokenizer_from_hf(tokenizer, vocab_size=vocab_size, eos_token_ids=None)
    try:
        matcher = new_matcher(constraint, tokenizer)
    except ConstraintError as exc:
        return exc.message
    eos = set(tokenizer.eos_tokens)
    for _ in range(VALIDATION_WALK_TOKENS):
        allowed = [t for t in _allowed_tokens(matcher.compute_bitmask()) if t not in eos]
        if matcher.is_error() or not allowed:
            break
        matcher.consume_token(allowed[len(allowed) // 2])
        if matcher.is_error() or matcher.is_stopped():
            break
    if matcher.is_error():
        return ConstraintError(matcher.get_error()).message
    return None


def _allowed_tokens(bitmask: bytes) -> list[int]:
    """Token ids whose bit is set in an llguidance bitmask (little-endian 32-bit words)."""
    allowed: list[int] = []
    for index, byte in enumerate(bitmask):
        if byte:
            allowed.extend(index * 8 + bit for bit in range(8) if byte >> bit & 1)
    return allowed


def _parse_json(text: str, what: str) -> object:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConstraintError(f"{what} is not valid JSON: {exc}") from exc
