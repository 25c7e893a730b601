"""The OpenAI Responses API through real processes and the real `openai` SDK (and the
OpenAI Agents SDK's default Responses model): create, stream, store, continue, retrieve,
delete, cancel, reasoning summaries, the render, and the 4xx of bad input."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from tests.helpers.processes import ServerProcess, WorkerProcess, running_render

MODEL = "SmolLM2-135M-Instruct"
ASK = "What is the capital of France?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
PARSERS = ["--chat-template", "chatml_tools", "--enable-auto-tool-choice"]
PARSERS += ["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
THINK = r"<think>[a-z ]{3,20}</think>[A-Z][a-z]{2,8}"
KEYS = ("key-a", "key-b")


@pytest.fixture(scope="module")
def reasoning(
    worker_a: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = [*PARSERS, "--structured-outputs-in-reasoning"]
    yield from running_render([worker_a], tmp_path_factory.mktemp("responses-reasoning"), args)


@pytest.fixture(scope="module")
def keyed(
    worker_a: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = [arg for key in KEYS for arg in ("--api-key", key)]
    yield from running_render([worker_a], tmp_path_factory.mktemp("responses-keys"), args)


def get_weather(city: Literal["Paris", "London"]) -> str:
    """Current weather of a city."""
    return f"It is sunny in {city}."


def _client(server: ServerProcess, key: str = "unused") -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def _post(server: ServerProcess, body: dict[str, Any], key: str = "unused") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{server.base_url}/v1/responses", json=body, headers=headers, timeout=60)


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) <= {"message", "type", "param", "code"}
    return error


def test_create_plain_text(client: OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input=ASK, max_output_tokens=12, temperature=0, metadata={"k": "v"}
    )
    assert response.id.startswith("resp_")
    assert response.object == "response"
    assert response.status in ("completed", "incomplete")
    [message] = response.output
    assert message.type == "message"
    assert message.id.startswith("msg_")
    assert message.role == "assistant"
    assert response.output_text
    assert response.usage is not None
    assert response.usage.output_tokens <= 12
    assert response.usage.total_tokens == (
        response.usage.input_tokens + response.usage.output_tokens
    )
    assert response.metadata == {"k": "v"}
    assert response.max_output_tokens == 12


def test_length_cut_is_incomplete(client: OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input=ASK, max_output_tokens=2, temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"


def test_greedy_text_equals_chat_completions(client: OpenAI) -> None:
    instructions = "You are terse."
    response = client.responses.create(
        model=MODEL, instructions=instructions, input=ASK, max_output_tokens=16, temperature=0
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": instructions}, {"role": "user", "content": ASK}],
        max_tokens=16,
        temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content


def test_json_schema_text_format(client: OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=MODEL,
        input="Name a city as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
        max_output_tokens=30,
        temperature=0,
    )
    assert response.status == "completed", response
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text is not None
    assert response.text.format is not None
    assert response.text.format.type == "json_schema"


def test_function_tool_round_trip(client: OpenAI) -> None:
    first = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=30,
        temperature=0,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls, first.output
    call = calls[0]
    assert call.id is not None
    assert call.id.startswith("fc_")
    assert call.call_id.startswith("call_")
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."}],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=10,
        temperature=0,
    )
    assert second.output_text
    assert second.previous_response_id == first.id
    # The same history, sent whole (no previous_response_id): function_call items too.
    whole = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."},
        ],  # fmt: skip
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=10,
        temperature=0,
        store=False,
    )
    assert whole.output_text == second.output_text


def test_previous_response_chain_of_three(client: OpenAI) -> None:
    one = client.responses.create(
        model=MODEL, input="My name is Ada.", max_output_tokens=8, temperature=0
    )
    two = client.responses.create(
        model=MODEL,
        previous_response_id=one.id,
        input="What is my name?",
        max_output_tokens=8,
        temperature=0,
    )
    three = client.responses.create(
        model=MODEL,
        previous_response_id=two.id,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Again?"}]}],
        max_output_tokens=8,
        temperature=0,
    )
    assert three.previous_response_id == two.id
    # The third turn's prompt holds both earlier turns: it is the longest.
    assert one.usage
    assert two.usage
    assert three.usage
    assert one.usage.input_tokens < two.usage.input_tokens < three.usage.input_tokens
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": one.output_text},
            {"role": "user", "content": "What is my name?"},
            {"role": "assistant", "content": two.output_text},
            {"role": "user", "content": "Again?"},
        ],
        max_tokens=8,
        temperature=0,
    )
    assert three.output_text == chat.choices[0].message.content


def test_stream_events_in_order(client: OpenAI) -> None:
    with client.responses.stream(
        model=MODEL, input=ASK, max_output_tokens=16, temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert final.status in ("completed", "incomplete")
    assert kinds[-1] == f"response.{final.status}"
    numbers = [event.sequence_number for event in events]
    assert numbers == sorted(numbers)
    assert len(set(numbers)) == len(numbers)
    for expected in (
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ):
        assert expected in kinds, kinds
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_raw_stream_has_named_events_and_no_done(client: OpenAI, render: ServerProcess) -> None:
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 4, "stream": True, "store": False}
    response = _post(render, body)
    assert response.status_code == 200
    text = response.text
    assert "[DONE]" not in text
    blocks = [block for block in text.strip().split("\n\n") if block]
    for block in blocks:
        event_line, data_line = block.split("\n")
        kind = event_line.removeprefix("event: ")
        assert json.loads(data_line.removeprefix("data: "))["type"] == kind
    assert blocks[-1].startswith("event: response.")


def test_retrieve_and_delete(client: OpenAI) -> None:
    response = client.responses.create(model=MODEL, input=ASK, max_output_tokens=4)
    assert client.responses.retrieve(response.id).output_text == response.output_text
    client.responses.delete(response.id)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(NotFoundError):
        client.responses.delete(response.id)
    not_stored = client.responses.create(model=MODEL, input=ASK, max_output_tokens=2, store=False)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(not_stored.id)


CONVERSATION: list[Any] = [
    {"role": "developer", "content": "Answer in one word."},
    {"type": "message", "id": "msg_mine", "role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
    {"role": "user", "content": [{"type": "input_text", "text": "And another?"}]},
    {"role": "user", "content": "One word."},
]


def test_input_items_are_listed_a_page_at_a_time(client: OpenAI, render: ServerProcess) -> None:
    response = client.responses.create(model=MODEL, input=CONVERSATION, max_output_tokens=2)
    # The SDK pages on by `after` = the last id of each page: three pages of two.
    items = list(client.responses.input_items.list(response.id, limit=2))
    assert [(item.type, getattr(item, "role", None)) for item in items] == [
        ("message", "user"),
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
        ("message", "developer"),
    ]  # desc: the last input first
    ids = [item.id for item in items]
    assert len(set(ids)) == 5
    assert ids[3] == "msg_mine"
    assert items[0].content[0].type == "input_text"
    assert items[0].content[0].text == "One word."
    assert items[2].content[0].type == "output_text"
    assert items[2].content[0].text == "Blue."
    first = client.responses.input_items.list(response.id, limit=2, order="asc")
    assert [item.id for item in first.data] == [ids[4], ids[3]]
    assert (first.first_id, first.last_id, first.has_more) == (ids[4], ids[3], True)
    last = client.responses.input_items.list(
        response.id, after=ids[1], include=["reasoning.encrypted_content"]
    )
    assert ([item.id for item in last.data], last.has_more) == ([ids[2], ids[3], ids[4]], False)
    url = f"{render.base_url}/v1/responses/{response.id}/input_items"
    before = httpx.get(url, params={"before": ids[2], "limit": 1}, timeout=10).json()
    assert before["object"] == "list"
    assert ([item["id"] for item in before["data"]], before["has_more"]) == ([ids[1]], True)
    for params, param in (
        ({"limit": 0}, "limit"),
        ({"limit": 101}, "limit"),
        ({"after": "x"}, "after"),
        ({"order": "up"}, "order"),
        ({"include": "nope"}, "include.0"),
    ):
        error = _error(httpx.get(url, params=params, timeout=10), 400)
        assert error["param"] == param, error


def test_input_items_carry_the_earlier_turns_of_a_chain(client: OpenAI) -> None:
    """As OpenAI lists them: a response continuing `previous_response_id` was generated
    from the earlier turns' input and output items too."""
    first = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=2)
    second = client.responses.create(
        model=MODEL, input="And another?", previous_response_id=first.id, max_output_tokens=2
    )
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [(item.type, item.role) for item in items] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    [first_input] = client.responses.input_items.list(first.id).data
    assert items[0].id == first_input.id
    assert items[0].content[0].text == "Name a colour."
    [first_output] = first.output
    assert items[1].id == first_output.id
    assert items[1].content[0].text == first_output.content[0].text
    assert items[2].content[0].text == "And another?"
    assert items[2].id.startswith("msg_")


