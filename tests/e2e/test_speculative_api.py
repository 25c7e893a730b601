"""Speculative decoding over real processes (issue 21): one gpu-worker per drafting method
(`--speculative-config`: ngram, suffix, draft_model) and one without, each behind its own
render-serve so that a request reaches the worker it names, driven with the `openai`
client.

Greedy requests through a speculative worker must give the plain worker's tokens, text and
counts exactly: the prompts ask the model to copy a given text, so drafts are accepted (a
run of accepted tokens is where `max_tokens` and stop strings can go wrong), and one is
free chat. A bad `--speculative-config` stops the worker at start, naming the field.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import httpx
import jsonschema
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
MAX_TOKENS = 40

# One worker per entry. The draft model is the built-in model drafting for itself. Every
# method drafts at a fixed length: on this CPU a draft model's draft costs what a target
# step does, so the adaptive length would switch it off and leave its drafts untested, and
# the model-free methods' adaptive length follows step times, which a loaded machine skews
# (make test once saw suffix draft nothing for a whole request, so its counts never grew).
# The adaptive controller is tested on its own (tests/unit/test_spec_draft_length.py).
SPECULATIVE_CONFIGS: dict[str, dict[str, object]] = {
    "draft_model": {
        "method": "draft_model",
        "model": MODEL,
        "num_speculative_tokens": 4,
        "draft_length": "fixed",
    },
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
        "draft_length": "fixed",
    },
    "suffix": {"method": "suffix", "num_speculative_tokens": 8, "draft_length": "fixed"},
}
METHODS = sorted(SPECULATIVE_CONFIGS)
PLAIN = "plain"

COPY_PROSE = (
    "Repeat the following text exactly:\n\nThe river runs past the old mill, under the "
    "stone bridge and through the meadow where the horses graze."
)
COPY_CODE = (
    "Copy this code out again, unchanged:\n\ndef area(width, height):\n    return width * height\n"
)
FREE_CHAT = "List the days of the week."
PROMPTS = [COPY_PROSE, COPY_CODE, FREE_CHAT]


@dataclass
class Served:
    """A worker and the render server in front of it alone."""

    worker: WorkerProcess
    render: ServerProcess

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.render.base_url}/v1", api_key="none", max_retries=0)


@dataclass(frozen=True)
class Reply:
    """What a greedy chat completion returned, in the terms the tests compare."""

    text: str
    token_ids: list[int]
    completion_tokens: int
    finish_reason: str
    stop_reason: int | str | None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Served]]:
    """PLAIN and each method's worker, each with its own render server, by name."""
    base = tmp_path_factory.mktemp("speculative")
    configs: dict[str, list[str]] = {PLAIN: []}
    for method, config in SPECULATIVE_CONFIGS.items():
        configs[method] = ["--speculative-config", json.dumps(config)]
    # Everything starts at once on ports chosen here; loading the model is most of the time.
    addresses = {name: f"tcp://127.0.0.1:{free_port()}" for name in configs}
    workers = {
        name: spawn_worker(base / f"{name}.log", [*args, "--bind", addresses[name]])
        for name, args in configs.items()
    }
    renders = {
        name: spawn_server(["--worker", address], base / f"render-{name}.log")
        for name, address in addresses.items()
    }
    try:
        deadline = time.monotonic() + STARTUP_S
        ready = {
            name: wait_worker_ready(process, base / f"{name}.log", deadline)
            for name, process in workers.items()
        }
        wait_until(
            lambda: all(_is_ready(render) for render in renders.values()),
            STARTUP_S,
            "every render-serve ready",
            interval_s=0.1,
            ignoring=(httpx.TransportError,),
        )
        yield {name: Served(ready[name], renders[name]) for name in configs}
    finally:
        # SIGTERM to all first: they shut down side by side, then each is reaped.
        processes = [*workers.values(), *(render.process for render in renders.values())]
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for render in renders.values():
            stop_server(render)
        for process in workers.values():
            stop_worker(WorkerProcess(process, ""))


def _is_ready(render: ServerProcess) -> bool:
    return httpx.get(f"{render.base_url}/ready").status_code == 200


def _reply(served: Served, prompt: str, **options: Any) -> Reply:
    """A greedy chat completion of `prompt` with its token ids."""
    completion = served.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=options.pop("max_tokens", MAX_TOKENS),
        extra_body={"return_token_ids": True},
        **options,
    )
    [choice] = completion.choices
    assert completion.usage is not None
    assert choice.finish_reason is not None
    extra = choice.model_extra or {}
    return Reply(
        choice.message.content or "",
        extra["token_ids"],
        completion.usage.completion_tokens,
        choice.finish_reason,
        extra["stop_reason"],
    )


@pytest.fixture(scope="module")
def greedy(cluster: dict[str, Served]) -> Callable[[str, str], Reply]:
    """The default greedy reply of a worker (by name) to a prompt, asked once per module."""

    @cache
    def reply(name: str, prompt: str) -> Reply:
        return _reply(cluster[name], prompt)

    return reply


@pytest.mark.parametrize("method", METHODS)
def test_greedy_chat_is_the_plain_workers_token_for_token(
    greedy: Callable[[str, str], Reply], method: str
) -> None:
    for prompt in PROMPTS:
        assert greedy(method, prompt) == greedy(PLAIN, prompt), prompt


