"""Closed objects (shared.json_schema): the grammars of tool-call arguments and of
`disable_additional_properties` refuse unlisted and repeated keys, and keep what a schema
allows explicitly; the rewrite leaves compositions it would change alone."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import pytest

from render_server.generation.structured import constraint_from_request
from render_server.parsing.tool_choice import plan_tools
from render_server.schemas.errors import ApiError
from render_server.schemas.generation import ChatCompletionRequest
from shared.constraints import grammar_of, lltokenizer_from_hf, parser_limits
from shared.json_schema import close_objects, rebase_refs
from shared.protocol import Constraint

OPEN = {  # as LangChain's @tool and instructor write a schema: no additionalProperties
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}


@pytest.fixture(scope="module")
def lltokenizer(smollm2_tokenizer: Any) -> llguidance.LLTokenizer:
    tok = smollm2_tokenizer
    return lltokenizer_from_hf(tok.hf, vocab_size=tok.vocab_size, eos_token_ids=tok.eos_token_ids)


def accepts(constraint: Constraint, text: str, tokenizer: llguidance.LLTokenizer) -> bool:
    """Whether the constraint's grammar takes `text` as a whole output."""
    matcher = llguidance.LLMatcher(tokenizer, grammar_of(constraint), limits=parser_limits())
    assert not matcher.is_error(), matcher.get_error()
    tokens = tokenizer.tokenize_str(text)
    return matcher.consume_tokens(tokens) and not matcher.is_error() and matcher.is_accepting()


def named(parameters: dict[str, Any]) -> Constraint:
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    choice = {"type": "function", "function": {"name": "f"}}
    plan = plan_tools(tools, choice, None, enable_auto_tool_choice=False, tool_call_parser=None)
    assert plan.constraint is not None
    return plan.constraint


def required(parameters: dict[str, Any]) -> Constraint:
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    plan = plan_tools(tools, "required", None, enable_auto_tool_choice=False, tool_call_parser=None)
    assert plan.constraint is not None
    return plan.constraint


LISTED = '{"city": "Paris", "days": 2}'
UNLISTED = '{"city": "Paris", "note": "x"}'
REPEATED = '{"city": "Paris", "note": "x", "note": "y"}'
REPEATED_LISTED = '{"city": "Paris", "city": "Rome"}'


def test_named_arguments_refuse_unlisted_and_repeated_keys(lltokenizer: Any) -> None:
    constraint = named(OPEN)
    assert accepts(constraint, LISTED, lltokenizer)
    assert accepts(constraint, '{"city": "Paris"}', lltokenizer)
    for text in (UNLISTED, REPEATED, REPEATED_LISTED):
        assert not accepts(constraint, text, lltokenizer), text
    # The schema as sent, read as JSON Schema reads it, took them: what this fixes.
    as_sent = Constraint(kind="json_schema", spec=json.dumps(OPEN))
    assert accepts(as_sent, UNLISTED, lltokenizer)
    assert accepts(as_sent, REPEATED, lltokenizer)


def test_required_calls_refuse_unlisted_and_repeated_keys(lltokenizer: Any) -> None:
    constraint = required(OPEN)
    call = '[{{"name": "f", "parameters": {}}}]'
    assert accepts(constraint, call.format(LISTED), lltokenizer)
    for text in (UNLISTED, REPEATED, REPEATED_LISTED):
        assert not accepts(constraint, call.format(text), lltokenizer), text


def test_nested_and_bare_objects_are_closed(lltokenizer: Any) -> None:
    nested = {
        "type": "object",
        "properties": {"where": {"type": "object", "properties": {"city": {"type": "string"}}}},
    }
    constraint = named(nested)
    assert accepts(constraint, '{"where": {"city": "Paris"}}', lltokenizer)
    assert not accepts(constraint, '{"where": {"city": "Paris", "zip": 1}}', lltokenizer)
    for no_parameters in ({}, {"type": "object"}, {"type": "object", "properties": {}}):
        constraint = named(no_parameters)
        assert accepts(constraint, "{}", lltokenizer)
        assert not accepts(constraint, '{"a": 1}', lltokenizer)


def test_explicitly_open_objects_keep_their_keys(lltokenizer: Any) -> None:
    for allowed in (True, {"type": "string"}):
        constraint = named({**OPEN, "additionalProperties": allowed})
        assert accepts(constraint, UNLISTED, lltokenizer)
        assert not accepts(constraint, REPEATED_LISTED, lltokenizer)
    typed = named({**OPEN, "additionalProperties": {"type": "integer"}})
    assert not accepts(typed, UNLISTED, lltokenizer)
    assert accepts(typed, '{"city": "Paris", "n": 1}', lltokenizer)


