"""JSON Schema rewrites applied before a schema becomes a grammar.

JSON Schema allows unlisted properties unless an object says `additionalProperties: false`,
and most tool definitions (LangChain's `@tool`, instructor, plain OpenAI ones) leave it
out. A grammar that allows them lets a model add keys until max_tokens; llguidance emits
the listed properties once each, in order, but any number of unlisted ones, the same key
again included. `close_objects` writes the `false` in: for tool-call arguments always
(OpenAI's strict mode reads schemas this way), and for a request's JSON schema when it
sets vLLM's `structured_outputs.disable_additional_properties`.
"""

from __future__ import annotations

import json
from typing import Any

_COMPOSITIONS = ("allOf", "anyOf", "oneOf")
_NOT_SCHEMAS = frozenset({"enum", "const", "default", "examples", "required", "not", "if"})
"""Keywords whose values are data, not schemas, or schemas whose meaning closing would
invert (`not`) or shift (an `if` condition)."""


def close_objects(schema: dict[str, Any], *, bare_objects: bool) -> dict[str, Any]:
    """A copy of `schema` where each object schema without `additionalProperties` gets
    `additionalProperties: false`.

    vLLM's rule closes an object that lists `properties` or `patternProperties`; with
    `bare_objects`, one that only says `"type": "object"` is closed too (it then admits
    `{}` only, as a strict-mode tool without parameters does). An object is left open
    where closing it would change what the schema means rather than what it permits: a
    member of an `allOf` (each member's `false` would refuse the other members'
    properties), one combined with `allOf`/`anyOf`/`oneOf` or `$ref` (the listed
    properties are not all of them), and one whose `required` names an unlisted key.
    ValueError when the schema nests too deeply to copy.
    """
    try:
        closed = json.loads(json.dumps(schema))  # a copy without Python-level recursion
    except RecursionError:
        raise ValueError("the JSON schema is nested too deeply") from None
    _walk(closed, bare_objects=bare_objects)
    return closed


def _walk(schema: dict[str, Any], *, bare_objects: bool) -> None:
    # An explicit stack rather than recursion: a schema may nest as deep as json.loads
    # allows. `shared` is whether the item describes the same instance as an `allOf`
    # member does (the member, or a branch of one); a property's or an item's schema
    # describes another instance, and is closed on its own terms.
    stack: list[tuple[object, bool]] = [(schema, False)]
    while stack:
        item, shared = stack.pop()
        if isinstance(item, list):
            stack.extend((child, shared) for child in item)
            continue
        if not isinstance(item, dict):
            continue
        branches_shared = shared or isinstance(item.get("allOf"), list)
        for key, child in item.items():
            if key in _COMPOSITIONS:
                stack.append((child, branches_shared))
            elif key in ("properties", "patternProperties", "$defs", "definitions"):
                # Maps of names to schemas: the names are not keywords.
                if isinstance(child, dict):
                    stack.extend((value, False) for value in child.values())
            elif key not in _NOT_SCHEMAS:
                stack.append((child, False))
        if not shared and _should_close(item, bare_objects):
            item["additionalProperties"] = False


def _should_close(schema: dict[str, Any], bare_objects: bool) -> bool:
    if "additionalProperties" in schema or "$ref" in schema:
        return False
    if any(isinstance(schema.get(keyword), list) for keyword in _COMPOSITIONS):
        return False
    properties = schema.get("properties")
    listed = isinstance(properties, dict) or isinstance(schema.get("patternProperties"), dict)
    kind = schema.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind)
    if not listed and not (bare_objects and is_object):
        return False
    required = schema.get("required")
    if isinstance(required, list) and not isinstance(schema.get("patternProperties"), dict):
        names = properties if isinstance(properties, dict) else {}
        if any(isinstance(name, str) and name not in names for name in required):
            return False
    return True


def has_refs(schema: object) -> bool:
    """Whether a `$ref` appears anywhere in `schema`."""
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("$ref"), str):
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def rebase_refs(schema: dict[str, Any], pointer: str) -> dict[str, Any]:
    """A copy of `schema` whose document-local `$ref`s ("#", "#/...") resolve from
    `pointer` ("#/$defs/name"), for a schema that is moved there inside a larger one (a
    `required` tool choice nests every tool's parameters in one array schema, where the
    tool's own "#/$defs/A" would point at nothing). Other refs are left as they are."""
    rebased = json.loads(json.dumps(schema))
    stack: list[object] = [rebased]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
            continue
        if not isinstance(item, dict):
            continue
        ref = item.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            item["$ref"] = pointer + ref[1:]
        for key, child in item.items():
            if key not in ("enum", "const", "default", "examples"):
                stack.append(child)
    return rebased
