"""vLLM's derender API over real processes: render -> /inference/v1/generate -> derender
answers exactly what /v1/chat/completions and /v1/completions answer for the same body
(greedy), ids and timestamps aside; bad generated output is a 400 naming the field."""

from __future__ import annotations

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
        (
            "/v1/completions/derender",
            {"generate_responses": [_generated([1])], "prompt_token_ids": [[1], [2]]},
            "generate_responses",
        ),
    ],
)
def test_bad_generated_output_is_a_400(
    render: ServerProcess, path: str, body: dict[str, Any], param: str
) -> None:
    response = _post(render, path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
