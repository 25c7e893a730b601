"""Structured outputs in the render tier: read the one constraint a request asks for, and
compile it against the model's tokenizer before anything reaches a worker.

A request names its constraint in one of these fields (at most one; two are a 400):
- `response_format`: {"type": "json_object"}, {"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}, or {"type": "text"} (no constraint) — OpenAI's;
- `structured_outputs`: {"json" | "regex" | "choice" | "grammar" | "json_object": ...} — vLLM's,
  whose `disable_additional_properties` closes the JSON schema's objects (`_closed`);
- `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` — vLLM's older names.

Compilation (shared.constraints.validate, llguidance) runs on a small dedicated thread
pool under a deadline, so a hostile grammar costs its own request a 400 and never blocks
the event loop or the threads other requests use. llguidance's parser limits bound that
work too, the same limits the worker builds its matchers with.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import llguidance
import msgspec

from render_server.schemas.errors import ApiError
from shared.constraints import lltokenizer_from_hf, validate
from shared.json_schema import close_objects
from shared.protocol import MAX_CONSTRAINT_CHARS, Constraint, ConstraintKind

if TYPE_CHECKING:
    from render_server.schemas.generation import SamplingFields, StructuredOutputsField
    from render_server.templating.tokenizer import Tokenizer

VALIDATION_TIMEOUT_S = 2.0
MAX_VALIDATION_THREADS = 4

_GUIDED_FIELDS: dict[str, ConstraintKind] = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_STRUCTURED_OUTPUTS_KEYS: dict[str, ConstraintKind] = {
    "json_": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


class ConstraintValidator:
    """Compiles constraints against one tokenizer off the event loop, under a deadline."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        timeout_s: float = VALIDATION_TIMEOUT_S,
        max_threads: int = MAX_VALIDATION_THREADS,
    ) -> None:
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        threads = max(1, min(max_threads, os.cpu_count() or 1))
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="constraint-check")
        self._lltokenizer: Future[llguidance.LLTokenizer] | None = None

    async def check(self, constraint: Constraint) -> str | None:
        """None if the constraint compiles, else why not (a message for the client)."""
        if self._lltokenizer is None:
            # Built once, outside the deadline: that cost is not the request's fault (its time:
            # bench/RESULTS.md, Constraint costs).
            tokenizer = self.tokenizer
            self._lltokenizer = self._executor.submit(
                lltokenizer_from_hf,
                tokenizer.hf,
                vocab_size=tokenizer.vocab_size,
                eos_token_ids=tokenizer.eos_token_ids,
            )
        lltokenizer = await asyncio.wrap_future(self._lltokenizer)
        work = asyncio.get_running_loop().run_in_executor(
            self._executor, validate, constraint, lltokenizer
        )
        try:
            return await asyncio.wait_for(work, self.timeout_s)
        except TimeoutError:
            # The thread runs on until llguidance's fuel runs out; only this request waits.
            return f"constraint too complex: it did not compile within {self.timeout_s:g} s"


async def resolve_constraint(
    validator: ConstraintValidator, body: SamplingFields
) -> Constraint | None:
    """The request's constraint, compiled and checked; ApiError 400 naming the field."""
    found = constraint_from_request(body)
    if found is None:
        return None
    constraint, param = found
    error = await validator.check(constraint)
    if error is not None:
        raise ApiError(400, f"{param}: {error}", param=param, code="invalid_constraint")
    return constraint


def constraint_from_request(body: SamplingFields) -> tuple[Constraint, str] | None:
    """(constraint, the field that set it) from the request fields, unchecked, or None."""
    found: list[tuple[Constraint, str]] = []
    if "response_format" in body.model_fields_set and body.response_format is not None:
        constraint = _from_response_format(body.response_format)
        if constraint is not None:
            found.append((constraint, "response_format"))
    options = body.structured_outputs
    if options is not None:
        _refuse_unsupported(options)
        for key, kind in _STRUCTURED_OUTPUTS_KEYS.items():
            value = getattr(options, key)
            if value is not None:
                found.append((_constraint(kind, value, "structured_outputs"), "structured_outputs"))
        if options.json_object:
            found.append((Constraint(kind="json_object"), "structured_outputs"))
    for field, kind in _GUIDED_FIELDS.items():
        value = getattr(body, field)
        if value is not None:
            found.append((_constraint(kind, value, field), field))
    if len(found) > 1:
        names = ", ".join(dict.fromkeys(param for _, param in found))
        param = found[1][1]
        raise ApiError(
            400,
            f"{param}: a request takes at most one structured-output constraint; got {names}.",
            param=param,
        )
    if not found:
        return None
    constraint, param = found[0]
    if options is not None and options.disable_additional_properties:
        constraint = _closed(constraint)
    return constraint, param


