"""Tool choice without a worker: which template and parser serve tools by default, what a
`required` / named output cut short yields, and the one-call constraint."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from render_server.parsing.chat_output import ChoiceProcessor
from render_server.parsing.tool_choice import plan_tools, template_tool_parser, tool_setup
from render_server.schemas.errors import ApiError
from render_server.templating.chat_template import ChatRenderer
from render_server.templating.templates import read_chat_template, tools_template_for
from render_server.templating.tokenizer import Tokenizer
from tests.helpers.data import DATA_DIR

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("get_weather", "get_time")
]
CALLS = [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET", "n": [1, {"a": "}"}]}')]
ARRAY = "[" + ", ".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in CALLS) + "]"
CHATML_TOOLS = read_chat_template("chatml_tools")
QWEN = (DATA_DIR / "templates" / "qwen2.5_instruct.jinja").read_text()
LLAMA = (DATA_DIR / "templates" / "llama3.1_instruct.jinja").read_text()


def _plan(choice: Any = "required", parallel: bool | None = None) -> Any:
    return plan_tools(TOOLS, choice, parallel, enable_auto_tool_choice=False, tool_call_parser=None)


def _calls(processor: ChoiceProcessor, chunks: list[str]) -> tuple[list[tuple[str, str]], str]:
    """Stream `chunks` through a processor: (calls in order, content)."""
    pieces = [processor.feed(chunk) for chunk in chunks] + [processor.finish()]
    indexes = [delta.index for piece in pieces for delta in piece.tool_calls]
    assert indexes == list(range(len(indexes)))
    calls = [
        (delta.function.name or "", delta.function.arguments or "")
        for piece in pieces
        for delta in piece.tool_calls
        if delta.function is not None
    ]
    return calls, "".join(piece.content or "" for piece in pieces)


# -- the default: the template decides ---------------------------------------------------


def test_the_built_in_model_gets_chatml_tools_and_hermes(smollm2_tokenizer: Tokenizer) -> None:
    own = smollm2_tokenizer.chat_template
    assert tools_template_for(own) == CHATML_TOOLS
    assert tools_template_for(QWEN) is None  # shows tools itself
    assert tools_template_for(LLAMA) is None  # not ChatML
    phi4 = (DATA_DIR / "templates" / "phi4.jinja").read_text()
    assert tools_template_for(phi4) is None  # <|im_start|>role<|im_sep|>: not ChatML's turns
    setup = tool_setup(
        tool_call_parser=None,
        enable_auto_tool_choice=False,
        chat_template=own,
        builtin_template=CHATML_TOOLS,
    )
    assert (setup.parser_name, setup.allows_auto, setup.uses_builtin_template) == (
        "hermes",
        True,
        True,
    )


@pytest.mark.parametrize(
    ("template", "replaced"),
    [
        ("<|im_start|>{% for m in messages %}{% break %}{% endfor %}", True),
        ("<|im_start|>{% generation %}{{ messages }}{% endgeneration %}", True),
        ("<|im_start|>{% if tools %}{{ tools }}{% endif %}", False),
        ("<|im_start|>{% if %}", False),  # unreadable: left alone
        ("[INST]{{ messages }}", False),  # not ChatML
    ],
)
def test_which_templates_get_the_built_in_one(template: str, replaced: bool) -> None:
    assert (tools_template_for(template) == CHATML_TOOLS) is replaced


@pytest.mark.parametrize(
    ("template", "parser"),
    [(QWEN, "hermes"), (LLAMA, "llama3_json"), (CHATML_TOOLS, "hermes"), ("{{ x }}", None)],
    ids=["qwen2.5", "llama3.1", "chatml_tools", "no format"],
)
def test_a_template_names_its_parser(template: str, parser: str | None) -> None:
    assert template_tool_parser(template) == parser
    setup = tool_setup(
        tool_call_parser=None,
        enable_auto_tool_choice=False,
        chat_template=template,
        builtin_template=None,
    )
    assert (setup.parser_name, setup.allows_auto, setup.uses_builtin_template) == (
        parser,
        parser is not None,
        False,
    )


@pytest.mark.parametrize(
    ("parser", "enable", "builtin"),
    [("hermes", False, True), ("hermes", True, True), ("mistral", True, False)],
)
def test_vllm_flags_keep_their_meaning(parser: str, enable: bool, builtin: bool) -> None:
    """--tool-call-parser is the parser; "auto" only with --enable-auto-tool-choice; the
    built-in template only when it writes that parser's format."""
    setup = tool_setup(
        tool_call_parser=parser,
        enable_auto_tool_choice=enable,
        chat_template="{{ messages }}<|im_start|>",
        builtin_template=CHATML_TOOLS,
    )
    assert (setup.parser_name, setup.allows_auto, setup.uses_builtin_template) == (
        parser,
        enable,
        builtin,
    )
    if not enable:
        with pytest.raises(ApiError) as refused:
            plan_tools(TOOLS, "auto", None, enable_auto_tool_choice=False, tool_call_parser=parser)
        assert refused.value.info.param == "tool_choice"