def test_cancelling_a_finished_response_is_a_400(client: OpenAI) -> None:
    response = client.responses.create(model=MODEL, input=ASK, max_output_tokens=2)
    with pytest.raises(BadRequestError) as refused:
        client.responses.cancel(response.id)
    assert refused.value.body["message"] == "Cannot cancel a synchronous response."
    assert client.responses.retrieve(response.id).status == response.status


def test_cancel_a_running_stream(client: OpenAI, render: ServerProcess) -> None:
    seen: list[str] = []
    started = threading.Event()

    def consume() -> None:
        with client.responses.stream(
            model=MODEL,
            input="Tell me a very long story.",
            max_output_tokens=200,
            extra_body={"ignore_eos": True},
        ) as stream:
            for event in stream:
                seen.append(event.type)
                if event.type == "response.created":
                    seen.append(event.response.id)
                    started.set()

    reader = threading.Thread(target=consume)
    reader.start()
    assert started.wait(60)
    response_id = seen[1]
    assert _client(render).responses.retrieve(response_id).status == "in_progress"
    cancelled = _client(render).responses.cancel(response_id)
    reader.join(60)
    assert not reader.is_alive()
    assert cancelled.status == "cancelled"
    assert seen[-1] == "response.incomplete"
    stored = client.responses.retrieve(response_id)
    assert stored.status == "cancelled"
    assert stored.usage is not None
    assert stored.usage.output_tokens < 200


