"""Multi-LoRA over real processes (issue 20): two gpu-workers with --enable-lora and a
--lora-root, and a render server over both with --allow-runtime-lora-updating.

Worker A alone registers `alpha` and `delta` from its own --lora-modules; the render server
declares `gamma`, which both workers load when it connects; `beta` loads at runtime. Each
adapter is random and strong (every q/v projection of the built-in model, scale 8), so its
greedy tokens differ from the base model's. Worker A holds one adapter in its slot at a
time, so asking for alpha and delta in turn evicts.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from safetensors.numpy import save_file

from render_server.http.app import build_state, create_app
from render_server.settings import RenderSettings
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
# The built-in model's shapes (hidden 576, 9 query and 3 KV heads of 64, 30 layers).
HIDDEN, Q_OUT, KV_OUT, LAYERS = 576, 576, 192, 30
STARTUP_S = 180.0
PROMPT = "Name three colours of the rainbow:"


def save_adapter(directory: Path, seed: int, rank: int = 8) -> Path:
    """A random PEFT adapter on every q_proj and v_proj, with alpha = 8 * rank."""
    directory.mkdir(parents=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 8 * rank,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "base_model_name_or_path": MODEL,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(LAYERS):
        for target, out in (("q_proj", Q_OUT), ("v_proj", KV_OUT)):
            stem = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{stem}.lora_A.weight"] = rng.normal(0, 0.05, (rank, HIDDEN)).astype(
                np.float32
            )
            tensors[f"{stem}.lora_B.weight"] = rng.normal(0, 0.05, (out, rank)).astype(np.float32)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


@dataclass
class LoRACluster:
    root: Path
    outside: Path
    worker_a: WorkerProcess
    worker_b: WorkerProcess
    render: ServerProcess
    """Over both workers, with --allow-runtime-lora-updating and --lora-modules gamma."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoRACluster]:
    base = tmp_path_factory.mktemp("lora")
    root = base / "adapters"
    for name, seed in (("alpha", 1), ("beta", 2), ("gamma", 3), ("delta", 5)):
        save_adapter(root / name, seed)
    outside = save_adapter(base / "outside", 4)  # a valid adapter out of the root
    (root / "escape").symlink_to(outside, target_is_directory=True)
    lora = ["--enable-lora", "--max-loras", "1", "--max-lora-rank", "16", "--lora-root", str(root)]
    # Everything starts at once (the workers on ports chosen here, so the render server
    # knows them): the workers' model loading is most of this module's time.
    address_a, address_b = (f"tcp://127.0.0.1:{free_port()}" for _ in "ab")
    own_adapters = [f"--lora-modules={name}={root / name}" for name in ("alpha", "delta")]
    worker_args = [[*lora, "--bind", address_a, *own_adapters], [*lora, "--bind", address_b]]
    processes = [
        spawn_worker(base / f"{name}.log", args)
        for name, args in zip("ab", worker_args, strict=True)
    ]
    runtime = ["--allow-runtime-lora-updating", "--lora-modules", "gamma=gamma"]
    render = spawn_server(
        ["--worker", address_a, "--worker", address_b, *runtime], base / "render.log"
    )
    try:
        deadline = time.monotonic() + STARTUP_S
        worker_a, worker_b = (
            wait_worker_ready(process, base / f"{name}.log", deadline)
            for process, name in zip(processes, "ab", strict=True)
        )
        wait_until(
            lambda: httpx.get(f"{render.base_url}/ready").status_code == 200,
            STARTUP_S,
            "render-serve ready",
            interval_s=0.1,
            ignoring=(httpx.TransportError,),
        )
        # Heartbeats tell the render server which worker registers what.
        wait_until(
            lambda: {"alpha", "delta", "gamma"} <= set(_model_ids(render)),
            10,
            "the adapters in /v1/models",
        )
        yield LoRACluster(root, outside, worker_a, worker_b, render)
    finally:
        # SIGTERM to all first: they shut down side by side, then each is reaped.
        for process in [*processes, render.process]:
            if process.poll() is None:
                process.terminate()
        stop_server(render)
        for process in processes:
            stop_worker(WorkerProcess(process, ""))


def _model_ids(server: ServerProcess) -> list[str]:
    return [model["id"] for model in httpx.get(f"{server.base_url}/v1/models").json()["data"]]


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def _greedy_ids(server: ServerProcess, model: str, prompt: str = PROMPT) -> list[int]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "return_token_ids": True,
    }
    answer = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == model
    ids: list[int] = answer.json()["choices"][0]["token_ids"]
    return ids


