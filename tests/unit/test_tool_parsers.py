"""Tool-call parsers over recorded outputs: non-streamed results as recorded, streamed results
equal to them however the text is split, only well-formed calls, and linear time on
pathological outputs.

Arguments are compared exactly (the same characters), not merely as equal JSON: the JSON
formats send the model's own argument characters.
"""

from __future__ import annotations

import json
import keyword
import re
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from render_server.parsing.tool_parsers import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    ToolParser,
    UnknownToolParserError,
    get_tool_parser,
)
from render_server.parsing.tool_parsers.json_scan import (
    MAX_JSON_DEPTH,
    JsonScanError,
    JsonValueScanner,
)
from tests.helpers.data import DATA_DIR

RECORDED = json.loads((DATA_DIR / "parser_outputs" / "tool_calls.json").read_text("utf-8"))
TOOLS: list[dict[str, Any]] = RECORDED["tools"]
CASES: list[dict[str, Any]] = RECORDED["cases"]
ID_PATTERN = {"mistral": re.compile(r"[A-Za-z0-9]{9}")}
DEFAULT_ID = re.compile(r"call_[A-Za-z0-9]{24}")


@dataclass
class Streamed:
    """A stream's messages put back together, with the per-message rules checked on the way."""

    content: str = ""
    names: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)


def stream(parser: ToolParser, chunks: list[str]) -> Streamed:
    out = Streamed()
    messages = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    for message in messages:
        assert message.content != "", "empty content must be None"
        out.content += message.content or ""
        for call in message.tool_calls:
            assert call.id not in out.ids, "one id per call"
            assert isinstance(json.loads(call.arguments), dict), "only well-formed calls"
            out.names.append(call.name)
            out.ids.append(call.id)
            out.arguments.append(call.arguments)
    return out


def assert_same(streamed: Streamed, extracted: ExtractedToolCalls) -> None:
    assert streamed.content == (extracted.content or "")
    assert streamed.names == [call.name for call in extracted.tool_calls]
    assert streamed.arguments == [call.arguments for call in extracted.tool_calls]


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def case_id(case: dict[str, Any]) -> str:
    return f"{case['parser']}: {case['label']}"


# -- registry --------------------------------------------------------------------------------


def test_registry_names() -> None:
    assert {"hermes", "llama3_json", "mistral", "pythonic"} <= set(TOOL_PARSERS)
    for name, parser in TOOL_PARSERS.items():
        assert get_tool_parser(name) is parser
        assert parser.__doc__


def test_unknown_parser_lists_the_known_ones() -> None:
    with pytest.raises(KeyError) as info:
        get_tool_parser("nope")
    assert isinstance(info.value, UnknownToolParserError)
    assert "'nope'" in str(info.value)
    for name in TOOL_PARSERS:
        assert name in str(info.value)


# -- recorded outputs ------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_recorded_extract(case: dict[str, Any]) -> None:
    result = get_tool_parser(case["parser"])(TOOLS).extract(case["text"])
    assert result.content == case["content"]
    assert [(c.name, c.arguments) for c in result.tool_calls] == [
        (c["name"], c["arguments"]) for c in case["tool_calls"]
    ]
    pattern = ID_PATTERN.get(case["parser"], DEFAULT_ID)
    ids = [call.id for call in result.tool_calls]
    assert all(pattern.fullmatch(call_id) for call_id in ids)
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_recorded_one_character_at_a_time(case: dict[str, Any]) -> None:
    parser_class = get_tool_parser(case["parser"])
    extracted = parser_class(TOOLS).extract(case["text"])
    assert_same(stream(parser_class(TOOLS), list(case["text"])), extracted)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_recorded_random_chunks(data: st.DataObject) -> None:
    case = data.draw(st.sampled_from(CASES), label="case")
    text = case["text"]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)), label="cuts")
    parser_class = get_tool_parser(case["parser"])
    extracted = parser_class(TOOLS).extract(text)
    assert_same(stream(parser_class(TOOLS), split(text, cuts)), extracted)