def _wait_for_status(client: OpenAI, response_id: str, wanted: str) -> str:
    deadline = time.monotonic() + 30
    status = ""
    while time.monotonic() < deadline:
        try:
            status = client.responses.retrieve(response_id).status or ""
        except NotFoundError:
            status = ""
        if status == wanted:
            return status
        time.sleep(0.05)
    return status


def test_a_stream_the_client_leaves_is_not_left_in_progress(
    client: OpenAI, render: ServerProcess
) -> None:
    body = {
        "model": MODEL,
        "input": "Tell me a very long story.",
        "max_output_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{render.base_url}/v1/responses", json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                response_id = json.loads(line[6:])["response"]["id"]
                break
    assert _wait_for_status(client, response_id, "incomplete") == "incomplete"
    # Stopped when the client left, not run to its length limit (which would store the
    # reason); cut short, it is stored without usage, or with less than the limit.
    stored = client.responses.retrieve(response_id)
    assert stored.incomplete_details is None
    assert stored.usage is None or stored.usage.output_tokens < 200


def test_reasoning_summary_when_thinking_is_forced(reasoning: ServerProcess) -> None:
    client = _client(reasoning)
    body = {"structured_outputs": {"regex": THINK}}
    response = client.responses.create(
        model=MODEL, input=ASK, max_output_tokens=40, temperature=0, extra_body=body
    )
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"], response.output
    reasoning_item = response.output[0]
    assert reasoning_item.type == "reasoning"
    assert reasoning_item.id.startswith("rs_")
    assert reasoning_item.summary[0].text.strip()
    assert response.usage is not None
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(
        model=MODEL, input=ASK, max_output_tokens=40, temperature=0, extra_body=body
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert "response.reasoning_summary_part.added" in kinds
    assert "response.reasoning_summary_text.done" in kinds
    summary = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
    assert summary == reasoning_item.summary[0].text
    assert final.output_text == response.output_text


def test_auto_tool_choice_parses_the_call(reasoning: ServerProcess) -> None:
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>'
    response = _client(reasoning).responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        max_output_tokens=40,
        temperature=0,
        extra_body={"structured_outputs": {"regex": call}},
    )
    [item] = [item for item in response.output if item.type == "function_call"]
    assert (item.name, json.loads(item.arguments)) == ("get_weather", {"city": "Paris"})


def test_openai_agents_responses_model(
    render: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"{render.base_url}/v1", api_key="unused", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[function_tool(get_weather)],
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=28
        ),
    )

    async def run() -> Any:
        streamed = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=3)
        async for _ in streamed.stream_events():
            pass
        plain = await Runner.run(agent, "What is the weather in London?", max_turns=3)
        return streamed, plain

    streamed, plain = asyncio.run(run())
    for result in (streamed, plain):
        kinds = [item.type for item in result.new_items]
        assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
        assert result.new_items[1].output.startswith("It is sunny in ")
        assert result.final_output


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "banana"}]}, "input.0.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input.0.content.0.type",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
            "input.0.call_id",
        ),
        ({"input": [{"role": "user", "content": "x"}] * 5000}, "input"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "x", "tools": [{"type": "code_interpreter"}]}, "tools.0.type"),
        ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include.0"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}},
            "text.format.schema",
        ),
        ({}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ],  # fmt: skip
)
def test_bad_input_is_a_400(render: ServerProcess, body: dict[str, Any], param: str) -> None:
    error = _error(_post(render, {"model": MODEL, "max_output_tokens": 2, **body}), 400)
    assert error["param"] == param, error
    if param == "tools.0.type":
        assert body["tools"][0]["type"] in error["message"]
    if param == "include.0":
        assert "reasoning.encrypted_content" in error["message"]