def _routed(server: ServerProcess) -> dict[str, float]:
    """duet_render_requests_routed_total by worker address."""
    counts: dict[str, float] = {}
    for line in httpx.get(f"{server.base_url}/metrics").text.splitlines():
        if line.startswith("duet_render_requests_routed_total{"):
            worker = line.split('worker="', 1)[1].split('"', 1)[0]
            counts[worker] = float(line.rsplit(" ", 1)[1])
    return counts


def _load(server: ServerProcess, name: str, path: str) -> httpx.Response:
    body = {"lora_name": name, "lora_path": path}
    return httpx.post(f"{server.base_url}/v1/load_lora_adapter", json=body, timeout=30)


def _unload(server: ServerProcess, name: str) -> httpx.Response:
    body = {"lora_name": name}
    return httpx.post(f"{server.base_url}/v1/unload_lora_adapter", json=body, timeout=30)


def test_models_lists_every_adapter_under_the_base(cluster: LoRACluster) -> None:
    models = httpx.get(f"{cluster.render.base_url}/v1/models").json()["data"]
    listed = {card["id"]: card for card in models}
    assert listed[MODEL]["parent"] is None
    assert listed["alpha"]["parent"] == listed["gamma"]["parent"] == MODEL
    assert listed["gamma"]["root"] == "gamma"  # the render server's own --lora-modules path
    assert _client(cluster.render).models.retrieve("alpha").id == "alpha"


def test_an_adapter_changes_the_output_and_names_itself(cluster: LoRACluster) -> None:
    base = _greedy_ids(cluster.render, MODEL)
    alpha = _greedy_ids(cluster.render, "alpha")
    gamma = _greedy_ids(cluster.render, "gamma")
    assert len({tuple(base), tuple(alpha), tuple(gamma)}) == 3
    assert _greedy_ids(cluster.render, "alpha") == alpha  # greedy: the same again
    chat = _client(cluster.render).chat.completions.create(
        model="gamma",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=4,
        temperature=0,
    )
    assert chat.model == "gamma"


def test_an_adapters_structured_output_follows_its_schema(cluster: LoRACluster) -> None:
    """The grammar mask applies to an adapter's rows as to the base model's: a strong random
    adapter, left to itself, would not write this object."""
    schema = {
        "type": "object",
        "properties": {
            "colour": {"type": "string", "maxLength": 12},
            "bright": {"type": "boolean"},
        },
        "required": ["colour", "bright"],
        "additionalProperties": False,
    }
    chat = _client(cluster.render).chat.completions.create(
        model="alpha",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=60,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True},
        },
    )
    assert chat.model == "alpha"
    assert chat.choices[0].finish_reason == "stop"
    answer = json.loads(chat.choices[0].message.content or "")
    assert set(answer) == {"colour", "bright"}
    assert isinstance(answer["colour"], str)
    assert isinstance(answer["bright"], bool)


def test_a_request_for_an_adapter_goes_to_the_worker_holding_it(cluster: LoRACluster) -> None:
    before = _routed(cluster.render)
    for number in range(4):
        _greedy_ids(cluster.render, "alpha", f"{PROMPT} {number}")
    after = _routed(cluster.render)
    a, b = cluster.worker_a.address, cluster.worker_b.address
    assert after.get(a, 0) - before.get(a, 0) == 4
    assert after.get(b, 0) == before.get(b, 0)


