"""Checks of vLLM's own request fields over real processes, for the field walk
(tests/e2e/test_vllm_field_walk.py): each sends the field as a vLLM client would and
asserts what that client sees, or that it is refused with a 400 naming it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

MODEL = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
EOS = 2  # <|im_end|>


@dataclass
class Walk:
    """The servers a check talks to: `http` the shared render-serve, `trusted` one that
    runs request chat templates."""

    http: httpx.Client
    trusted: httpx.Client
    model: str = MODEL
    prompt: str = "The capital of France is"
    eos: int = EOS
    passed: set[Callable[[Walk], Any]] = field(default_factory=set)
    """Checks that passed: one check can prove several fields (max_tokens and
    max_completion_tokens) and runs once."""

    def run(self, check: Callable[[Walk], Any]) -> None:
        if check not in self.passed:
            check(self)
            self.passed.add(check)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.http.post(path, json=body)
        assert response.status_code == 200, response.text
        return response.json()

    def chat(self, fields: dict[str, Any]) -> dict[str, Any]:
        return self.post(CHAT, {"messages": QUESTION, "temperature": 0, **fields})

    def stream(self, path: str, fields: dict[str, Any]) -> list[dict[str, Any]]:
        """A streamed request's events, [DONE] left out."""
        base = {"messages": QUESTION} if path == CHAT else {"prompt": self.prompt}
        body = {**base, "temperature": 0, "stream": True, **fields}
        with self.http.stream("POST", path, json=body) as response:
            assert response.status_code == 200, response.read()
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        return [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]

    def tokens(self, body: dict[str, Any], server: httpx.Client | None = None) -> list[int]:
        """What /tokenize says of `body` (a prompt, or messages)."""
        return (server or self.http).post("/tokenize", json=body).json()["tokens"]

    def assert_refused(self, path: str, fields: dict[str, Any], name: str) -> None:
        base = {"messages": QUESTION} if path == CHAT else {"prompt": self.prompt}
        response = self.http.post(path, json={**base, "max_tokens": 1, **fields})
        assert response.status_code == 400, (name, response.text)
        assert name in (response.json()["error"]["param"] or ""), response.text


@dataclass(frozen=True)
class Honoured:
    """`check` sends the field and asserts its documented `effect`."""

    check: Callable[[Walk], Any]
    effect: str


@dataclass(frozen=True)
class Refused:
    """Set to `value` (with `with_fields`), the field is a 400 naming it."""

    value: Any
    why: str
    with_fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CoveredBy:
    """The effect needs a server configured otherwise; `test` asserts it there."""

    test: Callable[..., None]


def complete(walk: Walk, fields: dict[str, Any]) -> dict[str, Any]:
    """A greedy completion of the walk's prompt (with token ids), `fields` laid over it."""
    body = {"prompt": walk.prompt, "temperature": 0, "return_token_ids": True, **fields}
    return walk.post(COMPLETIONS, body)


def token_ids(reply: dict[str, Any]) -> list[int]:
    return reply["choices"][0]["token_ids"]