def test_a_call_is_sent_whole_once_its_object_closes() -> None:
    """Fed a token at a time, nothing of a call goes out before its JSON is complete: until
    then it could still turn out to be content."""
    text = '<tool_call>\n{"name": "search", "arguments": {"query": "a long query string"}}'
    parser = get_tool_parser("hermes")(TOOLS)
    fed = ""
    for piece in [text[i : i + 3] for i in range(0, len(text), 3)]:
        fed += piece
        message = parser.feed(piece)
        assert message.content is None
        if message.tool_calls:
            assert fed == text
            assert [(c.name, c.arguments) for c in message.tool_calls] == [
                ("search", '{"query": "a long query string"}')
            ]
    assert parser.finish().is_empty


# Each format's call whose arguments break (and, for the JSON formats, the same call cut off
# by max_tokens): the model's text is content, and no call is made (issue 13, item 9).
BROKEN_CALLS = [
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {bad json</tool_call>'),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"timezone": "UT'),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"timezone": UTC}}'),
    ("llama3_json", '{"name": "get_time", "parameters": {"timezone": "UT'),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"timezone": UTC}}]'),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"timezone": "UT'),
    ("mistral", '[TOOL_CALLS]get_time[ARGS]{"timezone": UTC}'),
    ("mistral", '[TOOL_CALLS]get_time[ARGS]{"timezone": "UT'),
    ("pythonic", "[get_time(timezone=UTC)]"),
    ("pythonic", '[get_time(timezone="UT'),
]


@pytest.mark.parametrize(("parser_name", "text"), BROKEN_CALLS)
def test_a_broken_call_is_content_streamed_or_not(parser_name: str, text: str) -> None:
    parser_class = get_tool_parser(parser_name)
    extracted = parser_class(TOOLS).extract(text)
    assert extracted.content == text
    assert extracted.tool_calls == []
    for chunks in ([text], list(text)):
        streamed = stream(parser_class(TOOLS), chunks)
        assert (streamed.content, streamed.names) == (text, [])


def test_content_is_not_held_without_reason() -> None:
    """Plain text goes out as it comes; only trailing whitespace and a possible tag wait."""
    parser = get_tool_parser("hermes")(TOOLS)
    assert parser.feed("Hello").content == "Hello"
    assert parser.feed(" there ").content == " there"
    assert parser.feed("<tool").content is None
    assert parser.feed("box>").content == " <toolbox>"
    assert parser.finish().content is None


def test_tools_none_accepts_any_name_and_empty_tools_none() -> None:
    text = '<tool_call>{"name": "anything", "arguments": {}}</tool_call>'
    parser_class = get_tool_parser("hermes")
    assert [c.name for c in parser_class(None).extract(text).tool_calls] == ["anything"]
    assert parser_class([]).extract(text).content == text


def test_extract_leaves_the_stream_alone() -> None:
    parser = get_tool_parser("hermes")(TOOLS)
    assert parser.feed("Hi <tool_ca").content == "Hi"
    parser.extract('<tool_call>{"name": "get_time"}</tool_call>')
    assert parser.feed("ll> not json").content == " <tool_call> not json"
    assert parser.finish().is_empty


def test_feed_after_finish_is_an_error() -> None:
    parser = get_tool_parser("pythonic")(TOOLS)
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")
    with pytest.raises(RuntimeError):
        parser.finish()


# -- fuzzing: arbitrary texts from each format's pieces ----------------------------------------

