"""A CPU worker's opt-in speed options over real processes (issue 23): `gpu-worker
--cpu-precision fast --kv-cache-dtype bfloat16` behind render-serve, driven with the
`openai` client.

The served greedy completion must be the one an in-process Engine with the same two
options gives for the same prompt ids (the flags reach the engine, and nothing between the
HTTP request and the engine depends on them); the worker's start-up log names both. How far
fast and a bf16 cache move outputs from fp32 is tested at the engine level
(tests/unit/test_cpu_precision.py, test_kv_cache_dtype.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from gpu_worker import Engine
from gpu_worker.ops.cpu_precision import bf16_instructions
from shared.sampling import SamplingParams
from tests.helpers.processes import (
    ServerProcess,
    WorkerProcess,
    spawn_worker,
    start_render,
    stop_server,
    stop_worker,
    wait_worker_ready,
)

MODEL = "SmolLM2-135M-Instruct"
OPTIONS = {"cpu_precision": "fast", "kv_cache_dtype": "bfloat16"}
STARTUP_S = 180.0
MAX_TOKENS = 24

pytestmark = pytest.mark.skipif(
    not bf16_instructions(), reason="--cpu-precision fast runs exact without bf16 instructions"
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    """The render server in front of one worker with OPTIONS, and the worker's log."""
    base = tmp_path_factory.mktemp("cpu_options")
    log = base / "worker.log"
    args = [arg for key, value in OPTIONS.items() for arg in (f"--{key.replace('_', '-')}", value)]
    process = spawn_worker(log, [*args, "--log-level", "info"])  # the start-up lines
    worker = wait_worker_ready(process, log, time.monotonic() + STARTUP_S)
    try:
        render = start_render([worker.address], base / "render.log")
        try:
            yield render, log
        finally:
            stop_server(render)
    finally:
        stop_worker(WorkerProcess(process, ""))


@pytest.mark.slow
def test_served_greedy_chat_is_the_engines_with_the_same_options(
    served: tuple[ServerProcess, Path],
) -> None:
    render, log = served
    client = openai.OpenAI(base_url=f"{render.base_url}/v1", api_key="none", max_retries=0)
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name three rivers in Europe."}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    [choice] = completion.choices
    extra = choice.model_extra or {}
    prompt_ids = (completion.model_extra or {})["prompt_token_ids"]
    token_ids = extra["token_ids"]
    assert choice.finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == MAX_TOKENS
    assert choice.message.content

    with Engine(device="cpu", **OPTIONS) as engine:
        [expected] = engine.generate(
            [prompt_ids], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        )
    assert token_ids == expected.token_ids

    started = log.read_text()
    assert "multiply in bf16" in started
    assert "bfloat16" in started