def _cache_salt(walk: Walk) -> None:
    # Over two blocks (16 tokens each) of a prompt no earlier request sent.
    prompt = f"{uuid.uuid4().hex} " + "the quick brown fox jumps over the lazy dog " * 2

    def cached(salt: str | None) -> int:
        fields: dict[str, Any] = {"prompt": prompt, "max_tokens": 1}
        if salt is not None:
            fields["cache_salt"] = salt
        return complete(walk, fields)["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # another salt never meets a's blocks
    assert cached("tenant-a") >= 16  # the same salt does
    assert cached(None) == 0
    walk.assert_refused(COMPLETIONS, {"cache_salt": ""}, "cache_salt")


def _request_id(walk: Walk) -> None:
    request_id = f"walk-{uuid.uuid4().hex[:8]}"
    assert complete(walk, {"request_id": request_id, "max_tokens": 1})["id"] == f"cmpl-{request_id}"
    body = {"messages": QUESTION, "request_id": request_id, "max_tokens": 200, "stream": True}
    with walk.http.stream("POST", CHAT, json={**body, "ignore_eos": True}) as running:
        lines = running.iter_lines()
        first = json.loads(next(line for line in lines if line)[6:])
        assert first["id"] == f"chatcmpl-{request_id}"
        # The same id while it runs (and right after it is dropped, while its last tokens
        # may still be on their way): a request of its own, none of the other's tokens.
        again = walk.chat({"request_id": request_id, "max_tokens": 1})
        assert again["id"] == f"chatcmpl-{request_id}"
        assert again["usage"]["completion_tokens"] == 1
    again = walk.chat({"request_id": request_id, "max_tokens": 1})
    assert again["usage"]["completion_tokens"] == 1


def _truncate(walk: Walk) -> None:
    ids = walk.tokens({"prompt": walk.prompt})
    reply = complete(walk, {"truncate_prompt_tokens": 2, "echo": True, "max_tokens": 1})
    assert reply["usage"]["prompt_tokens"] == 2
    assert reply["choices"][0]["prompt_token_ids"] == ids[-2:]
    tail = walk.http.post("/detokenize", json={"tokens": ids[-2:]}).json()["prompt"]
    assert reply["choices"][0]["text"].startswith(tail)
    assert walk.chat({"truncate_prompt_tokens": 5, "max_tokens": 1})["usage"]["prompt_tokens"] == 5
    walk.assert_refused(COMPLETIONS, {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens")


def _prompt_logprobs(walk: Walk) -> None:
    reply = complete(walk, {"prompt_logprobs": 2, "max_tokens": 1, "n": 2})
    choice, other = reply["choices"]
    assert other["prompt_logprobs"] == choice["prompt_logprobs"]  # one prompt, scored once
    prompt_ids, entries = choice["prompt_token_ids"], choice["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) == reply["usage"]["prompt_tokens"]
    assert entries[0] is None  # nothing precedes the first token
    for token_id, entry in zip(prompt_ids[1:], entries[1:], strict=True):
        # The prompt's own token with its rank, and the top 2 (ranks 1 and 2).
        assert str(token_id) in entry
        assert 2 <= len(entry) <= 3
        assert {item["rank"] for item in entry.values()} >= {1, 2}
        assert all(item["logprob"] <= 0 and "decoded_token" in item for item in entry.values())
    chat = walk.chat({"prompt_logprobs": 0, "max_tokens": 1})
    assert chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    walk.assert_refused(COMPLETIONS, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs")


def _allowed_token_ids(walk: Walk) -> None:
    allowed = [1000, 1001, 1002]
    reply = complete(walk, {"allowed_token_ids": allowed, "max_tokens": 4, "ignore_eos": True})
    assert set(token_ids(reply)) <= set(allowed)
    walk.assert_refused(COMPLETIONS, {"allowed_token_ids": [10**6]}, "allowed_token_ids")


def _bad_words(walk: Walk) -> None:
    assert "Paris" in complete(walk, {"max_tokens": 3})["choices"][0]["text"]
    text = complete(walk, {"bad_words": ["Paris"], "max_tokens": 3})["choices"][0]["text"]
    assert "Paris" not in text
    reply = walk.chat({"bad_words": ["Paris"], "max_tokens": 12})
    assert "Paris" not in reply["choices"][0]["message"]["content"]


def _return_token_ids(walk: Walk) -> None:
    expected = walk.tokens({"messages": QUESTION})
    whole = walk.chat({"return_token_ids": True, "max_tokens": 4})
    assert whole["prompt_token_ids"] == expected
    ids = whole["choices"][0]["token_ids"]
    assert len(ids) == whole["usage"]["completion_tokens"]
    # Streamed: the prompt's ids on the first chunk, each chunk's own ids after it.
    events = walk.stream(CHAT, {"return_token_ids": True, "max_tokens": 4})
    assert events[0]["prompt_token_ids"] == expected
    assert [i for event in events[1:] for i in event["choices"][0]["token_ids"]] == ids
    # Completions: on each choice, as vLLM puts them (each prompt has its own).
    events = walk.stream(COMPLETIONS, {"return_token_ids": True, "max_tokens": 2, "n": 2})
    firsts = {}
    for event in events:
        [choice] = event["choices"]
        firsts.setdefault(choice["index"], choice)
    assert all(choice["prompt_token_ids"] for choice in firsts.values())
    assert sorted(firsts) == [0, 1]


def _tokens_as_ids(walk: Walk) -> None:
    spelled_as_ids = {"return_tokens_as_token_ids": True, "logprobs": True, "top_logprobs": 1}
    reply = walk.chat({**spelled_as_ids, "return_token_ids": True, "max_tokens": 3})
    choice = reply["choices"][0]
    spelled = [entry["token"] for entry in choice["logprobs"]["content"]]
    assert spelled == [f"token_id:{i}" for i in choice["token_ids"]]
    assert choice["logprobs"]["content"][0]["top_logprobs"][0]["token"].startswith("token_id:")
    body = {"return_tokens_as_token_ids": True, "logprobs": 1, "max_tokens": 2}
    logprobs = complete(walk, body)["choices"][0]["logprobs"]
    assert all(token.startswith("token_id:") for token in logprobs["tokens"])


def _echo(walk: Walk) -> None:
    text = complete(walk, {"echo": True, "max_tokens": 1})["choices"][0]["text"]
    assert text.startswith(walk.prompt)
    # Chat: the answer continues the last (assistant) message and starts with it.
    messages = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    body = {"messages": messages, "echo": True, "max_tokens": 2}
    body |= {"add_generation_prompt": False, "continue_final_message": True}
    content = walk.chat(body)["choices"][0]["message"]["content"]
    assert content.startswith("The capital of France is ")
    events = walk.stream(CHAT, body)
    assert events[1]["choices"][0]["delta"]["content"] == "The capital of France is"
    # The user's last message is not the answer's role: nothing is echoed.
    assert not walk.chat({"echo": True, "max_tokens": 2})["choices"][0]["message"][
        "content"
    ].startswith(QUESTION[0]["content"])


def _stream_options(walk: Walk) -> None:
    events = walk.stream(COMPLETIONS, {"max_tokens": 2, "stream_options": {"include_usage": True}})
    assert events[-1]["usage"]["completion_tokens"] == 2
    assert all(event["usage"] is None for event in events[:-1])
    # vLLM's continuous_usage_stats: the usage so far on every chunk.
    events = walk.stream(
        CHAT, {"max_tokens": 3, "stream_options": {"continuous_usage_stats": True}}
    )
    counts = [event["usage"]["completion_tokens"] for event in events]
    assert counts == sorted(counts)
    assert counts[0] == 0
    assert counts[-1] == 3
    walk.assert_refused(COMPLETIONS, {"stream_options": {"include_usage": True}}, "stream_options")


def _stop_token_ids(walk: Walk) -> None:
    # "." made certain and made a stop token: the answer ends there, without it.
    body = {"logit_bias": {"30": 100}, "stop_token_ids": [30], "max_tokens": 4}
    choice = complete(walk, body)["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("", "stop", 30)
    assert choice["token_ids"] == [30]
    choice = complete(walk, {**body, "include_stop_str_in_output": True})["choices"][0]
    assert (choice["text"], choice["stop_reason"]) == (".", 30)


def vllm_checks() -> dict[str, Honoured | Refused | CoveredBy]:
    """The walk's entries for vLLM's own fields."""
    return {
        "cache_salt": Honoured(_cache_salt, "equal salts share cached blocks, others never"),
        "request_id": Honoured(_request_id, "the response id; reusing it mixes nothing"),
        "truncate_prompt_tokens": Honoured(_truncate, "only the last N prompt tokens"),
        "prompt_logprobs": Honoured(_prompt_logprobs, "each prompt token's logprobs"),
        "allowed_token_ids": Honoured(_allowed_token_ids, "only these are sampled"),
        "bad_words": Honoured(_bad_words, "never generated"),
        "return_token_ids": Honoured(_return_token_ids, "prompt and output ids"),
        "return_tokens_as_token_ids": Honoured(_tokens_as_ids, "tokens spelled token_id:N"),
        "echo": Honoured(_echo, "the prompt (chat: the last assistant message) starts it"),
        "stream_options": Honoured(_stream_options, "usage chunks; refused without stream"),
        "stop_token_ids": Honoured(_stop_token_ids, "ends the output, not in the text"),
        "include_stop_str_in_output": Honoured(_stop_token_ids, "the stop token's text kept"),
        "priority": Refused(1, "the test workers schedule fcfs (vLLM refuses it there too)"),
        "vllm_xargs": Refused({"some_extension_arg": 1}, "no extension takes arguments"),
        "use_beam_search": Refused(True, "no beam search"),
        "length_penalty": Refused(0.5, "beam search only"),
        "spaces_between_special_tokens": Refused(False, "decoded as the tokenizer joins"),
        "logits_processors": Refused(["my.module.Processor"], "no code by name"),
        "kv_transfer_params": Refused({"do_remote_decode": True}, "no disaggregated KV"),
        "mm_processor_kwargs": Refused({"size": 1}, "no multimodal input"),
        "prompt_embeds": Refused("AAAA", "no prompt embeddings"),
        "suffix": Refused("x", "no insertion"),
        "reasoning_effort": Refused("low", "the template takes none"),
        "structural_tag": Refused("{}", "no structural tags"),
        "guided_decoding_backend": Refused("xgrammar", "the backend is the server's"),
        "guided_whitespace_pattern": Refused(" ", "not supported"),
    }
