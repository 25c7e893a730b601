"""/tokenize, /detokenize, /v1/models, /health, /version and /metrics on a real server."""

from __future__ import annotations

import re
import threading
import time

import httpx
import openai
import pytest

from tests.helpers.processes import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello there"},
]


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text format (0 if absent). Labels must be
    given in their declaration order, as the exposition writes them."""
    labelset = ",".join(f'{key}="{value}"' for key, value in labels.items())
    prefix = f"{name}{{{labelset}}} " if labels else f"{name} "
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    return 0.0


def test_tokenize_prompt(client: httpx.Client) -> None:
    response = client.post("/tokenize", json={"prompt": "Hello world"})
    assert response.status_code == 200
    body = response.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["count"] == len(body["tokens"]) > 0
    assert all(isinstance(token, int) for token in body["tokens"])
    assert body["max_model_len"] > 0
    assert body["token_strs"] is None


def test_tokenize_prompt_token_strs_and_model(client: httpx.Client) -> None:
    response = client.post(
        "/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True}
    )
    assert response.status_code == 200
    body = response.json()
    assert len(body["token_strs"]) == body["count"]
    assert "".join(body["token_strs"]).replace("Ġ", " ") == "Hello world"


def test_tokenize_chat_renders_template(client: httpx.Client) -> None:
    response = client.post("/tokenize", json={"messages": CHAT, "return_token_strs": True})
    assert response.status_code == 200
    body = response.json()
    assert "<|im_start|>" in body["token_strs"]  # ChatML's special tokens, one id each
    text = client.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
    assert "Hello there" in text
    assert text.rstrip().endswith("<|im_start|>assistant")  # the generation prompt

    without = client.post(
        "/tokenize", json={"messages": CHAT, "add_generation_prompt": False}
    ).json()
    assert without["count"] < body["count"]


def test_tokenize_chat_continue_final_message(client: httpx.Client) -> None:
    messages = [*CHAT, {"role": "assistant", "content": "Hi, I am"}]
    response = client.post(
        "/tokenize",
        json={
            "messages": messages,
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    )
    assert response.status_code == 200
    text = client.post("/detokenize", json={"tokens": response.json()["tokens"]}).json()
    assert text["prompt"].endswith("Hi, I am")


def test_request_chat_template_on_trusting_server(client: httpx.Client) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    response = client.post(
        "/tokenize",
        json={"messages": CHAT, "chat_template": template, "add_generation_prompt": False},
    )
    assert response.status_code == 200
    text = client.post("/detokenize", json={"tokens": response.json()["tokens"]}).json()
    assert text["prompt"] == "[system]You are terse.[user]Hello there"


def test_detokenize_round_trip(client: httpx.Client) -> None:
    prompt = "The quick brown fox, 123 — ünïcödé!"
    tokens = client.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    response = client.post("/detokenize", json={"model": MODEL, "tokens": tokens})
    assert response.status_code == 200
    assert response.json() == {"prompt": prompt}


def test_detokenize_out_of_vocab(client: httpx.Client) -> None:
    for bad in (10**9, -1):
        response = client.post("/detokenize", json={"tokens": [1, bad]})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "tokens"
        assert "tokens" in error["message"]


def test_unknown_model_is_404(client: httpx.Client) -> None:
    for path, body in (
        ("/tokenize", {"model": "gpt-9", "prompt": "x"}),
        ("/tokenize", {"model": "gpt-9", "messages": CHAT}),
        ("/detokenize", {"model": "gpt-9", "tokens": [1]}),
    ):
        response = client.post(path, json=body)
        assert response.status_code == 404
        assert response.json()["error"] == {
            "message": "The model `gpt-9` does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }


def test_models_list_shape(client: httpx.Client) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == MODEL
    assert card["object"] == "model"
    assert card["owned_by"] == "duet"
    assert card["root"] == MODEL
    assert card["parent"] is None
    assert isinstance(card["created"], int)
    assert card["max_model_len"] > 0


def test_models_with_openai_sdk(render_server: ServerProcess) -> None:
    sdk = openai.OpenAI(base_url=f"{render_server.base_url}/v1", api_key="unused")
    models = sdk.models.list()
    assert [model.id for model in models.data] == [MODEL]
    assert sdk.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.models.retrieve("gpt-9")
    assert caught.value.code == "model_not_found"


def test_health_and_version(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    version = client.get("/version").json()["version"]
    assert re.match(r"^\d+\.\d+", version)


def test_metrics_count_requests_and_tokens(client: httpx.Client) -> None:
    before = client.get("/metrics").text
    tokens = client.post("/tokenize", json={"prompt": "count me"}).json()["count"]
    client.post("/tokenize", json={"messages": CHAT})
    after_response = client.get("/metrics")
    assert after_response.headers["content-type"].startswith("text/plain")
    after = after_response.text
    requests = "duet_render_http_requests_total"
    labels = {"method": "POST", "route": "/tokenize", "status": "200"}
    assert _metric(after, requests, **labels) - _metric(before, requests, **labels) >= 2
    tokenized = "duet_render_tokens_tokenized_total"
    assert _metric(after, tokenized) - _metric(before, tokenized) >= tokens
    assert _metric(after, "duet_render_chat_template_seconds_count") >= 1
    assert "duet_render_http_request_duration_seconds_bucket" in after


HOSTILE_TEMPLATES = {
    # 10^10 silent iterations: only the render deadline (1 s on this server) stops it.
    "deadline": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    # Floods output: the output budget stops it.
    "output": "{% for a in range(100000) %}{% for b in range(100000) %}{{ a }}{{ b }}"
    "{% endfor %}{% endfor %}",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_TEMPLATES))
def test_hostile_template_is_400_and_health_stays_fast(
    render_server: ServerProcess, kind: str
) -> None:
    hostile = HOSTILE_TEMPLATES[kind]
    result: dict[str, httpx.Response] = {}

    def render() -> None:
        result["response"] = httpx.post(
            f"{render_server.base_url}/tokenize",
            json={"messages": CHAT, "chat_template": hostile},
            timeout=60.0,
        )

    worker = threading.Thread(target=render)
    worker.start()
    latencies: list[float] = []
    with httpx.Client(base_url=render_server.base_url, timeout=10.0) as probe:
        while worker.is_alive():
            started = time.perf_counter()
            assert probe.get("/health").status_code == 200
            latencies.append(time.perf_counter() - started)
            time.sleep(0.02)
    worker.join()
    response = result["response"]
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert latencies, "the render finished before /health could be probed"
    assert max(latencies) < 1.0, f"/health stalled while a template rendered: {latencies}"
