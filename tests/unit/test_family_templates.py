"""Real chat templates of more model families rendered by duet against transformers'
apply_chat_template, over test_chat_template's conversations plus each family's own cases:

- Gemma 3 (tests/data/templates/gemma3.jinja, google/gemma-3-*-it's tokenizer_config.json):
  folds a system message into the first user turn and raises unless the roles alternate
  user/assistant, so tools and tool results are refused; transformers' error is ours.
- Phi-4 (phi4.jinja, microsoft/phi-4): ChatML with <|im_sep|>; drops roles it does not know.
- Phi-4-mini-instruct (phi4_mini_instruct.jinja): tools come as a JSON string in the system
  message's own `tools` key (not the request's `tools`), between <|tool|> and <|/tool|>.

Each file is its model's tokenizer_config.json "chat_template" string, JSON-decoded.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from render_server.http.app import build_state, create_app
from render_server.settings import RenderSettings
from render_server.templating.chat_template import ChatRenderer, ChatTemplateError
from render_server.templating.tokenizer import Tokenizer
from tests.helpers.data import DATA_DIR
from tests.unit.test_chat_template import CASES, _reference, _render

TEMPLATE_FILES = {
    "gemma3": "gemma3.jinja",
    "phi4": "phi4.jinja",
    "phi4_mini": "phi4_mini_instruct.jinja",
}
TEMPLATES = {
    name: (DATA_DIR / "templates" / file).read_text() for name, file in TEMPLATE_FILES.items()
}
ALTERNATE = "Conversation roles must alternate user/assistant/user/assistant/..."
# Gemma 3 loops over content parts, so transformers gets them unjoined, as duet passes them.
TAKES_CONTENT_PARTS = {"gemma3"}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

FAMILY_CASES: list[dict[str, Any]] = [
    {
        "name": "roles_not_alternating",
        "messages": [
            {"role": "user", "content": "Hi."},
            {"role": "user", "content": "Anyone there?"},
        ],
    },
    {
        "name": "assistant_first",
        "messages": [
            {"role": "assistant", "content": "Hello, how can I help?"},
            {"role": "user", "content": "Tell me a joke."},
        ],
    },
    {
        "name": "system_after_first_turn",
        "messages": [
            {"role": "user", "content": "Hi."},
            {"role": "system", "content": "Be brief."},
        ],
    },
    {
        "name": "system_as_content_parts",
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
            {"role": "user", "content": [{"type": "text", "text": "  Hello!  "}]},
        ],
        "flatten_for_reference": True,
    },
    {
        "name": "system_only",
        "messages": [{"role": "system", "content": "You are terse."}],
    },
    {
        "name": "system_message_tools_field",
        "messages": [
            {
                "role": "system",
                "content": "You can call tools.",
                "tools": json.dumps([WEATHER_TOOL["function"]]),
            },
            {"role": "user", "content": "Weather in Paris?"},
        ],
    },
    {
        "name": "system_message_tools_none",
        "messages": [
            {"role": "system", "content": "No tools today.", "tools": None},
            {"role": "user", "content": "Weather in Paris?"},
        ],
        "add_generation_prompt": False,
    },
]


@pytest.fixture(scope="module")
def renderers(smollm2_tokenizer: Tokenizer) -> Iterator[dict[str, ChatRenderer]]:
    made = {name: ChatRenderer(smollm2_tokenizer, source) for name, source in TEMPLATES.items()}
    yield made
    for renderer in made.values():
        renderer.close()


def _expect(hf_reference_tokenizer: Any, template: str, case: dict[str, Any]) -> str | Exception:
    """transformers' text, or the error it raised."""
    if template in TAKES_CONTENT_PARTS:
        case = {key: value for key, value in case.items() if key != "flatten_for_reference"}
    try:
        text: str = _reference(hf_reference_tokenizer, case, TEMPLATES[template], tokenize=False)
    except Exception as exc:
        return exc
    return text


