"""vLLM's token-in/token-out API (/inference/v1/generate, abort_requests) over real
processes: it generates what /v1/completions generates for the same token ids, streams the
same ids it answers whole, frees the worker's KV on an abort, and refuses bad input with a
400 naming the field."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, cast

import httpx
import pytest

from render_server.generation.lifecycle import ChoiceSpec, Generation, PromptSpec
from render_server.templating.tokenizer import Tokenizer
from render_server.worker_client.pool import WorkerPool
from render_server.worker_client.request_stream import RequestStream
from shared.model_source import resolve_model
from shared.protocol import Generate, WorkerStats
from shared.sampling import SamplingParams
from tests.e2e.test_openai_api import _Heartbeats
from tests.helpers.processes import SECURE_KEYS, ServerProcess, WorkerProcess
from tests.helpers.waiting import wait_until

MODEL = "SmolLM2-135M-Instruct"
VOCAB_SIZE = 49152
PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is"


def _generate(server: ServerProcess, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/inference/v1/generate", json=body, timeout=30)


def _events(response: httpx.Response) -> list[Any]:
    """The SSE body's data lines, decoded; `[DONE]` stays a string."""
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines]


def test_greedy_generate_equals_completions(render: ServerProcess) -> None:
    sampling = {"temperature": 0, "max_tokens": 12, "logprobs": 2}
    body = {"request_id": "greedy-1", "token_ids": PROMPT, "sampling_params": sampling}
    response = _generate(render, body)
    assert response.status_code == 200, response.text
    answer = response.json()
    completion = httpx.post(
        f"{render.base_url}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "return_token_ids": True},
        timeout=30,
    ).json()
    (choice,) = answer["choices"]
    expected = completion["choices"][0]
    assert answer["request_id"] == "greedy-1"
    assert answer["model"] == MODEL
    assert choice["token_ids"] == expected["token_ids"]
    assert choice["finish_reason"] == expected["finish_reason"]
    content = choice["logprobs"]["content"]
    assert [entry["token_id"] for entry in content] == choice["token_ids"]
    for entry in content:  # greedy: the sampled token is the top one
        assert entry["rank"] == 1
        assert [top["rank"] for top in entry["top_logprobs"]] == [1, 2]
        assert entry["top_logprobs"][0]["token_id"] == entry["token_id"]
    usage = answer["usage"]
    assert usage["prompt_tokens"] == len(PROMPT)
    assert usage["completion_tokens"] == len(choice["token_ids"])


def test_stop_strings_apply_as_on_completions(render: ServerProcess) -> None:
    sampling = {"temperature": 0, "max_tokens": 24, "stop": ["."]}
    answer = _generate(render, {"token_ids": PROMPT, "sampling_params": sampling}).json()
    completion = httpx.post(
        f"{render.base_url}/v1/completions",
        json={"prompt": PROMPT, **sampling, "return_token_ids": True},
        timeout=30,
    ).json()
    (choice,), expected = answer["choices"], completion["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", ".")
    assert choice["stop_reason"] == expected["stop_reason"]
    assert choice["token_ids"] == expected["token_ids"]