def test_unknown_models_are_404_in_each_apis_shape(cluster: LoRACluster) -> None:
    client = _client(cluster.render)
    completion = httpx.post(
        f"{cluster.render.base_url}/v1/completions",
        json={"model": "omega", "prompt": PROMPT, "max_tokens": 2},
    )
    assert completion.status_code == 404
    assert completion.json()["error"]["message"] == "The model `omega` does not exist."
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="omega", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="omega", input="hi", max_output_tokens=2)
    messages = httpx.post(
        f"{cluster.render.base_url}/v1/messages",
        json={"model": "omega", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert messages.status_code == 404
    assert messages.json()["type"] == "error"
    assert messages.json()["error"]["type"] == "not_found_error"
    generate = httpx.post(
        f"{cluster.render.base_url}/inference/v1/generate",
        json={"model": "omega", "token_ids": [1, 2, 3]},
    )
    assert generate.status_code == 404


def test_render_and_generate_carry_the_adapter(cluster: LoRACluster) -> None:
    url = cluster.render.base_url
    body = {"model": "alpha", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    (rendered,) = httpx.post(f"{url}/v1/completions/render", json=body).json()
    assert rendered["model"] == "alpha"
    generated = httpx.post(f"{url}/inference/v1/generate", json=rendered, timeout=30).json()
    assert generated["model"] == "alpha"
    assert generated["choices"][0]["token_ids"] == _greedy_ids(cluster.render, "alpha")


def test_runtime_load_and_unload(cluster: LoRACluster) -> None:
    render = cluster.render
    loaded = _load(render, "beta", "beta")
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'beta' added successfully."
    assert "beta" in _model_ids(render)
    beta = _greedy_ids(render, "beta")
    assert beta != _greedy_ids(render, MODEL)
    again = _load(render, "beta", "beta")
    assert again.status_code == 400
    assert again.json()["error"]["message"] == "The lora adapter 'beta' has already been loaded."
    unloaded = _unload(render, "beta")
    assert unloaded.status_code == 200, unloaded.text
    assert unloaded.text == "Success: LoRA adapter 'beta' removed successfully."
    assert "beta" not in _model_ids(render)
    with pytest.raises(openai.NotFoundError):
        _client(render).completions.create(model="beta", prompt=PROMPT, max_tokens=2)
    missing = _unload(render, "beta")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "lora_not_found"


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("../outside", 400),  # traversal out of the root
        ("escape", 400),  # a symlink out of the root
        ("{outside}", 400),  # an absolute path out of the root
        ("http://example.com/adapter", 400),
        ("file:///etc", 400),
        ("nowhere", 404),
    ],
)
def test_a_load_from_outside_the_root_is_refused(
    cluster: LoRACluster, path: str, status: int
) -> None:
    answer = _load(cluster.render, "intruder", path.format(outside=cluster.outside))
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] == "lora_path", error
    assert error["code"] == ("lora_not_found" if status == 404 else "invalid_lora_adapter")
    assert "intruder" not in _model_ids(cluster.render)


def test_without_the_flag_the_runtime_routes_do_not_exist() -> None:
    settings = RenderSettings(render_only=True)
    state = build_state(settings)

    async def post(path: str, body: dict[str, str]) -> int:
        transport = httpx.ASGITransport(app=create_app(settings, state))
        async with httpx.AsyncClient(transport=transport, base_url="http://duet") as client:
            return (await client.post(path, json=body)).status_code

    try:
        body = {"lora_name": "beta", "lora_path": "beta"}
        assert asyncio.run(post("/v1/load_lora_adapter", body)) == 404
        assert asyncio.run(post("/v1/unload_lora_adapter", {"lora_name": "alpha"})) == 404
    finally:
        state.renderer.close()


def test_each_adapter_has_its_own_prefix_cache(cluster: LoRACluster) -> None:
    # Only worker A holds alpha and delta: every request meets the same cache.
    client = _client(cluster.render)
    prompt = "Once upon a time, in a kingdom by the sea, there lived " * 6

    def cached(model: str) -> int:
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=1)
        assert answer.usage is not None
        assert answer.usage.prompt_tokens_details is not None
        return answer.usage.prompt_tokens_details.cached_tokens or 0

    assert cached("alpha") == 0
    assert cached("alpha") > 0  # the same adapter shares its blocks
    assert cached("delta") == 0  # another adapter's blocks are not its own
    assert cached("delta") > 0


def test_evictions_show_in_metrics(cluster: LoRACluster) -> None:
    # Worker A has one slot: alpha and delta in turn evict each other.
    for model in ("alpha", "delta", "alpha", "delta"):
        _greedy_ids(cluster.render, model)
    address = cluster.worker_a.address

    def evictions() -> float:
        for line in httpx.get(f"{cluster.render.base_url}/metrics").text.splitlines():
            if line.startswith(f'duet_worker_lora_evictions_total{{worker="{address}"}}'):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    wait_until(lambda: evictions() >= 3, 5, "the evictions in a heartbeat")
    metrics = httpx.get(f"{cluster.render.base_url}/metrics").text
    assert 'vllm:lora_requests_info{max_lora="1"' in metrics
