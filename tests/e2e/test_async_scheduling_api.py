"""`gpu-worker --async-scheduling` over real processes: one worker with it and one without,
each behind its own render-serve, driven with the `openai` client. Every answer is the
same: greedy and seeded chat, logprobs, stop strings, structured outputs, streaming, n > 1
and a batch of concurrent requests (where steps overlap)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from tests.helpers.processes import (
    ServerProcess,
    WorkerProcess,
    free_port,
    spawn_server,
    spawn_worker,
    stop_server,
    stop_worker,
    wait_worker_ready,
)
from tests.helpers.waiting import wait_until

MODEL = "SmolLM2-135M-Instruct"
STARTUP_S = 180.0
MODES = {"in_order": [], "async": ["--async-scheduling"]}


@pytest.fixture(scope="module")
def clients(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, openai.OpenAI]]:
    base = tmp_path_factory.mktemp("async_api")
    addresses = {name: f"tcp://127.0.0.1:{free_port()}" for name in MODES}
    workers = {
        name: spawn_worker(base / f"{name}.log", [*args, "--bind", addresses[name]])
        for name, args in MODES.items()
    }
    renders: dict[str, ServerProcess] = {
        name: spawn_server(["--worker", address], base / f"render-{name}.log")
        for name, address in addresses.items()
    }
    try:
        deadline = time.monotonic() + STARTUP_S
        for name, process in workers.items():
            wait_worker_ready(process, base / f"{name}.log", deadline)
        wait_until(
            lambda: all(
                httpx.get(f"{r.base_url}/ready").status_code == 200 for r in renders.values()
            ),
            STARTUP_S,
            "both render-serves ready",
            interval_s=0.1,
            ignoring=(httpx.TransportError,),
        )
        yield {
            name: openai.OpenAI(base_url=f"{r.base_url}/v1", api_key="none", max_retries=0)
            for name, r in renders.items()
        }
    finally:
        for render in renders.values():
            stop_server(render)
        for process in workers.values():
            stop_worker(WorkerProcess(process, ""))


def _chat(client: openai.OpenAI, prompt: str, **options: Any) -> list[tuple[Any, ...]]:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=options.pop("max_tokens", 24),
        extra_body={"return_token_ids": True},
        **options,
    )
    out = []
    for choice in completion.choices:
        logprobs = None
        if choice.logprobs is not None and choice.logprobs.content is not None:
            logprobs = [
                (t.token, round(t.logprob, 4), [top.token for top in t.top_logprobs])
                for t in choice.logprobs.content
            ]
        extra = choice.model_extra or {}
        out.append((choice.message.content, extra["token_ids"], choice.finish_reason, logprobs))
    assert completion.usage is not None
    return [(*reply, completion.usage.completion_tokens) for reply in out]


def _cached_tokens(client: openai.OpenAI, prompt: str) -> int:
    """A greedy reply's cached prompt tokens (when the prefix cache held some of it; which
    choice of n > 1 finds the other's blocks depends on timing, so only n = 1 here)."""
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=0
    )
    assert completion.usage is not None
    details = completion.usage.prompt_tokens_details
    return 0 if details is None or details.cached_tokens is None else details.cached_tokens


REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("List the days of the week.", {"temperature": 0}),
    ("Tell me a story about a fox.", {"temperature": 0.9, "seed": 5}),
    ("Name three colours.", {"temperature": 0, "logprobs": True, "top_logprobs": 3}),
    ("Count from one to twenty in words.", {"temperature": 0, "stop": ["five"]}),
    ("Write a haiku.", {"temperature": 1.0, "seed": 11, "n": 2}),
    # Penalties: these steps run in order, beside the overlapped ones of other requests.
    ("Name ten animals.", {"temperature": 0, "frequency_penalty": 0.8, "presence_penalty": 0.3}),
    (
        "Give me a person as JSON.",
        {
            "temperature": 0.7,
            "seed": 3,
            "max_tokens": 48,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "person",
                    "schema": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                        "required": ["name", "age"],
                    },
                },
            },
        },
    ),
]


def test_each_request_gets_the_same_answer(clients: dict[str, openai.OpenAI]) -> None:
    for prompt, options in REQUESTS:
        want = _chat(clients["in_order"], prompt, **dict(options))
        got = _chat(clients["async"], prompt, **dict(options))
        assert got == want, prompt
    [(text, *_)] = _chat(clients["async"], REQUESTS[3][0], **dict(REQUESTS[3][1]))
    assert "five" not in text
    [(person, _, finish, *_)] = _chat(clients["async"], REQUESTS[6][0], **dict(REQUESTS[6][1]))
    if finish == "stop":
        assert set(json.loads(person)) >= {"name", "age"}


def test_a_repeated_prompt_hits_the_prefix_cache_alike(clients: dict[str, openai.OpenAI]) -> None:
    prompt = "Summarize the plot of a long adventure novel about sailors. " * 6
    cached = {name: [_cached_tokens(clients[name], prompt) for _ in range(2)] for name in MODES}
    assert cached["async"] == cached["in_order"]
    assert cached["async"][1] > cached["async"][0]


def test_concurrent_requests_overlap_and_match(clients: dict[str, openai.OpenAI]) -> None:
    prompts = [f"Say something about the number {i}." for i in range(8)]

    def run(name: str) -> list[list[tuple[Any, ...]]]:
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [
                pool.submit(_chat, clients[name], p, temperature=0.8, seed=i, max_tokens=16 + 2 * i)
                for i, p in enumerate(prompts)
            ]
            return [f.result() for f in futures]

    assert run("async") == run("in_order")


def test_a_stream_is_the_same(clients: dict[str, openai.OpenAI]) -> None:
    def stream(name: str) -> tuple[str, str | None]:
        chunks = clients[name].chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Describe the sea."}],
            max_tokens=32,
            temperature=0.8,
            seed=2,
            stream=True,
        )
        text, finish = "", None
        for chunk in chunks:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return text, finish

    assert stream("async") == stream("in_order")
