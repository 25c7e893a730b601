"""vLLM's derender API over real processes: render -> /inference/v1/generate -> derender
answers exactly what /v1/chat/completions and /v1/completions answer for the same body
(greedy), ids and timestamps aside; bad generated output is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.e2e.test_scale_out_render import MESSAGES, WEATHER
from tests.helpers.processes import ServerProcess

VOCAB_SIZE = 49152


def _post(server: ServerProcess, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=30.0)


def _ok(server: ServerProcess, path: str, body: Any) -> Any:
    response = _post(server, path, body)
    assert response.status_code == 200, response.text
    return response.json()


def _comparable(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer without what differs between two runs: ids, timestamps, tool-call ids,
    and the prefix-cache hits (the second run finds the first's blocks)."""
    answer = {k: v for k, v in answer.items() if k not in ("id", "created")}
    answer["usage"] = {k: v for k, v in answer["usage"].items() if k != "prompt_tokens_details"}
    for choice in answer["choices"]:
        for call in (choice.get("message") or {}).get("tool_calls") or []:
            call.pop("id", None)
    return answer


CHATS = {
    "plain": {"messages": MESSAGES, "max_tokens": 12},
    "stop_and_logprobs": {
        "messages": MESSAGES,
        "max_tokens": 16,
        "stop": [","],
        "logprobs": True,
        "top_logprobs": 2,
    },
    "tool_choice_required": {
        "messages": MESSAGES,
        "tools": [WEATHER],
        "tool_choice": "required",
        "max_tokens": 24,
    },
}


