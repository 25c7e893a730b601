"""Reasoning parsers over recorded outputs: the non-streamed split as recorded, the streamed one
equal to it at every split point and in random chunks, and linear time on long outputs."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from render_server.parsing.reasoning import (
    REASONING_PARSERS,
    ReasoningDelta,
    ReasoningParser,
    UnknownReasoningParserError,
    get_reasoning_parser,
)
from tests.helpers.data import DATA_DIR

CASES: list[dict[str, Any]] = json.loads(
    (DATA_DIR / "parser_outputs" / "reasoning.json").read_text("utf-8")
)["cases"]


def make(case: dict[str, Any]) -> ReasoningParser:
    return get_reasoning_parser(case["parser"])(enable_thinking=case["enable_thinking"])


def stream(parser: ReasoningParser, chunks: list[str]) -> ReasoningDelta:
    """Feed the chunks, checking the order rules, and join what came out."""
    reasoning, content = [], []
    for delta in [*(parser.feed(chunk) for chunk in chunks), parser.finish()]:
        assert delta.reasoning != "", "nothing is an empty string"
        assert delta.content != "", "nothing is an empty string"
        if delta.reasoning is not None:
            assert not content, "reasoning never comes after content"
            reasoning.append(delta.reasoning)
        if delta.content is not None:
            assert parser.is_reasoning_done, "content only once the reasoning is done"
            content.append(delta.content)
    return ReasoningDelta("".join(reasoning) or None, "".join(content) or None)


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def case_id(case: dict[str, Any]) -> str:
    return f"{case['parser']}: {case['label']}"


def test_registry() -> None:
    assert {"deepseek_r1", "qwen3"} <= set(REASONING_PARSERS)
    for name, parser in REASONING_PARSERS.items():
        assert get_reasoning_parser(name) is parser
    with pytest.raises(KeyError) as info:
        get_reasoning_parser("o1")
    assert isinstance(info.value, UnknownReasoningParserError)
    assert "'o1'" in str(info.value)
    assert "deepseek_r1" in str(info.value)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_recorded_extract(case: dict[str, Any]) -> None:
    reasoning, content = make(case).extract(case["text"])
    assert (reasoning, content) == (case["reasoning"], case["content"])


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_recorded_every_split_point(case: dict[str, Any]) -> None:
    """Two pieces, cut at every character: a tag split anywhere is still found."""
    text = case["text"]
    expected = make(case).extract(text)
    for cut in range(len(text) + 1):
        assert stream(make(case), [text[:cut], text[cut:]]) == expected, cut
    assert stream(make(case), list(text)) == expected


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_recorded_random_chunks(data: st.DataObject) -> None:
    case = data.draw(st.sampled_from(CASES), label="case")
    text = case["text"]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)), label="cuts")
    assert stream(make(case), split(text, cuts)) == make(case).extract(text)


# Text made of the tags' own characters, so near-misses and partial tags are common.
TAG_ALPHABET = st.text(st.sampled_from("<>/thinkx \n"), max_size=30)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(REASONING_PARSERS)),
    opened=st.booleans(),
    reasoning=TAG_ALPHABET,
    content=TAG_ALPHABET,
    data=st.data(),
)
def test_generated_outputs(
    name: str, opened: bool, reasoning: str, content: str, data: st.DataObject
) -> None:
    parser_class = get_reasoning_parser(name)
    reasoning = reasoning.replace("</think>", "")
    if reasoning.lstrip(" \n").startswith("<think>"):
        reasoning = "x" + reasoning
    text = ("<think>" if opened else "") + reasoning + "</think>" + content
    expected = parser_class().extract(text)
    if opened or not parser_class.requires_start_tag:
        assert expected == ReasoningDelta(reasoning or None, content.lstrip(" \n") or None)
    else:  # qwen3 without its opening tag: all content
        assert expected == ReasoningDelta(None, text)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12), label="cuts")
    assert stream(parser_class(), split(text, cuts)) == expected
    assert parser_class(enable_thinking=False).extract(text) == ReasoningDelta(None, text)


def test_is_reasoning_done_follows_the_tags() -> None:
    parser = get_reasoning_parser("qwen3")()
    assert not parser.is_reasoning_done
    assert parser.feed("\n<thi") == (None, None)
    assert parser.feed("nk>plan</th") == ("plan", None)
    assert not parser.is_reasoning_done
    assert parser.feed("ink>\n\n") == (None, None)
    assert parser.is_reasoning_done
    assert parser.feed("Answer") == (None, "Answer")
    assert get_reasoning_parser("qwen3")(enable_thinking=False).is_reasoning_done
    no_tag = get_reasoning_parser("qwen3")()
    assert no_tag.feed("Hi") == (None, "Hi")
    assert no_tag.is_reasoning_done


def test_deepseek_r1_streams_reasoning_without_an_opening_tag() -> None:
    parser = get_reasoning_parser("deepseek_r1")()
    assert parser.feed("Okay") == ("Okay", None)
    assert parser.feed(", so</") == (", so", None)
    assert parser.feed("think>Yes") == (None, "Yes")
    assert parser.finish() == (None, None)


def test_feed_after_finish_is_an_error() -> None:
    parser = get_reasoning_parser("deepseek_r1")()
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


@pytest.mark.parametrize(
    ("name", "text", "size"),
    [
        ("deepseek_r1", "</thin" * 200_000, 16),
        ("qwen3", "<think>" + "</thin" * 50_000, 4),
        ("qwen3", " \n" * 500_000 + "<think>x</think>y", 16),
        ("deepseek_r1", "reasoning " * 100_000 + "</think>" + "answer " * 100_000, 16),
    ],
    ids=["near-miss end tags", "near-miss end tags, small deltas", "1 MB lead", "2 MB"],
)
def test_long_outputs_take_linear_time(name: str, text: str, size: int) -> None:
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    parser = get_reasoning_parser(name)()
    start = time.thread_time()  # CPU time: other jobs on a shared box do not count
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    # Linear work takes 0.1-1.3 s (a late test in a long run pays for its collections);
    # a quadratic parser takes minutes.
    assert time.thread_time() - start < 2.0
    reasoning = "".join(delta.reasoning or "" for delta in deltas) or None
    content = "".join(delta.content or "" for delta in deltas) or None
    assert (reasoning, content) == get_reasoning_parser(name)().extract(text)


@pytest.mark.parametrize(
    ("tail", "ended"),
    [
        ("<|im_start|>assistant\n", False),
        ("<|im_start|>assistant\n<think>\n", False),  # R1's template opens it
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", True),  # thinking off
        ("</think>\n<|im_start|>user\nagain<|im_start|>assistant\n<think>\n", False),
    ],
)
def test_a_prompt_ends_reasoning_with_an_end_tag_after_the_last_start(
    tail: str, ended: bool
) -> None:
    for parser in REASONING_PARSERS.values():
        assert parser.prompt_ends_reasoning(tail) is ended