def test_unknown_ids_are_404(render: ServerProcess) -> None:
    body = {"model": MODEL, "input": "x", "previous_response_id": "resp_nope"}
    error = _error(_post(render, body), 404)
    assert error["param"] == "previous_response_id"
    for method, path in (
        ("GET", "/v1/responses/resp_nope"),
        ("DELETE", "/v1/responses/resp_nope"),
        ("POST", "/v1/responses/resp_nope/cancel"),
        ("GET", "/v1/responses/resp_nope/input_items"),
    ):
        _error(httpx.request(method, f"{render.base_url}{path}", timeout=10), 404)


def test_another_tenants_response_is_not_found(keyed: ServerProcess) -> None:
    mine = _client(keyed, KEYS[0]).responses.create(
        model=MODEL, input="The secret word is xylophone.", max_output_tokens=4
    )
    theirs = _client(keyed, KEYS[1])
    with pytest.raises(NotFoundError) as caught:
        theirs.responses.create(
            model=MODEL, input="What is the secret?", previous_response_id=mine.id,
            max_output_tokens=4,
        )  # fmt: skip
    assert "xylophone" not in str(caught.value.body)
    with pytest.raises(NotFoundError):
        theirs.responses.retrieve(mine.id)
    with pytest.raises(NotFoundError):
        theirs.responses.delete(mine.id)
    assert _client(keyed, KEYS[0]).responses.retrieve(mine.id).output_text == mine.output_text


def test_render_matches_the_chat_render(render: ServerProcess) -> None:
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 8, "temperature": 0}
    rendered = httpx.post(f"{render.base_url}/v1/responses/render", json=body, timeout=30)
    assert rendered.status_code == 200, rendered.text
    chat = {"model": MODEL, "messages": [{"role": "user", "content": ASK}], "max_tokens": 8,
            "temperature": 0}  # fmt: skip
    expected = httpx.post(f"{render.base_url}/v1/chat/completions/render", json=chat, timeout=30)
    got, want = rendered.json(), expected.json()
    assert got["token_ids"] == want["token_ids"]
    assert got["sampling_params"] == want["sampling_params"]


def test_server_still_healthy(render: ServerProcess) -> None:
    time.sleep(0.1)
    assert render.process.poll() is None
    assert "Traceback" not in render.log()