def test_plain_chats_keep_the_models_template(smollm2_tokenizer: Tokenizer) -> None:
    """Only a chat with tools or tool turns renders with the built-in tools template; the
    rest render as the model's own template does (which test_chat_template checks against
    transformers), text and ids."""
    renderer = ChatRenderer(smollm2_tokenizer)
    try:
        for plain in (
            [{"role": "user", "content": "Hi <|im_end|> there"}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        ):
            assert renderer.render(plain, with_tools_template=True) == renderer.render(plain)
        asked = [{"role": "user", "content": "Weather?"}]
        with_tools = renderer.render(asked, tools=TOOLS, with_tools_template=True)
        assert "<tools>" in with_tools.text
        assert "<tools>" not in renderer.render(asked, tools=TOOLS).text
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        turns = [*asked, {"role": "assistant", "tool_calls": [call]}]
        turns.append({"role": "tool", "tool_call_id": "c1", "content": "sunny"})
        rendered = renderer.render(turns, with_tools_template=True).text
        assert '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>' in rendered
        assert "<tool_response>\nsunny\n</tool_response>" in rendered
    finally:
        renderer.close()


# -- required / named outputs, whole or cut ------------------------------------------------


def test_parallel_tool_calls_false_allows_one_call() -> None:
    schema = json.loads(_plan(parallel=False).constraint.spec)
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)
    assert "maxItems" not in json.loads(_plan().constraint.spec)


@given(st.data())
def test_required_output_cut_anywhere_keeps_its_complete_calls(data: st.DataObject) -> None:
    end = data.draw(st.integers(0, len(ARRAY)), label="cut")
    text = ARRAY[:end]
    cuts = data.draw(st.lists(st.integers(0, end), max_size=6), label="chunks")
    bounds = [0, *sorted(set(cuts)), end]
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    complete = [call for call, closes in zip(CALLS, _call_ends(), strict=True) if closes <= end]
    calls, content = _calls(ChoiceProcessor(_plan()), chunks)
    assert (calls, content) == (complete, "")
    whole = ChoiceProcessor(_plan()).whole(text)
    assert [(c.function.name, c.function.arguments) for c in whole.tool_calls] == complete
    assert whole.content is None


def _call_ends() -> list[int]:
    """Where each call's object closes in ARRAY (just past its "}")."""
    first = ARRAY.index(', {"name": "get_time"')
    return [first, len(ARRAY) - 1]


def test_named_output_is_one_call_once_its_arguments_close() -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    arguments = CALLS[1][1]
    calls, content = _calls(ChoiceProcessor(_plan(named)), list(arguments))
    assert (calls, content) == ([("get_time", arguments)], "")
    for end in range(len(arguments)):
        cut = ChoiceProcessor(_plan(named)).whole(arguments[:end])
        assert (cut.tool_calls, cut.content) == ([], None)