@pytest.mark.parametrize("method", METHODS)
def test_streaming_gives_the_non_streamed_text(
    cluster: dict[str, Served], greedy: Callable[[str, str], Reply], method: str
) -> None:
    stream = cluster[method].client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": COPY_PROSE}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    usage = chunks[-1].usage
    assert usage is not None
    expected = greedy(method, COPY_PROSE)
    assert (text, finish[-1]) == (expected.text, expected.finish_reason)
    assert usage.completion_tokens == expected.completion_tokens


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("max_tokens", [1, 7, 13])
def test_max_tokens_is_exact_within_accepted_drafts(
    cluster: dict[str, Served], greedy: Callable[[str, str], Reply], method: str, max_tokens: int
) -> None:
    full = greedy(PLAIN, COPY_CODE)
    assert len(full.token_ids) > max_tokens, "the plain reply ends before max_tokens"
    cut = _reply(cluster[method], COPY_CODE, max_tokens=max_tokens)
    assert cut.finish_reason == "length"
    assert cut.completion_tokens == max_tokens
    assert cut.token_ids == full.token_ids[:max_tokens]


@pytest.fixture(scope="module")
def stopped(
    cluster: dict[str, Served], greedy: Callable[[str, str], Reply]
) -> Callable[[str], tuple[str, Reply]]:
    """A stop string two thirds into the plain reply to COPY_PROSE (where the copy has been
    drafting and accepting for a while), and a worker's reply with it, asked once."""

    @cache
    def reply(name: str) -> tuple[str, Reply]:
        words = greedy(PLAIN, COPY_PROSE).text.split()
        stop = words[len(words) * 2 // 3]
        return stop, _reply(cluster[name], COPY_PROSE, stop=[stop])

    return reply


@pytest.mark.parametrize("method", METHODS)
def test_a_stop_string_ends_the_text_where_the_plain_workers_does(
    greedy: Callable[[str, str], Reply], stopped: Callable[[str], tuple[str, Reply]], method: str
) -> None:
    full = greedy(PLAIN, COPY_PROSE).text
    stop, plain = stopped(PLAIN)
    _, speculative = stopped(method)
    assert (plain.text, plain.finish_reason, plain.stop_reason) == (
        full[: full.index(stop)],
        "stop",
        stop,
    )
    assert (speculative.text, speculative.finish_reason) == (plain.text, "stop")
    assert speculative.stop_reason == stop
    # Up to the token that completed the stop string, the same tokens.
    assert speculative.token_ids[: len(plain.token_ids)] == plain.token_ids


@pytest.mark.parametrize("method", METHODS)
def test_a_stop_string_counts_the_plain_workers_tokens(
    stopped: Callable[[str], tuple[str, Reply]], method: str
) -> None:
    _, plain = stopped(PLAIN)
    _, speculative = stopped(method)
    assert speculative.token_ids == plain.token_ids
    assert speculative.completion_tokens == plain.completion_tokens


NOTE = {
    "type": "object",
    "properties": {
        "colour": {"type": "string", "maxLength": 10},
        "bright": {"type": "boolean"},
    },
    "required": ["colour", "bright"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("method", METHODS)
def test_structured_output_follows_its_schema(cluster: dict[str, Served], method: str) -> None:
    answer = _reply(
        cluster[method],
        "Name a colour of the rainbow as JSON.",
        max_tokens=MAX_TOKENS,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "note", "schema": NOTE, "strict": True},
        },
    )
    assert answer.finish_reason == "stop"
    jsonschema.validate(json.loads(answer.text), NOTE)


def _spec_counts(served: Served) -> tuple[float, float]:
    """(drafted, accepted) on the served render server's /metrics for its worker; zeros
    when it has no such sample (a worker without speculation has none)."""
    counts = {"draft": 0.0, "accepted": 0.0}
    worker = f'worker="{served.worker.address}"'
    for line in httpx.get(f"{served.render.base_url}/metrics").text.splitlines():
        for kind in counts:
            if line.startswith(f"vllm:spec_decode_num_{kind}_tokens_total{{") and worker in line:
                counts[kind] = float(line.rsplit(" ", 1)[1])
    return counts["draft"], counts["accepted"]


def test_metrics_count_drafted_and_accepted_tokens(cluster: dict[str, Served]) -> None:
    before = {method: _spec_counts(cluster[method]) for method in METHODS}
    for name in [PLAIN, *METHODS]:
        _reply(cluster[name], COPY_CODE, max_tokens=16)

    def grown(method: str) -> bool:
        (drafted, accepted), now = before[method], _spec_counts(cluster[method])
        return now[0] > drafted and now[1] > accepted

    for method in METHODS:
        wait_until(partial(grown, method), 10, f"{method}'s counts to grow in a heartbeat")
    # By now the plain worker has sent a heartbeat since its request too.
    assert _spec_counts(cluster[PLAIN]) == (0.0, 0.0)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
        (
            {"method": "ngram", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 8},
            "suffix_decoding_max_tree_depth belongs to method 'suffix'",
        ),
        ({"method": "suffix", "lookahead": 3}, "lookahead"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
    ],
)
def test_a_bad_config_stops_the_worker_at_start(config: dict[str, object], named: str) -> None:
    command = [sys.executable, "-m", "gpu_worker.cli", "--device", "cpu", "--bind"]
    command += [f"tcp://127.0.0.1:{free_port()}", "--speculative-config", json.dumps(config)]
    exited = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert exited.returncode != 0
    assert named in exited.stderr
    assert "--speculative-config" in exited.stderr
