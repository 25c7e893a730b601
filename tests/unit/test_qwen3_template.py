"""Qwen3's real chat template (tests/data/templates/qwen3.jinja) rendered by duet against
transformers' apply_chat_template: test_chat_template's conversations, with thinking left to
the template's default, switched on and switched off; reasoning in assistant turns."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from render_server.parsing.family_defaults import model_family
from render_server.parsing.tool_choice import template_tool_parser
from render_server.templating.chat_template import ChatRenderer, ChatTemplateError
from render_server.templating.tokenizer import Tokenizer
from tests.helpers.data import DATA_DIR
from tests.unit.test_chat_template import CASES, _reference, _render

QWEN3 = (DATA_DIR / "templates" / "qwen3.jinja").read_text()

REASONING_CASES: list[dict[str, Any]] = [
    {
        "name": "earlier_reasoning_dropped_last_kept",
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
            {"role": "user", "content": "and 3+3?"},
            {"role": "assistant", "content": "<think>\nagain\n</think>\n\n6"},
        ],
        "add_generation_prompt": False,
    },
    {
        "name": "reasoning_content_field_after_tool_result",
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "I should call the tool.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
    },
]


@pytest.fixture(scope="module")
def renderer(smollm2_tokenizer: Tokenizer) -> Iterator[ChatRenderer]:
    made = ChatRenderer(smollm2_tokenizer, QWEN3)
    yield made
    made.close()


@pytest.mark.parametrize("thinking", [None, True, False], ids=["default", "on", "off"])
@pytest.mark.parametrize("case", CASES + REASONING_CASES, ids=lambda case: case["name"])
def test_matches_transformers(
    renderer: ChatRenderer,
    hf_reference_tokenizer: Any,
    case: dict[str, Any],
    thinking: bool | None,
) -> None:
    if thinking is not None:
        kwargs = case.get("chat_template_kwargs", {}) | {"enable_thinking": thinking}
        case = case | {"chat_template_kwargs": kwargs}
    try:
        want = _reference(hf_reference_tokenizer, case, QWEN3, tokenize=False)
    except Exception as exc:  # the template rejects this conversation: so must we
        with pytest.raises(ChatTemplateError) as caught:
            _render(renderer, case)
        assert str(exc).split(": ")[-1] in caught.value.message  # noqa: PT017
        return
    got = _render(renderer, case).text
    assert got == want
    if thinking is False and case.get("add_generation_prompt", True):
        assert got.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_template_and_family_pick_qwen3_parsers() -> None:
    assert template_tool_parser(QWEN3) == "hermes"
    assert model_family("Qwen3ForCausalLM", QWEN3) == "qwen3"
