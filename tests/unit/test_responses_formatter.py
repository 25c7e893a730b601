"""The Responses API's formatter without processes: every streamed event and the final
object parse as the `openai` SDK's own models, in order, and a streamed response holds the
same items as the same text answered whole."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, cast, get_args

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel

from render_server.generation.lifecycle import ChoiceDelta, Generation, UsageCounts
from render_server.http.api.responses_stream import ResponsesFormatter
from render_server.parsing.chat_output import ChoiceProcessor
from render_server.parsing.tool_choice import ToolPlan
from render_server.schemas.errors import ApiError
from render_server.schemas.responses_api import ResponseObject
from shared.protocol import FinishReason


def _event_models() -> dict[str, type[BaseModel]]:
    union = get_args(ResponseStreamEvent)[0]  # Annotated[Union[...], PropertyInfo]
    models = {}
    for model in get_args(union):
        [kind] = get_args(model.model_fields["type"].annotation)
        models[kind] = model
    return models


EVENTS = _event_models()
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}
TEXT = "<think>It is sunny.</think>\n\nHello there.\n<tool_call>\n"
TEXT += '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@dataclass
class _Choice:
    text: str = ""
    finish_reason: FinishReason | None = None


@dataclass
class _Generation:
    """What the formatter reads of a Generation."""

    choices: list[_Choice] = field(default_factory=lambda: [_Choice()])

    def usage(self) -> UsageCounts:
        return UsageCounts(prompt_tokens=10, completion_tokens=20, cached_tokens=3)


def _formatter(tools: bool = True) -> ResponsesFormatter:
    plan = ToolPlan("auto", [WEATHER], parser_name="hermes") if tools else ToolPlan("none", None)
    template = ResponseObject(id="resp_1", created_at=1, status="in_progress", model="m")
    return ResponsesFormatter(template, ChoiceProcessor(plan, "qwen3"), lambda text: len(text))


def _parse(stream: bytes) -> list[Any]:
    events = []
    for block in stream.decode().strip().split("\n\n"):
        event_line, data_line = block.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}"
        events.append(EVENTS[data["type"]].model_validate(data))
    return events


def _stream(text: str, chunk: int, reason: FinishReason = "stop") -> tuple[list[Any], Any]:
    formatter = _formatter()
    generation = _Generation()
    fake = cast(Generation, generation)
    out = formatter.opening(fake)
    for start in range(0, len(text), chunk):
        last = start + chunk >= len(text)
        piece = text[start : start + chunk]
        delta = ChoiceDelta(0, piece, [], None, reason if last else None)
        out += formatter.delta_events(fake, delta) or b""
    generation.choices[0] = _Choice(text, reason)
    out += formatter.closing(fake)
    return _parse(out), formatter.final


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_stream_events_parse_in_order_and_equal_the_whole(chunk: int) -> None:
    events, final = _stream(TEXT, chunk)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    whole = _formatter()
    generation = _Generation([_Choice(TEXT, "stop")])
    body = whole.body(cast(Generation, generation))
    assert isinstance(body, ResponseObject)
    streamed = Response.model_validate(json.loads(json.dumps(_builtins(final))))
    answered = Response.model_validate(_builtins(body))
    assert [item.type for item in answered.output] == ["reasoning", "message", "function_call"]
    assert _without_ids(streamed) == _without_ids(answered)
    assert answered.output_text == "Hello there."
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == answered.output_text
    assert answered.usage is not None
    assert answered.usage.output_tokens_details.reasoning_tokens == len("It is sunny.")


def test_length_cut_is_incomplete_with_its_reason() -> None:
    events, final = _stream("<think>a</think>Some text", 4, "length")
    assert events[-1].type == "response.incomplete"
    response = Response.model_validate(_builtins(final))
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in response.output] == ["completed", "incomplete"]


def test_cancelled_abort_ends_cancelled() -> None:
    formatter = _formatter(tools=False)
    formatter.cancelled = True
    generation = cast(Generation, _Generation([_Choice("Hi", "abort")]))
    body = formatter.body(generation)
    assert isinstance(body, ResponseObject)
    assert body.status == "cancelled"


def test_error_after_the_start_is_an_error_event_then_failed() -> None:
    formatter = _formatter(tools=False)
    fake = cast(Generation, _Generation())
    out = formatter.opening(fake)
    out += formatter.delta_events(fake, ChoiceDelta(0, "<think>x</think>Hi", [], None)) or b""
    out += formatter.error_event(ApiError(503, "worker lost", code="lost"))
    events = _parse(out)
    kinds = [event.type for event in events]
    assert kinds.count("error") == 1
    assert kinds[-1] == "response.failed"
    failed = events[-1].response
    assert failed.status == "failed"
    assert failed.error.code == "server_error"
    [error] = [event for event in events if event.type == "error"]
    assert (error.code, error.message) == ("lost", "worker lost")
    assert [event.sequence_number for event in events] == list(range(len(events)))


def test_blank_answer_beside_a_call_is_dropped() -> None:
    text = '\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>\n'
    _, final = _stream("<think></think>" + text, 2)
    assert [type(item).__name__ for item in final.output] == ["FunctionCallOut"]


def _builtins(response: Any) -> Any:
    import msgspec

    return msgspec.to_builtins(response)


def _without_ids(response: Response) -> list[dict[str, Any]]:
    items = []
    for item in response.output:
        data = item.model_dump(exclude={"id", "call_id"})
        items.append(data)
    return items