@pytest.mark.parametrize("case", CASES + FAMILY_CASES, ids=lambda case: case["name"])
@pytest.mark.parametrize("template", list(TEMPLATES))
def test_matches_transformers(
    renderers: dict[str, ChatRenderer],
    hf_reference_tokenizer: Any,
    template: str,
    case: dict[str, Any],
) -> None:
    want = _expect(hf_reference_tokenizer, template, case)
    if isinstance(want, Exception):  # the template rejects this conversation: so must we
        with pytest.raises(ChatTemplateError) as caught:
            _render(renderers[template], case)
        assert str(want).split(": ")[-1] in caught.value.message
        return
    assert _render(renderers[template], case).text == want


def _case(name: str) -> dict[str, Any]:
    return next(case for case in CASES + FAMILY_CASES if case["name"] == name)


@pytest.mark.parametrize(
    ("template", "refused"),
    [
        (
            "gemma3",
            {
                "tool_call_and_result",
                "tool_call_then_answer",
                "parallel_tool_calls",
                "roles_not_alternating",
                "assistant_first",
            },
        ),
        # An assistant tool-call turn without `content` is an undefined concatenation.
        ("phi4", {"tool_call_and_result", "tool_call_then_answer"}),
        ("phi4_mini", {"tool_call_and_result", "tool_call_then_answer"}),
    ],
)
def test_refuses_what_transformers_refuses(
    renderers: dict[str, ChatRenderer],
    hf_reference_tokenizer: Any,
    template: str,
    refused: set[str],
) -> None:
    """The parity test passes when both sides raise: pin which conversations those are, so
    an error on both sides for a conversation the template accepts cannot go unnoticed."""
    errors = {
        case["name"]
        for case in CASES + FAMILY_CASES
        if isinstance(_expect(hf_reference_tokenizer, template, case), Exception)
    }
    assert errors == refused
    if template == "gemma3":
        for name in refused:
            with pytest.raises(ChatTemplateError) as caught:
                _render(renderers[template], _case(name))
            assert caught.value.message == ALTERNATE


def test_gemma3_folds_the_system_message_into_the_first_user_turn(
    renderers: dict[str, ChatRenderer],
) -> None:
    got = _render(renderers["gemma3"], _case("system_as_content_parts")).text
    assert got.endswith(
        "<start_of_turn>user\nYou are terse.\n\nHello!<end_of_turn>\n<start_of_turn>model\n"
    )
    assert "<start_of_turn>system" not in got


def test_phi4_mini_renders_tools_given_in_the_system_message(
    renderers: dict[str, ChatRenderer],
) -> None:
    got = _render(renderers["phi4_mini"], _case("system_message_tools_field")).text
    tools = json.dumps([WEATHER_TOOL["function"]])
    assert got.startswith(f"<|system|>You can call tools.<|tool|>{tools}<|/tool|><|end|>")


async def _tokenize(app: Any, messages: list[dict[str, Any]]) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://duet") as client:
        return await client.post("/tokenize", json={"messages": messages})


@pytest.mark.parametrize("name", ["roles_not_alternating", "multi_turn", "tool_call_and_result"])
def test_gemma3_over_http_answers_what_transformers_does(
    hf_reference_tokenizer: Any, name: str
) -> None:
    """A render server given gemma3.jinja (--chat-template): where transformers raises, a 400
    with its message; otherwise the tokens of transformers' text."""
    settings = RenderSettings(
        chat_template=DATA_DIR / "templates" / TEMPLATE_FILES["gemma3"], render_only=True
    )
    state = build_state(settings)
    case = _case(name)
    try:
        response = asyncio.run(_tokenize(create_app(settings, state), case["messages"]))
    finally:
        state.renderer.close()
    want = _expect(hf_reference_tokenizer, "gemma3", case)
    if isinstance(want, Exception):
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["code"], error["message"]) == ("chat_template_error", ALTERNATE)
        assert str(want) == ALTERNATE
        return
    assert response.status_code == 200
    tokens = response.json()["tokens"]
    assert state.tokenizer.decode(tokens, skip_special_tokens=False) == want