def _refuse_unsupported(options: StructuredOutputsField) -> None:
    """400 naming the first `structured_outputs` backend option set that is not honoured."""
    unsupported = [
        name
        for name, value in (
            ("structural_tag", options.structural_tag is not None),
            ("whitespace_pattern", options.whitespace_pattern is not None),
            ("disable_any_whitespace", options.disable_any_whitespace),
            ("disable_fallback", options.disable_fallback),
        )
        if value
    ]
    if unsupported:
        raise ApiError(
            400,
            f"structured_outputs.{unsupported[0]} is not supported.",
            param=f"structured_outputs.{unsupported[0]}",
            code="unsupported_parameter",
        )


def _closed(constraint: Constraint) -> Constraint:
    """vLLM's `disable_additional_properties`: the request's JSON schema (whichever field
    set it) with every object that lists properties and does not say
    `additionalProperties` closed. Other kinds have no objects to close. A schema that does
    not parse is left for validation to refuse."""
    if constraint.kind != "json_schema":
        return constraint
    try:
        schema = json.loads(constraint.spec)
        if not isinstance(schema, dict):
            return constraint
        closed = close_objects(schema, bare_objects=False)
    except (ValueError, RecursionError):
        return constraint
    return msgspec.structs.replace(constraint, spec=json.dumps(closed, ensure_ascii=False))


def _from_response_format(value: Any) -> Constraint | None:
    param = "response_format"
    if not isinstance(value, dict):
        raise ApiError(400, "response_format must be an object with a `type`.", param=param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(kind="json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ApiError(
                400, "response_format.json_schema must be an object with a `schema`.", param=param
            )
        schema = spec.get("schema")
        if schema is None:
            raise ApiError(400, "response_format.json_schema.schema is missing.", param=param)
        return _constraint("json_schema", schema, param)
    raise ApiError(
        400,
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}.",
        param=param,
    )


def _constraint(kind: ConstraintKind, value: Any, param: str) -> Constraint:
    """A Constraint of `kind` from a request value, with its size bounded."""
    if kind == "json_schema":
        if isinstance(value, str):
            spec = value
        elif isinstance(value, dict):
            spec = json.dumps(value, ensure_ascii=False)
        else:
            raise ApiError(400, f"{param}: a JSON schema must be an object.", param=param)
    elif kind == "choice":
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise ApiError(400, f"{param}: choice must be a list of strings.", param=param)
        spec = json.dumps(value, ensure_ascii=False)
    elif isinstance(value, str):
        spec = value
    else:
        raise ApiError(400, f"{param}: must be a string.", param=param)
    if len(spec) > MAX_CONSTRAINT_CHARS:
        raise ApiError(
            400,
            f"{param}: the constraint has {len(spec)} characters; at most "
            f"{MAX_CONSTRAINT_CHARS} are accepted.",
            param=param,
        )
    if kind == "regex":
        _check_regex(spec, param)
    return Constraint(kind=kind, spec=spec)


# Syntax llguidance's (Rust-style) regexes have and Python's `re` lacks: not errors here.
_RUST_ONLY_SYNTAX = ("bad escape", "unknown extension ?<")


def _check_regex(pattern: str, param: str) -> None:
    """A 400 for a pattern Python's `re` rejects: llguidance accepts some invalid ones
    (`foo**`, a repeat of a repeat) and would constrain to something the client never
    wrote, as vLLM's advisory found. Compiling is linear in the pattern's length, which is
    bounded above."""
    try:
        re.compile(pattern)
    except re.error as exc:
        if not str(exc).startswith(_RUST_ONLY_SYNTAX):
            raise ApiError(
                400, f"{param}: invalid regex: {exc}.", param=param, code="invalid_constraint"
            ) from exc
    except (RecursionError, OverflowError) as exc:  # nesting or a count past re's range
        raise ApiError(
            400, f"{param}: invalid regex: {exc}.", param=param, code="invalid_constraint"
        ) from exc


async def check_constraint(
    validator: ConstraintValidator, constraint: Constraint, param: str
) -> Constraint:
    """Validate a constraint built by the server (tool choice); 400 naming `param`."""
    error = await validator.check(constraint)
    if error is not None:
        raise ApiError(400, f"{param}: {error}", param=param, code="invalid_constraint")
    return constraint
