"""Structured-output constraints -> llguidance grammars and matchers, for both tiers.

Why llguidance (over outlines, xgrammar, lm-format-enforcer): its core is Rust behind a
small wheel with no torch dependency, so the CPU render tier validates a constraint with
the very compiler the worker runs; one engine covers JSON schema, regex, Lark/GBNF
grammars and choice lists; the token mask is computed lazily from a lexer DFA walked
over a token trie, a small fraction of a millisecond per request per step (bench/RESULTS.md,
"Constraint costs"), with no per-schema precompilation over the whole vocabulary; and its
parser limits ("fuel") bound the work any single grammar can cost, deterministically, so
both tiers reject the same grammar bombs.

Both tiers build matchers with the same `parser_limits()`, on large-stack threads. The
render tier calls `validate` before sending: it compiles, walks the first few tokens
(where lazy lexer construction happens, so a regex bomb fails there and not on a worker)
and holds both to CPU budgets, so what reaches a worker compiles in well under a second
and costs little per step. The worker calls `new_matcher` and refuses whatever fails.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import llguidance

from shared.protocol import Constraint

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # defined in the stub, not exported
    from tokenizers import Tokenizer as HFTokenizer

MAX_CHOICES = 1024
MAX_SCHEMA_PROPERTIES = 2000
"""In all objects of a schema together: llguidance compiles optional properties in time
quadratic in their number per object (measured in bench/RESULTS.md, "Constraint costs")."""
MAX_COMPILE_CPU_S = 0.5
"""CPU budget of compiling a constraint and computing its first mask, in `validate`."""
MAX_STEP_CPU_S = 0.05
"""CPU budget of each later mask + token in `validate`. A worker computes every constrained
row's mask each step, so a constraint costing more would slow all requests batched with
it; a typical step costs a small fraction of this (bench/RESULTS.md)."""
COMPILE_STACK_BYTES = 256 << 20
"""Stack of the threads that build matchers. llguidance recurses once per nested rule: a
227 KB grammar of 10k chained rules segfaults an 8 MB stack (12k rules a 16 MB one), and
64 MB held every chain that fits in MAX_CONSTRAINT_CHARS. Reserved address space only:
pages are committed as the recursion touches them."""
MAX_ERROR_CHARS = 1024
"""Errors are cut to this length: llguidance's can quote the whole grammar."""
VALIDATION_WALK_TOKENS = 8
"""Tokens `validate` feeds the matcher after compiling it (see there)."""
INITIAL_LEXER_FUEL = 200_000
"""A fifth of llguidance's default: a regex bomb runs out well within MAX_COMPILE_CPU_S
(bench/RESULTS.md), while nested schemas, 2,000-value enums and bounded repeats like
[0-9]{1,1000} still compile."""

# Compact, fixed whitespace: a small model given free whitespace may fill its budget with
# newlines before closing the object. `x-guidance` in a schema can override this.
JSON_OPTIONS: JsonCompileOptions = {
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
    """The llguidance view of a `tokenizers.Tokenizer` (slow: build once per app).

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
            _check_schema_size(schema)
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
    except RecursionError:  # the GBNF converter is recursive Python
        raise ConstraintError("the grammar is nested too deeply") from None
    raise ConstraintError(f"unknown constraint kind {kind!r}")


def new_matcher(constraint: Constraint, tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    """A fresh matcher at the start of the output; ConstraintError if it cannot be built.

    Built on a thread with a large stack (see COMPILE_STACK_BYTES).
    """
    return _on_large_stack(_build_matcher, constraint, tokenizer)


def validate(constraint: Constraint, tokenizer: llguidance.LLTokenizer | HFTokenizer) -> str | None:
    """None if the constraint compiles against `tokenizer` within budget, else why not.

    Beyond compiling, it walks a few tokens: lexers are built lazily, so a regex bomb
    (`a{1000000}`) only exhausts its fuel on the first masks and consumes. Each step takes
    an allowed token from the middle of the mask. Compiling (with the first mask) must fit
    in MAX_COMPILE_CPU_S of CPU and every later step in MAX_STEP_CPU_S, measured as this
    thread's CPU time so that machine load does not move the verdict. A bomb deeper than
    the walk still fails on the worker after one fuel's worth of work, ending
    only that request. Call it off the event loop. A `tokenizers.Tokenizer` is converted
    first (slow).
    """
    if not isinstance(tokenizer, llguidance.LLTokenizer):
        vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        tokenizer = lltokenizer_from_hf(tokenizer, vocab_size=vocab_size, eos_token_ids=None)
    try:
        _on_large_stack(_check, constraint, tokenizer)
    except ConstraintError as exc:
        return exc.message
    return None


def _build_matcher(
    constraint: Constraint, tokenizer: llguidance.LLTokenizer
) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(
        tokenizer, grammar_of(constraint), log_level=0, limits=parser_limits()
    )
    if matcher.is_error():
        raise ConstraintError(matcher.get_error())
    return matcher


def _check(constraint: Constraint, tokenizer: llguidance.LLTokenizer) -> None:
    """Compile and walk (see `validate`); raise ConstraintError on any failure."""
    started = time.thread_time()
    matcher = _build_matcher(constraint, tokenizer)
    eos = set(tokenizer.eos_tokens)
    for step in range(VALIDATION_WALK_TOKENS):
        step_started = time.thread_time()
        allowed = [t for t in _allowed_tokens(matcher.compute_bitmask()) if t not in eos]
        if step == 0:
            _check_cpu(time.thread_time() - started, MAX_COMPILE_CPU_S, "compiling it")
        if matcher.is_error() or not allowed:
            break
        matcher.consume_token(allowed[len(allowed) // 2])
        if step > 0:
            _check_cpu(time.thread_time() - step_started, MAX_STEP_CPU_S, "one token step")
        if matcher.is_error() or matcher.is_stopped():
            break
    if matcher.is_error():
        raise ConstraintError(matcher.get_error())


def _check_cpu(seconds: float, budget: float, what: str) -> None:
    if seconds > budget:
        raise ConstraintError(
            f"constraint too complex: {what} takes {seconds * 1000:.0f} ms of CPU "
            f"(at most {budget * 1000:.0f} ms)"
        )


_T = TypeVar("_T")
_STACK_LOCK = threading.Lock()


def _on_large_stack(fn: Callable[..., _T], *args: object) -> _T:
    """fn(*args) on a fresh thread with a COMPILE_STACK_BYTES stack; its result or error."""
    outcome: list[_T | BaseException] = []

    def run() -> None:
        try:
            outcome.append(fn(*args))
        except BaseException as exc:  # re-raised in the caller
            outcome.append(exc)

    # threading.stack_size is process-wide, so it is set only while this thread starts; a
    # thread another caller starts meanwhile merely reserves a larger (lazily used) stack.
    with _STACK_LOCK:
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="constraint-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    [result] = outcome
    if isinstance(result, BaseException):
        raise result
    return result


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
    except RecursionError:
        raise ConstraintError(f"{what} is nested too deeply") from None


def _check_schema_size(schema: dict) -> None:
    """Refuse schemas with more than MAX_SCHEMA_PROPERTIES properties in all (iteratively:
    the schema may nest as deep as json.loads allows)."""
    total = 0
    stack: list[object] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            properties = node.get("properties")
            if isinstance(properties, dict):
                total += len(properties)
                if total > MAX_SCHEMA_PROPERTIES:
                    raise ConstraintError(
                        f"the JSON schema has more than {MAX_SCHEMA_PROPERTIES} properties"
                    )
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