def _request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"structured_outputs": {"json": OPEN, "disable_additional_properties": True}},
        {"structured_outputs": {"json": json.dumps(OPEN), "disable_additional_properties": True}},
        {
            "response_format": {"type": "json_schema", "json_schema": {"schema": OPEN}},
            "structured_outputs": {"disable_additional_properties": True},
        },
        {"guided_json": OPEN, "structured_outputs": {"disable_additional_properties": True}},
    ],
)
def test_disable_additional_properties_closes_the_requests_schema(
    fields: dict[str, Any], lltokenizer: Any
) -> None:
    found = constraint_from_request(_request(**fields))
    assert found is not None
    constraint, _ = found
    assert json.loads(constraint.spec) == {**OPEN, "additionalProperties": False}
    assert accepts(constraint, LISTED, lltokenizer)
    assert not accepts(constraint, UNLISTED, lltokenizer)


def test_without_the_flag_a_requests_schema_is_kept_as_sent() -> None:
    found = constraint_from_request(_request(structured_outputs={"json": OPEN}))
    assert found is not None
    assert json.loads(found[0].spec) == OPEN
    regex = _request(structured_outputs={"regex": "a+", "disable_additional_properties": True})
    found = constraint_from_request(regex)
    assert found is not None
    assert found[0].spec == "a+"


def test_vllm_rule_leaves_bare_objects_open() -> None:
    schema = {"type": "object", "properties": {"meta": {"type": "object"}}}
    closed = close_objects(schema, bare_objects=False)
    assert closed == {**schema, "additionalProperties": False}
    assert "additionalProperties" not in closed["properties"]["meta"]
    assert schema == {"type": "object", "properties": {"meta": {"type": "object"}}}  # a copy


def test_closing_leaves_compositions_it_would_change_alone() -> None:
    inner = {"type": "object", "properties": {"x": {"type": "string"}}}
    schema = {
        "type": "object",
        "properties": {
            "both": {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": inner}}]},
            "either": {"anyOf": [inner, {"type": "null"}]},
            "ref": {"$ref": "#/$defs/M"},
            "loose": {"type": "object", "properties": {"a": {}}, "required": ["b"]},
            "never": {"not": inner},
        },
        "$defs": {"M": inner},
    }
    closed = close_objects(schema, bare_objects=True)
    props = closed["properties"]
    both = props["both"]
    assert "additionalProperties" not in both
    assert all("additionalProperties" not in member for member in both["allOf"])
    # A property of an allOf member is another instance: closed on its own terms.
    assert both["allOf"][1]["properties"]["b"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in props["ref"]
    assert "additionalProperties" not in props["loose"]
    assert "additionalProperties" not in props["never"]["not"]
    assert closed["$defs"]["M"]["additionalProperties"] is False
    assert closed["additionalProperties"] is False


def test_a_schema_too_deep_to_copy_is_a_400_naming_tools() -> None:
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(ApiError) as info:
        named(deep)
    assert (info.value.status_code, info.value.info.param) == (400, "tools")


NESTED_MODEL = {  # as pydantic writes a model with a nested model: "#/$defs/Address"
    "$defs": {
        "Address": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        }
    },
    "type": "object",
    "properties": {"name": {"type": "string"}, "home": {"$ref": "#/$defs/Address"}},
    "required": ["name", "home"],
}


def test_required_calls_resolve_a_tools_refs(lltokenizer: Any) -> None:
    """Nested in the array of calls, a tool's "#/$defs/Address" named the root of that
    array, which has no such definition: every required call with such a tool was a 400."""
    constraint = required(NESTED_MODEL)
    call = '[{"name": "f", "parameters": {"name": "Ann", "home": {"city": "Oslo"}}}]'
    assert accepts(constraint, call, lltokenizer)
    extra = '[{"name": "f", "parameters": {"name": "Ann", "home": {"city": "Oslo", "x": 1}}}]'
    assert not accepts(constraint, extra, lltokenizer)  # the definition is closed too
    assert not accepts(constraint, '[{"name": "f", "parameters": {"name": "Ann"}}]', lltokenizer)


def test_rebased_refs_keep_the_root_and_outside_refs() -> None:
    schema = {
        "type": "object",
        "properties": {
            "self": {"$ref": "#"},
            "other": {"$ref": "https://example.com/schema.json"},
            "note": {"const": {"$ref": "#/not/a/ref"}},
        },
    }
    rebased = rebase_refs(schema, "#/$defs/tool0")
    props = rebased["properties"]
    assert props["self"] == {"$ref": "#/$defs/tool0"}
    assert props["other"] == {"$ref": "https://example.com/schema.json"}
    assert props["note"] == {"const": {"$ref": "#/not/a/ref"}}
    assert schema["properties"]["self"] == {"$ref": "#"}  # the original is untouched