def test_streamed_token_ids_equal_the_whole_answer(render: ServerProcess) -> None:
    sampling = {"temperature": 0, "max_tokens": 16, "n": 2}
    whole = _generate(render, {"token_ids": PROMPT, "sampling_params": sampling}).json()
    streamed = _generate(
        render,
        {
            "request_id": "stream-1",
            "token_ids": PROMPT,
            "sampling_params": sampling,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert streamed.status_code == 200, streamed.text
    events = _events(streamed)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    assert usage_chunk["choices"] == []
    ids: dict[int, list[int]] = {0: [], 1: []}
    finishes: dict[int, str] = {}
    for chunk in chunks:
        assert chunk["request_id"] == "stream-1"
        (choice,) = chunk["choices"]
        ids[choice["index"]] += choice["token_ids"]
        if choice["finish_reason"] is not None:
            finishes[choice["index"]] = choice["finish_reason"]
    for choice in whole["choices"]:
        assert ids[choice["index"]] == choice["token_ids"]
        assert finishes[choice["index"]] == choice["finish_reason"]
    assert usage_chunk["usage"]["completion_tokens"] == sum(map(len, ids.values()))


def test_abort_mid_stream_frees_the_worker(render: ServerProcess, worker_a: WorkerProcess) -> None:
    probe = _Heartbeats(worker_a.address)
    body = {
        "request_id": "abort-me",
        "token_ids": PROMPT,
        "sampling_params": {"max_tokens": 2000, "ignore_eos": True},
        "stream": True,
    }
    try:
        with (
            httpx.Client(base_url=render.base_url, timeout=30) as http,
            http.stream("POST", "/inference/v1/generate", json=body) as response,
        ):
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            aborted = http.post(
                "/inference/v1/abort_requests", json={"request_ids": ["abort-me", "no-such"]}
            )
            assert aborted.status_code == 200, aborted.text
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "abort"
        aborted_at = time.monotonic()

        def idle() -> WorkerStats | None:
            stats = probe.latest(1.0).stats
            if stats.num_running == 0 and stats.kv_blocks_free == stats.kv_blocks_total:
                return stats
            return None

        wait_until(idle, 5, "the worker to free the aborted request", interval_s=0)
        assert time.monotonic() - aborted_at < 2.0
    finally:
        probe.close()
    # vLLM's --tokens-only path; ids of no live request are no error.
    assert httpx.post(f"{render.base_url}/abort_requests", json={"request_ids": ["x"]}).is_success


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"token_ids": [1, -5]}, "token_ids.1"),
        ({"token_ids": [1, VOCAB_SIZE]}, "token_ids.1"),
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [1] * 100_000}, "token_ids"),
        ({"token_ids": [1], "sampling_params": {"stop_token_ids": list(range(65))}}, None),
        (
            {"token_ids": [1], "sampling_params": {"max_tokens": 10**9}},
            "sampling_params.max_tokens",
        ),
        ({"token_ids": [1], "sampling_params": {"min_tokens": -1}}, "sampling_params.min_tokens"),
        ({"token_ids": [1], "sampling_params": {"best_of": 2}}, "sampling_params"),
        ({"token_ids": [1], "sampling_params": {"temprature": 0}}, "sampling_params.temprature"),
        ({"token_ids": [1], "sampling_params": {"model": MODEL}}, "sampling_params"),
        ({"token_ids": [1], "sampling_params": {"logprobs": 21}}, "sampling_params.logprobs"),
        ({"token_ids": [1], "sampling_params": {"n": 0}}, "sampling_params.n"),
        ({"token_ids": [1], "features": {"x": 1}}, "features"),
        ({"token_ids": [1], "model": "other"}, "model"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    render: ServerProcess, body: dict[str, Any], param: str | None
) -> None:
    response = _generate(render, body)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    else:
        assert error["param"].startswith("sampling_params."), error


def test_the_api_key_guards_the_inference_routes(secure_server: ServerProcess) -> None:
    for path in ("/inference/v1/generate", "/inference/v1/abort_requests", "/abort_requests"):
        refused = httpx.post(f"{secure_server.base_url}{path}", json={"token_ids": [1]})
        assert refused.status_code == 401, refused.text
    keyed = httpx.post(
        f"{secure_server.base_url}/inference/v1/generate",
        json={"token_ids": [1]},
        headers={"Authorization": f"Bearer {SECURE_KEYS[0]}"},
    )
    assert keyed.status_code == 503  # a --render-only server: past the key, no worker
    assert keyed.json()["error"]["code"] == "render_only"


def test_an_abort_while_start_runs_aborts_the_choices_sent_after_it() -> None:
    """abort_requests may come while `start` is still sending a request's n choices: the
    ones sent after it must not run on."""
    aborted: list[str] = []

    class Link:
        address = "fake"

        def abort(self, request_id: str) -> None:
            aborted.append(request_id)

    class Pool:
        async def submit(self, request: Generate) -> RequestStream:
            await asyncio.sleep(0)  # the abort gets in here
            return RequestStream(request, Link())

    spec = ChoiceSpec(SamplingParams(max_tokens=4), [], False, True)
    tokenizer = Tokenizer.from_source(resolve_model(MODEL))
    generation = Generation(cast(WorkerPool, Pool()), tokenizer, "r", [PromptSpec([1], [spec] * 3)])

    async def scenario() -> None:
        starting = asyncio.create_task(generation.start())
        await asyncio.sleep(0)
        await generation.abort()
        await starting

    asyncio.run(scenario())
    assert sorted(aborted) == ["r-0", "r-1", "r-2"]
