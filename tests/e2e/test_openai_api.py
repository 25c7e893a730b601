"""The OpenAI API across the split, driven by the official `openai` SDK."""

from __future__ import annotations

import re
import threading
import time
import uuid

import httpx
import openai
import pytest
import zmq
from openai import OpenAI

from shared.protocol import Encoder, Heartbeat, Hello, WorkerMessageDecoder, WorkerStats
from shared.transport import make_dealer
from tests.helpers.processes import ServerProcess, WorkerProcess
from tests.helpers.waiting import wait_until

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
HAIKU = [{"role": "user", "content": "Write a short poem about the sea."}]
BLOCK_SIZE = 16  # the session's workers run the default --block-size


def _tokenize_chat(server: ServerProcess, messages: list[dict]) -> list[int]:
    response = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages})
    response.raise_for_status()
    return response.json()["tokens"]


def test_chat_non_streaming(client: OpenAI, render: ServerProcess) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=24, temperature=0
    )
    choice = reply.choices[0]
    assert reply.object == "chat.completion"
    assert reply.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage.prompt_tokens == len(_tokenize_chat(render, QUESTION))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # The same chat again: the same reply, its prompt's full blocks before the last token
    # (recomputed for its logits) served from the prefix cache.
    again = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=24, temperature=0
    )
    assert again.choices[0].message.content == choice.message.content
    full_blocks = (usage.prompt_tokens - 1) // BLOCK_SIZE
    assert full_blocks >= 1
    assert again.usage.prompt_tokens_details.cached_tokens == full_blocks * BLOCK_SIZE


