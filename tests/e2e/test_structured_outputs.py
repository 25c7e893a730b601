"""Structured outputs across the split, driven by the `openai` SDK: response_format,
vLLM's structured_outputs and guided_* fields, streamed and not; constraints that do not
compile are a 400 naming the field and never reach a worker."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI

from tests.helpers.processes import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
PERSON_QUESTION = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}


def test_json_schema_response_format(client: OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=PERSON_QUESTION,
        max_tokens=80,
        temperature=0.8,
        seed=7,
        response_format=RESPONSE_FORMAT,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_schema_response_format_streamed(client: OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=PERSON_QUESTION,
        max_tokens=80,
        temperature=1.0,
        seed=3,
        response_format=RESPONSE_FORMAT,
        stream=True,
    )
    chunks = [chunk for chunk in stream if chunk.choices]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_response_format(client: OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_structured_outputs_regex(client: OpenAI) -> None:
    pattern = r"[0-9]{3}-[0-9]{4}"
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a phone number."}],
        max_tokens=20,
        temperature=1.0,
        seed=1,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert re.fullmatch(pattern, reply.choices[0].message.content)
    assert reply.choices[0].finish_reason == "stop"


def test_disable_additional_properties_keeps_to_the_listed_keys(client: OpenAI) -> None:
    """vLLM's option closes an object that leaves additionalProperties out."""
    schema = {key: value for key, value in PERSON.items() if key != "additionalProperties"}
    reply = client.chat.completions.create(
        model=MODEL,
        messages=PERSON_QUESTION,
        max_tokens=80,
        temperature=1.0,
        seed=5,
        n=4,
        extra_body={"structured_outputs": {"json": schema, "disable_additional_properties": True}},
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        assert set(json.loads(choice.message.content)) == {"name", "age", "pets"}


def test_structured_outputs_choice_with_n(client: OpenAI) -> None:
    choices = ["sunny", "rainy", "snowy"]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather like?"}],
        max_tokens=10,
        temperature=1.0,
        n=3,
        seed=5,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert len(reply.choices) == 3
    for choice in reply.choices:
        assert choice.message.content in choices
        assert choice.finish_reason == "stop"


def test_completions_with_guided_choice(client: OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL,
        prompt="Is the sky blue? Answer:",
        max_tokens=10,
        temperature=0,
        extra_body={"guided_choice": [" yes", " no"]},
    )
    assert reply.choices[0].text in (" yes", " no")


def test_grammar(client: OpenAI) -> None:
    grammar = 'start: "(" num (" + " num)? ")"\nnum: /[1-9][0-9]?/'
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Add two numbers."}],
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)?\)", reply.choices[0].message.content)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"structured_outputs": {"regex": "([a-z]"}}, "structured_outputs"),
        # llguidance compiles these; Python's `re` (and vLLM since its advisory) does not.
        ({"structured_outputs": {"regex": "foo**"}}, "structured_outputs"),
        ({"guided_regex": "[0-9]+*"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "(a{100}){100}{100}"}, "guided_regex"),  # a bomb: out of fuel
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ],
)
def test_constraints_that_do_not_compile_are_400(
    render: ServerProcess, extra: dict, param: str
) -> None:
    body = {"model": MODEL, "messages": PERSON_QUESTION, "max_tokens": 8, **extra}
    before = _worker_requests(render)
    response = httpx.post(f"{render.base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert _worker_requests(render) == before  # nothing reached a worker


def test_sdk_raises_bad_request_for_a_bad_schema(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=PERSON_QUESTION,
            max_tokens=8,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "required": 3}},
            },
        )
    assert info.value.body["param"] == "response_format"


def test_sdk_raises_bad_request_for_a_repeated_repeat(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL,
            prompt="Say foo:",
            max_tokens=4,
            extra_body={"structured_outputs": {"regex": "foo**"}},
        )
    assert info.value.body["param"] == "structured_outputs"
    assert "multiple repeat" in info.value.body["message"]


def _worker_requests(render: ServerProcess) -> float:
    """Requests this render server routed to workers so far, from its metrics."""
    metrics = httpx.get(f"{render.base_url}/metrics").text
    counts = re.findall(r"^duet_render_requests_routed_total\{[^}]*\} (\S+)$", metrics, re.M)
    return sum(float(count) for count in counts)