# fmt: off
FRAGMENTS: dict[str, list[str]] = {
    "hermes": [
        "<tool_call>", "</tool_call>", "<tool_", "call>", '{"name": "get_time"', '{"name": "x"',
        '{"name": "search"', ', "arguments": ', '{"query": "a\\"b"}', "{}", '"arguments"', "{",
        "}", ",", ":", '"', "\\", "\n", " ", "text", "[1, -2.5e3, true, null]", "nul", "1.",
    ],
    "llama3_json": [
        "<|python_tag|>", "<|python", '{"name": "get_time"', '{"name": "x"', ', "parameters": ',
        '{"a": [1, {}]}', "{}", ";", "; ", " ", "\n", "}", "{", '"', "hi", ":", ",", "0",
    ],
    "mistral": [
        "[TOOL_CALLS]", "[TOOL_", "CALLS]", "[ARGS]", "[AR", "get_time", "x", "[", "]", ",",
        '{"name": "get_time", "arguments": {}}', '{"name": "y", "arguments": {}}', "{", "}",
        '{"a": "b"}', " ", "\n", "text", '"', ":",
    ],
    "pythonic": [
        "<|python_start|>", "<|python_end|>", "<|python", "[", "]", "get_time(", "search(",
        "nope(", "query=", "'a'", '"b"', "'''", "'", ")", "(", ",", " ", "\n", "None", "-1",
        "{'k': [1, (2,)]}", "#", "\\", "x", "get_time()", "f(",
    ],
}
# fmt: on


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_outputs_stream_like_extract(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(FRAGMENTS)), label="parser")
    pieces = data.draw(st.lists(st.sampled_from(FRAGMENTS[name]), max_size=25), label="pieces")
    text = "".join(pieces)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=20), label="cuts")
    parser_class = get_tool_parser(name)
    extracted = parser_class(TOOLS).extract(text)
    assert_same(stream(parser_class(TOOLS), split(text, cuts)), extracted)
    for call in extracted.tool_calls:
        assert call.name in {"get_time", "search", "get_weather"}
        assert isinstance(json.loads(call.arguments), dict)


# -- generated outputs: well-formed calls with random arguments, then mutated ------------------

NAMES = ["get_time", "search", "get_weather"]
WORDS = ["Sure.", "Let me check", "ok", "\n", " ", "done!", "é", "a < b"]
# fmt: off
NOISE = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "{", "}",
         "[", "]", "(", ")", '"', "'", "\\", ",", ";", ":", "\n", " ", "x"]
# fmt: on
ARG_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
KEYWORDS = st.from_regex(r"[a-z_][a-z0-9_]{0,5}", fullmatch=True).filter(
    lambda word: not keyword.iskeyword(word)
)


@st.composite
def json_args(draw: st.DrawFn) -> str:
    value = draw(st.dictionaries(st.text(max_size=5), ARG_VALUES, max_size=3))
    indent = draw(st.sampled_from([None, 1]))
    return json.dumps(value, indent=indent, ensure_ascii=draw(st.booleans()))


@st.composite
def generated_output(draw: st.DrawFn, parser: str) -> tuple[str, list[tuple[str, Any]], str]:
    """(text, [(name, arguments)], content words). JSON arguments are expected verbatim;
    pythonic ones as the data their literals hold."""
    calls = draw(st.lists(st.tuples(st.sampled_from(NAMES), json_args()), min_size=1, max_size=3))
    before = "".join(draw(st.lists(st.sampled_from(WORDS), max_size=3)))
    after = "".join(draw(st.lists(st.sampled_from(WORDS), max_size=3)))
    gap = draw(st.sampled_from(["", "\n", " \n "]))
    if parser == "hermes":
        body = gap.join(
            f'<tool_call>{gap}{{"name": "{name}", "arguments": {args}}}{gap}</tool_call>'
            if draw(st.booleans())
            else f'<tool_call>{{"arguments": {args},{gap}"name": "{name}"}}</tool_call>'
            for name, args in calls
        )
        return before + body + after, calls, before + after
    if parser == "llama3_json":
        tag = draw(st.sampled_from(["", "<|python_tag|>"]))
        body = ";" + gap
        body = body.join(f'{{"name": "{name}", "parameters": {args}}}' for name, args in calls)
        after = after.lstrip(" \n;")
        return gap + tag + body + gap + after, calls, after
    if parser == "mistral":
        if draw(st.booleans()):
            body = "[TOOL_CALLS]" + "".join(f"{name}[ARGS]{args}" for name, args in calls[:1])
            body += "".join(f"[TOOL_CALLS]{name}[ARGS]{args}" for name, args in calls[1:])
        else:
            body = (
                "[TOOL_CALLS]["
                + ("," + gap).join(
                    f'{{"name": "{name}", "arguments": {args}}}' for name, args in calls
                )
                + "]"
            )
        return before + body + after, calls, before + after
    # pythonic: keyword arguments with Python literal values
    literal_calls = draw(
        st.lists(
            st.tuples(st.sampled_from(NAMES), st.dictionaries(KEYWORDS, ARG_VALUES, max_size=3)),
            min_size=1,
            max_size=3,
        )
    )
    body = (
        "["
        + ("," + gap).join(
            f"{name}({', '.join(f'{key}={value!r}' for key, value in kwargs.items())})"
            for name, kwargs in literal_calls
        )
        + "]"
    )
    after = after.lstrip(" \n")
    return gap + body + gap + after, literal_calls, after