@pytest.mark.parametrize("name", list(CHATS))
def test_chat_round_trip_equals_chat_completions(render: ServerProcess, name: str) -> None:
    chat = CHATS[name] | {"temperature": 0}
    direct = _ok(render, "/v1/chat/completions", chat)
    rendered = _ok(render, "/v1/chat/completions/render", chat)
    generated = _ok(render, "/inference/v1/generate", rendered)
    body = {"generate_response": generated, "chat_request": chat}
    derendered = _ok(render, "/v1/chat/completions/derender", body)
    assert _comparable(derendered) == _comparable(direct)
    cached = generated["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert derendered["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    # The prompt may be named instead of rendered again.
    named = body | {
        "prompt_token_ids": rendered["token_ids"],
        "prompt_tokens": len(rendered["token_ids"]),
    }
    assert _comparable(_ok(render, "/v1/chat/completions/derender", named)) == _comparable(direct)


def test_completions_round_trip_equals_completions(render: ServerProcess) -> None:
    completion = {
        "prompt": ["The capital of France is", "Hello"],
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 2,
        "echo": True,
    }
    direct = _ok(render, "/v1/completions", completion)
    rendered = _ok(render, "/v1/completions/render", completion)
    generated = [_ok(render, "/inference/v1/generate", item) for item in rendered]
    body = {"generate_responses": generated, "completion_request": completion}
    derendered = _ok(render, "/v1/completions/derender", body)
    assert _comparable(derendered) == _comparable(direct)


def _generated(token_ids: list[int], **choice: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "token_ids": token_ids, "finish_reason": "length", **choice}]}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions/derender",
            {
                "generate_response": _generated([1, VOCAB_SIZE]),
                "chat_request": {"messages": MESSAGES},
            },
            "generate_response.choices.0.token_ids.1",
        ),
        (
            "/v1/chat/completions/derender",
            {"generate_response": _generated([-1]), "chat_request": {"messages": MESSAGES}},
            "generate_response.choices.0.token_ids.0",
        ),
        (
            "/v1/chat/completions/derender",
            {"generate_response": _generated([1, 2])},
            "prompt_token_ids",
        ),
        (
            "/v1/chat/completions/derender",
            {"generate_response": _generated([1]), "prompt_token_ids": [1], "prompt_tokens": 3},
            "prompt_tokens",
        ),
        (
            "/v1/chat/completions/derender",
            {
                "generate_response": _generated([1], index=1),
                "chat_request": {"messages": MESSAGES},
            },
            "generate_response.choices",
        ),
        (
            "/v1/chat/completions/derender",
            {
                "generate_response": _generated(
                    [1],
                    logprobs={
                        "content": [
                            {
                                "token_id": 1,
                                "logprob": 0.0,
                                "top_logprobs": [{"token_id": 10**9, "logprob": 0.0}],
                            }
                        ]
                    },
                ),
                "prompt_token_ids": [1],
            },
            "generate_response.choices.0.logprobs.0.1",
        ),
        (
            "/v1/completions/derender",
            {"generate_responses": [_generated([VOCAB_SIZE + 5])], "prompt_token_ids": [[1]]},
            "generate_responses.0.choices.0.token_ids.0",
        ),
        # A chat prompt's ids past the vocabulary, from the generate response or the body
        # (the HTTP fuzzer found the first a 500: the detokenizer overflowed on 2**54).
        (
            "/v1/chat/completions/derender",
            {"generate_response": _generated([1]) | {"prompt_token_ids": [1, 2**54]}},
            "prompt_token_ids.1",
        ),
        (
            "/v1/chat/completions/derender",
            {"generate_response": _generated([1]), "prompt_token_ids": [VOCAB_SIZE]},
            "prompt_token_ids.0",
        ),
        (
            "/v1/completions/derender",
            {"generate_responses": [_generated([1])], "prompt_token_ids": [[1], [2]]},
            "generate_responses",
        ),
        # No prompt at all to stream for (the HTTP fuzzer found this one a 500).
        (
            "/v1/completions/derender",
            {
                "stream": True,
                "generate_chunk": {"choices": [{"index": 0, "token_ids": []}]},
                "prompt_token_ids": [],
            },
            "prompt_token_ids",
        ),
        # Numbers written back into the answer: past 64 bits they could not be encoded.
        (
            "/v1/chat/completions/derender",
            {
                "generate_response": _generated([1], stop_reason=2**64),
                "prompt_token_ids": [1],
            },
            "generate_response.choices.0.stop_reason",
        ),
        (
            "/v1/chat/completions/derender",
            {
                "generate_response": _generated([1])
                | {
                    "usage": {
                        "prompt_tokens": 1,
                        "completion_tokens": 1,
                        "total_tokens": 2,
                        "prompt_tokens_details": {"cached_tokens": 2**70},
                    }
                },
                "prompt_token_ids": [1],
            },
            "generate_response.usage.prompt_tokens_details.cached_tokens",
        ),
    ],
)
def test_bad_generated_output_is_a_400(
    render: ServerProcess, path: str, body: dict[str, Any], param: str
) -> None:
    response = _post(render, path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def _sse(text: str) -> list[Any]:
    """A stream's data lines, decoded (ids, timestamps and tool-call ids dropped)."""
    events: list[Any] = []
    for line in text.splitlines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            events.append("[DONE]")
            continue
        event = {k: v for k, v in json.loads(line[6:]).items() if k not in ("id", "created")}
        for choice in event.get("choices", []):
            for call in (choice.get("delta") or {}).get("tool_calls") or []:
                call.pop("id", None)
        if event.get("usage"):
            event["usage"].pop("prompt_tokens_details", None)
        events.append(event)
    return events


def _derender_stream(render: ServerProcess, chat: dict[str, Any]) -> tuple[str, list[str]]:
    """render -> streamed generate -> one streamed derender per generate event: the
    concatenated chunks, and each call's stream_state as sent."""
    rendered = _ok(render, "/v1/chat/completions/render", chat)
    generated = _post(render, "/inference/v1/generate", rendered)
    assert generated.status_code == 200, generated.text
    stream = ""
    stream_state = None
    states = []
    for event in _sse(generated.text):
        if event == "[DONE]":
            continue
        body = {"stream": True, "generate_chunk": event, "chat_request": chat}
        if stream_state is not None:
            body["stream_state"] = stream_state
        answer = _ok(render, "/v1/chat/completions/derender", body)
        stream += answer["chunk"]
        stream_state = answer["stream_state"]
        states.append(json.dumps(stream_state))
    return stream, states


@pytest.mark.parametrize("name", ["plain", "tool_choice_required"])
def test_streamed_chat_round_trip_equals_the_chat_stream(render: ServerProcess, name: str) -> None:
    chat = CHATS[name] | {
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    direct = _post(render, "/v1/chat/completions", chat)
    assert direct.status_code == 200, direct.text
    stream, states = _derender_stream(render, chat)
    assert _sse(stream) == _sse(direct.text)
    # The closing usage carries the generate stream's cache hits.
    last = json.loads(stream.split("data: ")[-2])
    cached = json.loads(states[-1])["choices"][0]["cached_tokens"]
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}


def _stream_body(chat: dict[str, Any], stream_state: dict[str, Any]) -> dict[str, Any]:
    chunk = {"choices": [{"index": 0, "token_ids": [1]}]}
    return {
        "stream": True,
        "generate_chunk": chunk,
        "chat_request": chat,
        "stream_state": stream_state,
    }


def test_a_lying_stream_state_is_a_400(render: ServerProcess) -> None:
    chat = CHATS["plain"] | {"temperature": 0, "stream": True}
    _, states = _derender_stream(render, chat)
    state = json.loads(states[len(states) // 2])
    assert state["choices"][0]["text_chars"] > 0
    path = "/v1/chat/completions/derender"
    cases = [
        (
            {"text_chars": state["choices"][0]["text_chars"] + 1},
            "stream_state.choices.0.text_chars",
        ),
        (
            {"token_ids": [*state["choices"][0]["token_ids"], VOCAB_SIZE]},
            "stream_state.choices.0.token_ids.{}",
        ),
        ({"token_ids": list(range(100))}, "stream_state.choices.0.token_ids"),
    ]
    for change, param in cases:
        lying = state | {"choices": [state["choices"][0] | change]}
        response = _post(render, path, _stream_body(chat, lying))
        assert response.status_code == 400, response.text[:300]
        expected = param.format(len(state["choices"][0]["token_ids"]))
        assert response.json()["error"]["param"] == expected
    for change2, param in [
        ({"choices": []}, "stream_state.choices"),
        ({"choices": state["choices"] * 2}, "stream_state.choices"),
    ]:
        response = _post(render, path, _stream_body(chat, state | change2))
        assert response.status_code == 400, response.text[:300]
        assert response.json()["error"]["param"] == param

    # 10 MB of state is refused before it is read, as every oversize body is: never a 500.
    huge = state | {"choices": [state["choices"][0] | {"token_ids": [1] * 5_000_000}]}
    response = _post(render, path, _stream_body(chat, huge))
    assert response.status_code == 413, response.text[:300]
    assert response.json()["error"]["code"] == "request_too_large"


def _derender_completion_stream(render: ServerProcess, completion: dict[str, Any]) -> str:
    """render -> one streamed generate per prompt -> a streamed derender per event."""
    stream = ""
    stream_state = None
    for index, item in enumerate(_ok(render, "/v1/completions/render", completion)):
        generated = _post(render, "/inference/v1/generate", item)
        assert generated.status_code == 200, generated.text
        for event in _sse(generated.text):
            if event == "[DONE]":
                continue
            body = {
                "stream": True,
                "generate_chunk": event,
                "prompt_index": index,
                "completion_request": completion,
            }
            if stream_state is not None:
                body["stream_state"] = stream_state
            answer = _ok(render, "/v1/completions/derender", body)
            stream += answer["chunk"]
            stream_state = answer["stream_state"]
    return stream


def _texts(events: list[Any]) -> dict[int, tuple[str, str | None]]:
    """Each choice's streamed text and finish reason."""
    texts: dict[int, tuple[str, str | None]] = {}
    for event in events:
        for choice in event["choices"] if isinstance(event, dict) else []:
            text, _ = texts.get(choice["index"], ("", None))
            texts[choice["index"]] = (text + choice["text"], choice["finish_reason"])
    return texts


def test_streamed_completions_round_trip_equals_the_completions_stream(
    render: ServerProcess,
) -> None:
    completion: dict[str, Any] = {
        "prompt": "The capital of France is",
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 2,
        "echo": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    direct = _post(render, "/v1/completions", completion)
    assert direct.status_code == 200, direct.text
    assert _sse(_derender_completion_stream(render, completion)) == _sse(direct.text)
    # Two prompts: each prompt's stream in turn, every choice's text as the direct one's.
    two = completion | {"prompt": ["The capital of France is", "Hello"], "logprobs": None}
    direct = _post(render, "/v1/completions", two)
    derendered = _sse(_derender_completion_stream(render, two))
    assert _texts(derendered) == _texts(_sse(direct.text))
    assert derendered[-1] == "[DONE]"
    assert derendered[-2]["usage"] == _sse(direct.text)[-2]["usage"]