def test_chat_streaming_matches_non_streaming(client: OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=HAIKU, max_tokens=40, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=HAIKU, max_tokens=40, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked


def test_usage_chunk_only_when_asked(client: OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    streamed_tokens = chunks[-1].usage.completion_tokens
    assert 1 <= streamed_tokens <= 8
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_with_echo_and_token_ids(client: OpenAI, render: ServerProcess) -> None:
    prompt = "The capital of France is"
    ids = httpx.post(f"{render.base_url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    by_text = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, echo=True
    )
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_text.object == "text_completion"
    assert by_text.choices[0].text.startswith(prompt)
    assert by_text.choices[0].text == prompt + by_ids.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    several = client.completions.create(
        model=MODEL, prompt=[ids, ids[:3]], max_tokens=4, temperature=0
    )
    assert [c.index for c in several.choices] == [0, 1]


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(client: OpenAI) -> None:
    reference = client.chat.completions.create(
        model=MODEL, messages=HAIKU, max_tokens=40, temperature=0
    )
    text = reference.choices[0].message.content
    words = re.findall(r"\w{5,}", text)
    assert words, text
    # from the middle of one word into the next: starts inside a token, ends inside one
    start = text.index(words[0]) + 2
    stop = text[start : start + 8]
    expected = text[:start]
    stream = client.chat.completions.create(
        model=MODEL, messages=HAIKU, max_tokens=40, temperature=0, stream=True, stop=[stop]
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == expected
    reply = client.chat.completions.create(
        model=MODEL, messages=HAIKU, max_tokens=40, temperature=0, stop=stop
    )
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == "stop"
    assert reply.model_extra.get("stop_reason") or reply.choices[0].model_extra["stop_reason"]
    included = client.chat.completions.create(
        model=MODEL,
        messages=HAIKU,
        max_tokens=40,
        temperature=0,
        stop=stop,
        extra_body={"include_stop_str_in_output": True},
    )
    assert included.choices[0].message.content == expected + stop


def test_n_with_seed_is_reproducible(client: OpenAI) -> None:
    def run() -> list[str]:
        reply = client.chat.completions.create(
            model=MODEL, messages=HAIKU, max_tokens=16, temperature=1.0, seed=7, n=3
        )
        assert [c.index for c in reply.choices] == [0, 1, 2]
        return [c.message.content for c in reply.choices]

    first = run()
    assert run() == first
    assert len(set(first)) > 1  # each choice has its own seed


def test_logprobs_are_sorted_and_bytes_decode(client: OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0
        alternatives = [alt.logprob for alt in entry.top_logprobs]
        assert len(alternatives) == 3
        assert alternatives == sorted(alternatives, reverse=True)
        assert all(lp <= 0 for lp in alternatives)
        if "\ufffd" not in entry.token:
            assert bytes(entry.bytes).decode("utf-8") == entry.token
        # greedy: the sampled token is the most likely one
        assert entry.logprob == pytest.approx(alternatives[0], abs=1e-5)


def test_greedy_http_equals_engine_offline(client: OpenAI, render: ServerProcess) -> None:
    from gpu_worker import Engine
    from shared.sampling import SamplingParams

    ids = _tokenize_chat(render, HAIKU)
    reply = client.chat.completions.create(
        model=MODEL, messages=HAIKU, max_tokens=24, temperature=0, logprobs=True
    )
    engine = Engine(device="cpu", kv_cache_memory_gb=0.05)
    [offline] = engine.generate([ids], SamplingParams(temperature=0, max_tokens=24))
    detok = httpx.post(f"{render.base_url}/detokenize", json={"tokens": offline.token_ids}).json()[
        "prompt"
    ]
    assert reply.usage.completion_tokens == len(offline.token_ids)
    assert reply.choices[0].message.content == detok.removesuffix("<|im_end|>")


class _Heartbeats:
    """A bare wire client of a worker that keeps its latest heartbeat."""

    def __init__(self, address: str) -> None:
        self.context = zmq.Context()
        self.socket = make_dealer(self.context, address, identity=uuid.uuid4().bytes)
        self.socket.send(Encoder().encode(Hello(client_id="e2e-probe")))
        self.decoder = WorkerMessageDecoder()

    def latest(self, timeout_s: float = 5.0) -> Heartbeat:
        deadline = time.monotonic() + timeout_s
        beat = None
        while time.monotonic() < deadline:
            if not self.socket.poll(100):
                if beat is not None:
                    return beat
                continue
            message = self.decoder.decode(self.socket.recv())
            if isinstance(message, Heartbeat):
                beat = message
        if beat is None:
            raise AssertionError("no heartbeat")
        return beat

    def close(self) -> None:
        self.socket.close()
        self.context.term()


def test_disconnect_mid_stream_frees_the_worker(
    render: ServerProcess, worker_a: WorkerProcess
) -> None:
    probe = _Heartbeats(worker_a.address)
    try:
        body = {
            "model": MODEL,
            "messages": HAIKU,
            "max_tokens": 2000,
            "ignore_eos": True,
            "stream": True,
        }
        with (
            httpx.Client(base_url=render.base_url, timeout=30) as http,
            http.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data:") and '"content"' in line and '""' not in line:
                    break
            wait_until(
                lambda: probe.latest(1.0).stats.num_running >= 1,
                10,
                "the worker to show the request",
                interval_s=0,
            )
        closed_at = time.monotonic()

        def idle() -> WorkerStats | None:
            stats = probe.latest(1.0).stats
            if stats.num_running == 0 and stats.kv_blocks_free == stats.kv_blocks_total:
                return stats
            return None

        stats = wait_until(idle, 5, "the worker to free the request", interval_s=0)
        idle_after = time.monotonic() - closed_at
        assert stats.kv_blocks_free == stats.kv_blocks_total
        assert idle_after < 1.0, f"KV idle only after {idle_after:.2f}s"
    finally:
        probe.close()


def test_two_render_servers_share_one_worker(
    render: ServerProcess, render_b: ServerProcess
) -> None:
    results: dict[str, str] = {}

    def ask(name: str, server: ServerProcess) -> None:
        c = OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
        reply = c.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=12, temperature=0
        )
        results[name] = reply.choices[0].message.content

    threads = [
        threading.Thread(target=ask, args=(name, server))
        for name, server in (("a", render), ("b", render_b))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results["a"] == results["b"]
    assert "Paris" in results["a"]


def test_one_render_server_uses_two_workers(
    render_pair: ServerProcess, worker_a: WorkerProcess, worker_b: WorkerProcess
) -> None:
    c = OpenAI(base_url=f"{render_pair.base_url}/v1", api_key="x", max_retries=0)
    threads = [
        threading.Thread(
            target=lambda i=i: c.completions.create(
                model=MODEL, prompt=f"Story number {i}: once upon a time", max_tokens=8
            )
        )
        for i in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    metrics = httpx.get(f"{render_pair.base_url}/metrics").text
    for worker in (worker_a, worker_b):
        pattern = (
            rf'duet_render_requests_routed_total{{worker="{re.escape(worker.address)}"}} (\S+)'
        )
        match = re.search(pattern, metrics)
        assert match, f"{worker.address} got nothing"
        assert float(match.group(1)) >= 1, f"{worker.address} got nothing"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": [{"role": "user", "content": "hi " * 9000}]}, "messages"),
        ({"n": 10**9}, "n"),
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"top_p": 2}, "top_p"),
        ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
        ({"stop": ["x"] * 100}, "stop"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
    ],
)
def test_bad_requests_are_400_naming_the_field(client: OpenAI, fields: dict, param: str) -> None:
    body = {"model": MODEL, "messages": QUESTION, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**body)
    error = info.value.body
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    assert param in error["message"], error


def test_unknown_extra_fields_are_ignored(client: OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=4,
        extra_body={"some_future_field": 1},
        user="someone",
        metadata={"a": "b"},
    )
    assert reply.choices[0].message.content
