"""Every field of vLLM's chat and completion request schemas, walked over real processes:
each is honoured (a request that sets it shows its documented effect) or refused (a 400
whose `param` names it). None is accepted and ignored.

The checks of vLLM's own fields that duet added for them live in
tests/e2e/vllm_field_checks.py; this file holds the field lists, the table and the
checks of OpenAI's fields.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from render_server.schemas.generation import ChatCompletionRequest, CompletionRequest
from tests.e2e import test_structured_outputs, test_tools
from tests.e2e.vllm_field_checks import (
    CHAT,
    COMPLETIONS,
    CoveredBy,
    Honoured,
    Refused,
    Walk,
    complete,
    token_ids,
    vllm_checks,
)
from tests.helpers.processes import ServerProcess, WorkerProcess, start_render, stop_server

# vLLM's request fields, from vllm/entrypoints/openai/protocol.py: ChatCompletionRequest
# and CompletionRequest at vllm-project/vllm@ec3b890c14b0 (v0.11), plus the fields v0.10
# still had (vllm-project/vllm@0052bed36509: best_of on chat, guided_*, structural_tag).
VLLM_CHAT_FIELDS = (
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs",
    "max_tokens", "max_completion_tokens", "n", "presence_penalty", "response_format",
    "seed", "stop", "stream", "stream_options", "temperature", "top_p", "tools",
    "tool_choice", "reasoning_effort", "include_reasoning", "parallel_tool_calls", "user",
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "prompt_logprobs", "allowed_token_ids", "bad_words", "echo", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "documents", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs", "structured_outputs", "priority",
    "request_id", "logits_processors", "return_tokens_as_token_ids", "return_token_ids",
    "cache_salt", "kv_transfer_params", "vllm_xargs",
    # v0.10
    "best_of", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "structural_tag", "guided_decoding_backend", "guided_whitespace_pattern",
)  # fmt: skip
VLLM_COMPLETION_FIELDS = (
    "model", "prompt", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens",
    "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
    "temperature", "top_p", "user", "use_beam_search", "top_k", "min_p",
    "repetition_penalty", "length_penalty", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs", "prompt_embeds",
    "add_special_tokens", "response_format", "structured_outputs", "priority", "request_id",
    "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
    "kv_transfer_params", "vllm_xargs",
    # v0.10
    "best_of", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern",
)  # fmt: skip

# A prompt whose greedy continuation changes under each penalty (found by trying).
REPEATS = "Hello Hello Hello Hello Hello"


def _greedy_ids(walk: Walk, **fields: Any) -> list[int]:
    body = {"temperature": 0, "max_tokens": 6, "ignore_eos": True, "prompt": REPEATS}
    return token_ids(complete(walk, {**body, **fields}))


def _is_argmax(walk: Walk, **fields: Any) -> None:
    """Sampling at temperature 1 with `fields` picks the most likely token every time."""
    body = {"temperature": 1.0, "seed": 5, "max_tokens": 6, "logprobs": 1, **fields}
    logprobs = complete(walk, body)["choices"][0]["logprobs"]
    for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True):
        assert max(top, key=top.get) == token


def _penalty(name: str) -> Honoured:
    def check(walk: Walk) -> None:
        assert _greedy_ids(walk, **{name: 2.0}) != _greedy_ids(walk)

    return Honoured(check, "the greedy continuation of a repetitive prompt changes")


def _n(walk: Walk) -> None:
    assert len(complete(walk, {"n": 2, "max_tokens": 1})["choices"]) == 2


def _best_of(walk: Walk) -> None:
    assert len(complete(walk, {"n": 2, "best_of": 2, "max_tokens": 1})["choices"]) == 2
    walk.assert_refused(COMPLETIONS, {"n": 1, "best_of": 3}, "best_of")


def _seed(walk: Walk) -> None:
    body = {"temperature": 2.0, "max_tokens": 8, "ignore_eos": True}
    first, again, other = (token_ids(complete(walk, {**body, "seed": s})) for s in (1, 1, 2))
    assert first == again != other


def _logit_bias(walk: Walk) -> None:
    assert token_ids(complete(walk, {"logit_bias": {"1000": 100}, "max_tokens": 3})) == [1000] * 3


def _stop(walk: Walk) -> None:
    choice = complete(walk, {"temperature": 0, "max_tokens": 6, "stop": ["."]})["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
        " Paris",
        "stop",
        ".",
    )


def _min_tokens(walk: Walk) -> None:
    # EOS is the only likely token, but none may end the output before 3 others.
    body = {"logit_bias": {str(walk.eos): 100}, "max_tokens": 6}
    assert token_ids(complete(walk, body)) == [walk.eos]
    ids = token_ids(complete(walk, {**body, "min_tokens": 3}))
    assert len(ids) == 4
    assert ids[-1] == walk.eos


def _ignore_eos(walk: Walk) -> None:
    body = {"logit_bias": {str(walk.eos): 100}, "max_tokens": 3, "ignore_eos": True}
    choice = complete(walk, body)["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["token_ids"] == [walk.eos] * 3


def _skip_special_tokens(walk: Walk) -> None:
    body = {"logit_bias": {"1": 100}, "max_tokens": 2}  # <|im_start|>
    assert complete(walk, body)["choices"][0]["text"] == ""
    body["skip_special_tokens"] = False
    assert complete(walk, body)["choices"][0]["text"] == "<|im_start|>" * 2


def _max_tokens(walk: Walk) -> None:
    assert complete(walk, {"max_tokens": 3, "ignore_eos": True})["usage"]["completion_tokens"] == 3
    body = {"max_completion_tokens": 2, "ignore_eos": True}
    assert walk.chat(body)["usage"]["completion_tokens"] == 2


def _logprobs(walk: Walk) -> None:
    logprobs = complete(walk, {"logprobs": 2, "max_tokens": 2})["choices"][0]["logprobs"]
    assert [len(top) for top in logprobs["top_logprobs"]] == [2, 2]
    content = walk.chat({"logprobs": True, "top_logprobs": 3, "max_tokens": 2})["choices"][0][
        "logprobs"
    ]["content"]
    assert [len(entry["top_logprobs"]) for entry in content] == [3, 3]


def _stream(walk: Walk) -> None:
    events = walk.stream(COMPLETIONS, {"max_tokens": 3, "ignore_eos": True})
    assert len(events) == 3
    assert [event["choices"][0]["finish_reason"] for event in events] == [None, None, "length"]


def _prompt(walk: Walk) -> None:
    text = complete(walk, {"max_tokens": 2})["choices"][0]["text"]
    assert (
        complete(walk, {"prompt": walk.prompt + text, "max_tokens": 1})["usage"]["prompt_tokens"]
        > complete(walk, {"max_tokens": 1})["usage"]["prompt_tokens"]
    )


def _add_special_tokens(walk: Walk) -> None:
    """The tokenizer's special tokens, as /tokenize adds them (this tokenizer adds none, so
    the ids are the same either way)."""
    for flag in (False, True):
        tokens = walk.tokens({"prompt": walk.prompt, "add_special_tokens": flag})
        body = {"add_special_tokens": flag, "max_tokens": 1}
        assert complete(walk, body)["choices"][0]["prompt_token_ids"] == tokens
    messages = [{"role": "user", "content": "hi"}]
    tokens = walk.tokens({"messages": messages, "add_special_tokens": True})
    body = {"messages": messages, "add_special_tokens": True, "return_token_ids": True}
    assert walk.chat({**body, "max_tokens": 1})["prompt_token_ids"] == tokens


def _generation_prompt(walk: Walk) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    open_turn = walk.chat(
        {
            "messages": messages,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "max_tokens": 1,
        }
    )
    closed = walk.chat({"messages": messages, "max_tokens": 1})
    assert open_turn["usage"]["prompt_tokens"] < closed["usage"]["prompt_tokens"]


def _model(walk: Walk) -> None:
    assert complete(walk, {"model": walk.model, "max_tokens": 1})["model"] == walk.model
    response = walk.http.post(COMPLETIONS, json={"prompt": "x", "model": "other"})
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "model"


def _guided(name: str, value: Any, pattern: str) -> Honoured:
    def check(walk: Walk) -> None:
        text = complete(walk, {name: value, "max_tokens": 8})["choices"][0]["text"]
        assert re.fullmatch(pattern, text), text

    return Honoured(check, "the output matches the constraint")


TEMPLATE = "{{ messages[0].content }}|{{ documents[0].text }}|{{ flavor }}"


def _template_field(name: str, value: Any, rendered: str) -> Honoured:
    """A request chat template (the trusted server) that prints the field: the prompt is
    exactly its rendering."""

    def check(walk: Walk) -> None:
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "chat_template": TEMPLATE,
            "documents": [{"text": "doc"}],
            "chat_template_kwargs": {"flavor": "x"},
            name: value,
            "max_tokens": 1,
            "return_token_ids": True,
        }
        tokens = walk.tokens({"prompt": rendered, "add_special_tokens": False}, walk.trusted)
        reply = walk.trusted.post(CHAT, json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["prompt_token_ids"] == tokens
        if name == "chat_template":  # only a server that trusts request templates runs one
            walk.assert_refused(CHAT, {"chat_template": TEMPLATE}, "chat_template")

    return Honoured(check, "the chat template sees it")


def _tool_fields(walk: Walk) -> None:
    parameters = {"type": "object", "properties": {}, "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "ping", "parameters": parameters}}
    body = {"tools": [tool], "tool_choice": "required", "parallel_tool_calls": False}
    reply = walk.chat({**body, "max_tokens": 40})
    calls = reply["choices"][0]["message"]["tool_calls"]
    assert [call["function"]["name"] for call in calls] == ["ping"]


CHECKS: dict[str, Honoured | Refused | CoveredBy] = {
    **vllm_checks(),
    "messages": Honoured(_generation_prompt, "rendered through the chat template"),
    "prompt": Honoured(_prompt, "the prompt is what is continued"),
    "model": Honoured(_model, "another name is a 404 naming model"),
    "user": Honoured(
        lambda walk: complete(walk, {"user": "someone", "max_tokens": 1}),
        "OpenAI's end-user id for the caller's abuse monitoring: no effect on the output, "
        "as in OpenAI's API and vLLM; accepted",
    ),
    "temperature": Honoured(lambda walk: _is_argmax(walk, temperature=0), "0 is greedy"),
    "top_k": Honoured(lambda walk: _is_argmax(walk, top_k=1), "1 keeps the top token"),
    "top_p": Honoured(lambda walk: _is_argmax(walk, top_p=1e-6), "a tiny nucleus"),
    "min_p": Honoured(lambda walk: _is_argmax(walk, min_p=1.0), "only the top token passes"),
    "presence_penalty": _penalty("presence_penalty"),
    "frequency_penalty": _penalty("frequency_penalty"),
    "repetition_penalty": _penalty("repetition_penalty"),
    "seed": Honoured(_seed, "same seed, same tokens"),
    "logit_bias": Honoured(_logit_bias, "+100 makes a token certain"),
    "n": Honoured(_n, "n choices"),
    "best_of": Honoured(_best_of, "equal to n; anything else is refused"),
    "stop": Honoured(_stop, "cut before the stop string"),
    "min_tokens": Honoured(_min_tokens, "EOS held off"),
    "ignore_eos": Honoured(_ignore_eos, "EOS does not end it"),
    "skip_special_tokens": Honoured(_skip_special_tokens, "special tokens in the text"),
    "max_tokens": Honoured(_max_tokens, "output length"),
    "max_completion_tokens": Honoured(_max_tokens, "output length"),
    "logprobs": Honoured(_logprobs, "logprobs returned"),
    "top_logprobs": Honoured(_logprobs, "that many alternatives"),
    "stream": Honoured(_stream, "server-sent events"),
    "add_special_tokens": Honoured(_add_special_tokens, "as /tokenize adds them"),
    "add_generation_prompt": Honoured(_generation_prompt, "the assistant header"),
    "continue_final_message": Honoured(_generation_prompt, "the last turn stays open"),
    "chat_template": _template_field("chat_template", TEMPLATE, "hi|doc|x"),
    "documents": _template_field("documents", [{"text": "other"}], "hi|other|x"),
    "chat_template_kwargs": _template_field("chat_template_kwargs", {"flavor": "y"}, "hi|doc|y"),
    "guided_json": _guided("guided_json", {"enum": ["yes", "no"]}, '"(yes|no)"'),
    "guided_regex": _guided("guided_regex", "[0-9]{3}", "[0-9]{3}"),
    "guided_grammar": _guided("guided_grammar", 'start: "ab" | "cd"', "ab|cd"),
    "guided_choice": CoveredBy(test_structured_outputs.test_completions_with_guided_choice),
    "response_format": CoveredBy(test_structured_outputs.test_json_schema_response_format),
    "structured_outputs": CoveredBy(test_structured_outputs.test_structured_outputs_regex),
    "tools": Honoured(_tool_fields, "the call is one of the tools"),
    "tool_choice": Honoured(_tool_fields, '"required" makes a call'),
    "parallel_tool_calls": Honoured(_tool_fields, "false: exactly one call"),
    # Needs a --reasoning-parser (the tools server of test_tools.py).
    "include_reasoning": CoveredBy(test_tools.test_reasoning_is_split_from_the_answer),
}


def test_every_vllm_field_is_walked_and_declared() -> None:
    """The table covers both of vLLM's lists, and duet's schemas declare every field (so
    none is dropped unseen as an unknown key)."""
    assert sorted(set(VLLM_CHAT_FIELDS) | set(VLLM_COMPLETION_FIELDS)) == sorted(CHECKS)
    assert set(VLLM_CHAT_FIELDS) <= set(ChatCompletionRequest.model_fields)
    assert set(VLLM_COMPLETION_FIELDS) <= set(CompletionRequest.model_fields)


@pytest.fixture(scope="module")
def trusted(
    worker_a: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """render-serve that runs request chat templates (documents and kwargs reach them)."""
    log = tmp_path_factory.mktemp("walk") / "render.log"
    server = start_render([worker_a.address], log, ["--trust-request-chat-template"])
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def walk(render: ServerProcess, trusted: ServerProcess) -> Iterator[Walk]:
    with (
        httpx.Client(base_url=render.base_url, timeout=60) as http,
        httpx.Client(base_url=trusted.base_url, timeout=60) as trusted_http,
    ):
        yield Walk(http, trusted_http)


@pytest.mark.parametrize("field", sorted(CHECKS))
def test_field(walk: Walk, field: str) -> None:
    check = CHECKS[field]
    if isinstance(check, Refused):
        for path, fields in ((CHAT, VLLM_CHAT_FIELDS), (COMPLETIONS, VLLM_COMPLETION_FIELDS)):
            if field in fields:
                walk.assert_refused(path, {field: check.value, **check.with_fields}, field)
    elif isinstance(check, Honoured):
        walk.run(check.check)
    else:  # run in its own module; here it must still exist under that name
        assert callable(check.test)