def as_json_data(value: Any) -> Any:
    """What a Python literal becomes in JSON (tuples are lists)."""
    if isinstance(value, list | tuple):
        return [as_json_data(item) for item in value]
    if isinstance(value, dict):
        return {key: as_json_data(item) for key, item in value.items()}
    return value


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_generated_outputs_parse_exactly(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(FRAGMENTS)), label="parser")
    text, calls, words = data.draw(generated_output(name), label="output")
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=20), label="cuts")
    parser_class = get_tool_parser(name)
    extracted = parser_class(TOOLS).extract(text)
    assert [call.name for call in extracted.tool_calls] == [name for name, _ in calls]
    for call, (_, arguments) in zip(extracted.tool_calls, calls, strict=True):
        if isinstance(arguments, str):
            assert call.arguments == arguments
        else:
            assert json.loads(call.arguments) == as_json_data(arguments)
    assert "".join((extracted.content or "").split()) == "".join(words.split())
    assert_same(stream(parser_class(TOOLS), split(text, cuts)), extracted)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_outputs_stream_like_extract(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(FRAGMENTS)), label="parser")
    text, _, _ = data.draw(generated_output(name), label="output")
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        start = data.draw(st.integers(0, len(text)))
        end = data.draw(st.integers(start, min(len(text), start + 4)))
        text = text[:start] + data.draw(st.sampled_from(["", *NOISE])) + text[end:]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=20), label="cuts")
    parser_class = get_tool_parser(name)
    extracted = parser_class(TOOLS).extract(text)
    assert_same(stream(parser_class(TOOLS), split(text, cuts)), extracted)


# -- the JSON scanner against json.loads --------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=12,
)


def _reject_constant(name: str) -> None:
    raise ValueError(name)


def scan(text: str, cuts: list[int]) -> int | None:
    """Where the scanner says the value ends (None: it never ends; -1: invalid)."""
    scanner = JsonValueScanner(collect=True)
    offset = 0
    try:
        for chunk in split(text, cuts):
            end = scanner.feed(chunk, 0)
            if end >= 0:
                return offset + end
            offset += len(chunk)
    except JsonScanError:
        return -1
    return None


@settings(max_examples=300, deadline=None)
@given(
    value=JSON_VALUES,
    indent=st.sampled_from([None, 0, 2]),
    cuts=st.lists(st.integers(0, 400), max_size=8),
    edit=st.tuples(st.integers(0, 400), st.sampled_from(["", "x", ",", "}", "]", '"', "0", "e"])),
)
def test_json_scanner_agrees_with_json_loads(
    value: Any, indent: int | None, cuts: list[int], edit: tuple[int, str]
) -> None:
    text = json.dumps(value, indent=indent, ensure_ascii=False)
    where, replacement = edit
    where = min(where, len(text))
    for candidate in (text, text[:where] + replacement + text[where + 1 :]):
        padded = candidate + " "  # a top-level number ends only at a character after it
        end = scan(padded, [c for c in cuts if c <= len(padded)])
        try:
            json.loads(candidate, strict=False, parse_constant=_reject_constant)
            valid = True
        except ValueError:
            valid = False
        accepted = end is not None and end >= 0 and not padded[end:].strip()
        assert accepted == valid, (candidate, end)


