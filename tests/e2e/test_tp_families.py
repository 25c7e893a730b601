"""`gpu-worker --tensor-parallel-size 2` serving tiny family models behind render-serve
(CPU, gloo): greedy completions over HTTP, asked for with the `openai` client as a user
would, carry the token ids a TP=1 engine gives for the same prompts. The models are every
family of test_tp_model (Llama, Qwen3, Phi-3, Gemma 2, the SmolLM2-shaped Llama whose 9
heads over 3 KV heads split unevenly, Mixtral, Qwen3-MoE), each with a byte-level
tokenizer so that render-serve encodes and decodes their text. The workers start at once;
the references run in this process meanwhile.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
from openai import OpenAI

from gpu_worker.engine.engine import Engine
from shared.sampling import SamplingParams
from tests.helpers.processes import (
    WORKER_STARTUP_S,
    WorkerProcess,
    kill_worker,
    spawn_worker,
    start_render,
    stop_server,
    stop_worker,
    wait_worker_ready,
)
from tests.helpers.tiny_models import save_tiny_model
from tests.integration.test_tp_model import MODELS as FAMILIES

SERVED = list(FAMILIES)
PROMPTS = ["Once upon a time", '{"name": "Ada", "langs": [']
MAX_TOKENS = 12
TP2 = ["--tensor-parallel-size", "2", "--dist-timeout", "20"]


def _tp1_reference(model_dir: Path) -> list[list[int]]:
    """TP=1's greedy tokens for PROMPTS, whose byte-level token ids are their bytes."""
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [list(prompt.encode()) for prompt in PROMPTS]
    with Engine(model=str(model_dir), device="cpu") as engine:
        return [completion.token_ids for completion in engine.generate(prompts, greedy)]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tp2_workers_serve_tp1_greedy_completions_over_http(tmp_path: Path) -> None:
    model_dirs = {
        name: save_tiny_model(tmp_path / name, tokenizer="bytes", **FAMILIES[name]).path
        for name in SERVED
    }
    with contextlib.ExitStack() as cleanup:
        logs = {name: tmp_path / f"{name}-worker.log" for name in SERVED}
        processes = {}
        for name in SERVED:
            args = ["--model", str(model_dirs[name]), *TP2]
            processes[name] = spawn_worker(logs[name], args, kv_cache_gb=0.01)
            cleanup.callback(kill_worker, WorkerProcess(processes[name], address=""))
        # The reference runs while the workers start: its engine is TP=1, in this process.
        references = {name: _tp1_reference(model_dirs[name]) for name in SERVED}
        deadline = time.monotonic() + WORKER_STARTUP_S
        workers = {
            name: wait_worker_ready(processes[name], logs[name], deadline) for name in SERVED
        }
        for name in SERVED:
            args = ["--model", str(model_dirs[name])]
            render = start_render([workers[name].address], tmp_path / f"{name}-render.log", args)
            cleanup.callback(stop_server, render)
            client = OpenAI(base_url=f"{render.base_url}/v1", api_key="unused", max_retries=0)
            [model] = client.models.list().data
            completion = client.completions.create(
                model=model.id,
                prompt=PROMPTS,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            choices = sorted(completion.choices, key=lambda choice: choice.index)
            served = [(choice.model_extra or {})["token_ids"] for choice in choices]
            assert served == references[name], name
            prompt_ids = [(choice.model_extra or {})["prompt_token_ids"] for choice in choices]
            assert prompt_ids == [list(prompt.encode()) for prompt in PROMPTS]
        # A TP=2 worker told to stop ends its follower rank and exits cleanly.
        for name in SERVED:
            assert stop_worker(workers[name], timeout_s=30) == 0, logs[name].read_text()
