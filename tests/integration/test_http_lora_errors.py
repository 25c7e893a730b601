"""The runtime LoRA routes answer errors in every route's shape (OpenAI's: `type`,
`param`, a string `code`), and /v1/models gives a --lora-modules adapter its path as
`root`: a real render-serve (render-only) declaring one adapter."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.helpers.processes import ServerProcess, start_server, stop_server

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("lora-render") / "render-serve.log"
    args = ["--render-only", "--allow-runtime-lora-updating", "--lora-modules", "sql=/adapters/sql"]
    server = start_server(args, log)
    yield server
    stop_server(server)


def _error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    error: dict[str, object] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["code"], str), error
    return error


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"),
    [
        ("/v1/load_lora_adapter", {"lora_path": "x"}, 400, "lora_name", "invalid_lora_adapter"),
        ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path", "invalid_lora_adapter"),
        (
            "/v1/load_lora_adapter",
            {"lora_name": "sql", "lora_path": "sql"},
            400,
            "lora_name",
            "invalid_lora_adapter",
        ),
        ("/v1/unload_lora_adapter", {}, 400, "lora_name", "invalid_lora_adapter"),
        ("/v1/unload_lora_adapter", {"lora_name": "nope"}, 404, "lora_name", "lora_not_found"),
    ],
)
def test_lora_route_errors_have_every_routes_shape(
    lora_server: ServerProcess,
    path: str,
    body: dict[str, str],
    status: int,
    param: str,
    code: str,
) -> None:
    error = _error(httpx.post(f"{lora_server.base_url}{path}", json=body, timeout=10), status)
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)


def test_models_give_a_declared_adapter_its_path_as_root(lora_server: ServerProcess) -> None:
    models = httpx.get(f"{lora_server.base_url}/v1/models", timeout=10).json()["data"]
    adapter = next(model for model in models if model["id"] == "sql")
    assert (adapter["root"], adapter["parent"]) == ("/adapters/sql", MODEL)
    base = next(model for model in models if model["id"] == MODEL)
    assert base["parent"] is None