def test_json_scanner_normalizes_control_characters() -> None:
    scanner = JsonValueScanner(collect=True)
    assert scanner.feed('{"a": "x\ny\t\x01"}', 0) > 0
    assert json.loads(scanner.take_output()) == {"a": "x\ny\t\x01"}


def test_json_scanner_refuses_excessive_depth() -> None:
    scanner = JsonValueScanner()
    with pytest.raises(JsonScanError) as info:
        scanner.feed("[" * (MAX_JSON_DEPTH + 1), 0)
    assert info.value.pos == MAX_JSON_DEPTH


# -- linear time on pathological outputs ----------------------------------------------------------

# Of this thread's CPU time, so that other jobs on a shared box do not count against it.
# Linear work here takes 0.2-1.0 s on a busy 2-core box; a quadratic parser takes minutes.
TIME_LIMIT_S = 2.0


def chunked(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


# name -> (parser, output, characters per delta). Sized so a quadratic parser would take
# minutes, and this one a few tenths of a second, on a shared core.
PATHOLOGICAL = {
    "hermes: 100k unclosed tags": ("hermes", "<tool_call>" * 100_000, 44),
    "hermes: 50k unclosed tags, a tag per delta": ("hermes", "<tool_call>" * 50_000, 11),
    "hermes: 10k unknown names": (
        "hermes",
        '<tool_call>{"name": "nope", "arguments": {' * 10_000,
        16,
    ),
    "hermes: deep nesting past the cap": (
        "hermes",
        '<tool_call>{"name": "search", "arguments": {"q": ' + "[" * 200_000,
        16,
    ),
    "hermes: nesting under the cap, many times": (
        "hermes",
        ('<tool_call>{"name": "search", "arguments": {"q": ' + "[" * 500 + "]" * 500 + "}}") * 100,
        16,
    ),
    "hermes: 1 MB string argument": (
        "hermes",
        '<tool_call>{"name": "search", "arguments": {"query": "' + "ab\\n" * 250_000,
        64,
    ),
    "hermes: 1 MB of whitespace": ("hermes", "x" + " \n" * 500_000, 64),
    "hermes: 1 MB held header": (
        "hermes",
        '<tool_call>{"arguments": {"q": "' + "y" * 1_000_000,
        64,
    ),
    "llama3_json: 10k calls": (
        "llama3_json",
        '{"name": "get_time", "parameters": {}}; ' * 10_000,
        16,
    ),
    "mistral: 100k unclosed markers": ("mistral", "[TOOL_CALLS]" * 100_000, 48),
    "mistral: 40k unclosed args tags": ("mistral", "[TOOL_CALLS]get_time[AR" * 40_000, 24),
    "pythonic: deep parentheses": ("pythonic", "[search(query=" + "(" * 300_000, 16),
    "pythonic: 10k calls": ("pythonic", "[" + "get_time(), " * 10_000 + "]", 16),
    "pythonic: 1 MB unterminated string": ("pythonic", "[search(query='''" + "z" * 1_000_000, 64),
}


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL))
def test_pathological_outputs_take_linear_time(name: str) -> None:
    parser_name, text, size = PATHOLOGICAL[name]
    parser_class = get_tool_parser(parser_name)
    pieces = chunked(text, size)
    parser = parser_class(TOOLS)
    start = time.thread_time()
    messages = [parser.feed(piece) for piece in pieces]
    messages.append(parser.finish())
    elapsed = time.thread_time() - start
    assert elapsed < TIME_LIMIT_S, f"streamed: {elapsed:.2f} s"
    start = time.thread_time()
    extracted = parser_class(TOOLS).extract(text)
    elapsed = time.thread_time() - start
    assert elapsed < TIME_LIMIT_S, f"extracted: {elapsed:.2f} s"
    content = "".join(message.content or "" for message in messages)
    assert content == (extracted.content or "")
    calls = [call.name for message in messages for call in message.tool_calls]
    assert calls == [call.name for call in extracted.tool_calls]
