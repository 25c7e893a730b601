"""What structured-output constraints cost in CPU: the figures `shared/constraints.py`'s
limits and budgets were chosen from, measured rather than quoted in its docstrings.

- building llguidance's tokenizer for SmolLM2 (done once per app or worker);
- compiling a JSON schema with N optional properties in one object, plus its first mask
  (quadratic in N: why MAX_SCHEMA_PROPERTIES);
- a regex bomb running out of INITIAL_LEXER_FUEL (what one rejected bomb costs);
- one mask + token step of a typical nested schema (against MAX_STEP_CPU_S).

Times are this thread's CPU (medians), so the machine's load moves them little.

    python -m bench.constraints [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import llguidance
import numpy

from bench.common.results_md import command_line, write_section
from render_server.templating.tokenizer import Tokenizer
from shared.constraints import (
    INITIAL_LEXER_FUEL,
    JSON_OPTIONS,
    MAX_STEP_CPU_S,
    VALIDATION_WALK_TOKENS,
    grammar_of,
    lltokenizer_from_hf,
    parser_limits,
)
from shared.model_source import DEFAULT_MODEL, resolve_model
from shared.protocol import Constraint

PROPERTY_COUNTS = (500, 1000, 2000, 4000)
STEP_TOKENS = 64
TYPICAL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "role"],
}


def cpu_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median thread CPU milliseconds of `fn()`."""
    times = []
    for _ in range(repeats):
        started = time.thread_time()
        fn()
        times.append((time.thread_time() - started) * 1000)
    return statistics.median(times)


def compile_and_first_mask(grammar: str, tokenizer: llguidance.LLTokenizer) -> None:
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    matcher.compute_bitmask()


def allowed_tokens(mask: bytes, eos: set[int]) -> list[int]:
    bits = numpy.unpackbits(numpy.frombuffer(mask, dtype=numpy.uint8), bitorder="little")
    return [int(t) for t in numpy.flatnonzero(bits) if int(t) not in eos]


def walk(grammar: str, tokenizer: llguidance.LLTokenizer) -> bool:
    """Compile and walk as `validate` does (up to VALIDATION_WALK_TOKENS tokens from the
    middle of each mask); whether the matcher failed (out of fuel, for a bomb)."""
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    eos = set(tokenizer.eos_tokens)
    for _ in range(VALIDATION_WALK_TOKENS):
        allowed = allowed_tokens(matcher.compute_bitmask(), eos)
        if matcher.is_error() or not allowed:
            break
        matcher.consume_token(allowed[len(allowed) // 2])
        if matcher.is_error() or matcher.is_stopped():
            break
    return matcher.is_error()


def properties_grammar(count: int) -> str:
    """One object of `count` optional integer properties, compiled as `grammar_of` would
    but past MAX_SCHEMA_PROPERTIES, which `grammar_of` refuses."""
    properties = {f"p{i}": {"type": "integer"} for i in range(count)}
    schema = {"type": "object", "properties": properties}
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


def step_ms(tokenizer: llguidance.LLTokenizer) -> list[float]:
    """Thread CPU ms of each mask + token step along one walk of TYPICAL_SCHEMA (choosing
    the token, in Python here, is not counted)."""
    constraint = Constraint(kind="json_schema", spec=json.dumps(TYPICAL_SCHEMA))
    matcher = llguidance.LLMatcher(
        tokenizer, grammar_of(constraint), log_level=0, limits=parser_limits()
    )
    mask = matcher.compute_bitmask()  # the first mask is part of compiling
    eos = set(tokenizer.eos_tokens)
    times = []
    for _ in range(STEP_TOKENS):
        allowed = allowed_tokens(mask, eos)
        if not allowed or matcher.is_stopped():
            break
        started = time.thread_time()
        matcher.consume_token(allowed[len(allowed) // 2])
        mask = matcher.compute_bitmask()
        times.append((time.thread_time() - started) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per case; the median counts")
    args = parser.parse_args()

    tok = Tokenizer.from_source(resolve_model(DEFAULT_MODEL))
    started, wall_started = time.thread_time(), time.perf_counter()
    lltok = lltokenizer_from_hf(tok.hf, vocab_size=tok.vocab_size, eos_token_ids=None)
    cpu, wall = time.thread_time() - started, time.perf_counter() - wall_started
    rows = [f"| build llguidance's tokenizer (SmolLM2; wall {wall:.2f} s) | {cpu:.2f} s |"]
    for count in PROPERTY_COUNTS:
        grammar = properties_grammar(count)
        ms = cpu_ms(lambda g=grammar: compile_and_first_mask(g, lltok), args.repeats)
        rows.append(f"| compile + first mask, {count:,} optional properties | {ms / 1000:.2f} s |")
    bomb = grammar_of(Constraint(kind="regex", spec="a{1000000}"))
    assert walk(bomb, lltok), "the bomb did not run out of fuel"
    ms = cpu_ms(lambda: walk(bomb, lltok), args.repeats)
    rows.append(
        f"| regex bomb `a{{1000000}}` until its fuel ({INITIAL_LEXER_FUEL:,}) runs out "
        f"| {ms:.0f} ms |"
    )
    steps = step_ms(lltok)
    rows.append(
        f"| mask + token step, nested schema (median / max of {len(steps)}) "
        f"| {statistics.median(steps):.2f} / {max(steps):.2f} ms |"
    )
    for row in rows:
        print(row)
    body = (
        "## Constraint costs (bench/constraints.py)\n\n"
        f"`{command_line()}` — Python {platform.python_version()}, {platform.machine()}; "
        "this thread's CPU time, medians. What `shared/constraints.py`'s limits rest on: "
        "compiling optional properties grows quadratically (MAX_SCHEMA_PROPERTIES), a bomb "
        f"stops at its fuel, and a typical step is far inside MAX_STEP_CPU_S "
        f"({MAX_STEP_CPU_S * 1000:.0f} ms).\n\n"
        "| case | CPU |\n|---|---:|\n" + "\n".join(rows)
    )
    write_section("constraints", body)


if __name__ == "__main__":
    main()
