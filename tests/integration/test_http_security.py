"""API keys (default deny, path tricks), request ids and CORS on a real keyed server."""

from __future__ import annotations

import http.client
import json
import re

import httpx
import pytest

from render_server.settings import RenderSettings
from tests.helpers.processes import SECURE_KEYS, SECURE_ORIGIN, ServerProcess

PROTECTED = ["/v1/models", "/tokenize", "/detokenize", "/metrics", "/docs", "/openapi.json"]
# Raw request targets a path-normalizing client would rewrite; http.client sends them as-is.
PATH_TRICKS = [
    "//v1/models",
    "/V1/models",
    "/v1/models/",
    "/v1//models",
    "/health/../v1/models",
    "/health/%2e%2e/v1/models",
    "/health/%2E%2E/v1/models",
    "/health%2f..%2fv1/models",
    "/version/../tokenize",
    "/./v1/models",
    "/health/",
    "//health",
    "/HEALTH",
    "/health;x",
    "/health%00",
    "/api/health",  # root_path is /api: a proxy strips it, so this is /api/api/health inside
    "/api/v1/models",
    "/v1/models?x=/health",
    "/v1/models#/health",
]


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def raw_get(server: ServerProcess, target: str, headers: dict[str, str] | None = None):
    """GET with the request target sent byte for byte (no normalization)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        connection.request("GET", target, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def assert_401(status: int, headers: dict[str, str], body: bytes) -> None:
    assert status == 401, body
    lowered = {name.lower(): value for name, value in headers.items()}
    assert lowered["www-authenticate"] == "Bearer"
    assert lowered["x-request-id"]
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_api_key"
    assert set(error) == {"message", "type", "param", "code"}


def test_public_paths_need_no_key(secure_client: httpx.Client) -> None:
    assert secure_client.get("/health").status_code == 200
    assert secure_client.get("/version").status_code == 200


@pytest.mark.parametrize("path", PROTECTED)
def test_every_other_path_needs_a_key(secure_client: httpx.Client, path: str) -> None:
    for method in ("GET", "POST", "OPTIONS", "DELETE"):
        response = secure_client.request(method, path, json={"prompt": "x"})
        assert_401(response.status_code, dict(response.headers), response.content)


@pytest.mark.parametrize("target", PATH_TRICKS)
def test_path_tricks_do_not_bypass_auth(secure_server: ServerProcess, target: str) -> None:
    assert_401(*raw_get(secure_server, target))


@pytest.mark.parametrize("target", PATH_TRICKS)
def test_path_tricks_with_a_key_reach_nothing_unexpected(
    secure_server: ServerProcess, target: str
) -> None:
    status, _, body = raw_get(secure_server, target, _auth(SECURE_KEYS[0]))
    if status == 200:  # only the canonical routes themselves may answer
        assert target.startswith("/v1/models?") or target.startswith("/v1/models#"), body
    else:
        assert status in (400, 404, 405), body


@pytest.mark.parametrize(
    "authorization",
    [
        "Bearer wrong-key",
        f"Bearer {SECURE_KEYS[0]}x",
        f"Bearer {SECURE_KEYS[0][:-1]}",
        f"Basic {SECURE_KEYS[0]}",
        SECURE_KEYS[0],
        "Bearer",
        f"Bearer {SECURE_KEYS[0]} {SECURE_KEYS[1]}",
    ],
)
def test_bad_keys_are_401(secure_client: httpx.Client, authorization: str) -> None:
    response = secure_client.get("/v1/models", headers={"Authorization": authorization})
    assert_401(response.status_code, dict(response.headers), response.content)


def test_both_keys_work(secure_client: httpx.Client) -> None:
    for key in SECURE_KEYS:
        assert secure_client.get("/v1/models", headers=_auth(key)).status_code == 200
        response = secure_client.post("/tokenize", json={"prompt": "hi"}, headers=_auth(key))
        assert response.status_code == 200
    # The scheme is case-insensitive, as HTTP says.
    lower = {"Authorization": f"bearer {SECURE_KEYS[1]}"}
    assert secure_client.get("/metrics", headers=lower).status_code == 200
    assert secure_client.get("/openapi.json", headers=_auth(SECURE_KEYS[0])).status_code == 200


def test_request_template_refused_without_trust(secure_client: httpx.Client) -> None:
    response = secure_client.post(
        "/tokenize",
        json={"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"},
        headers=_auth(SECURE_KEYS[0]),
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "chat_template"


def test_request_id_is_generated(secure_client: httpx.Client) -> None:
    seen = set()
    for path in ("/health", "/v1/models", "/nope"):
        request_id = secure_client.get(path).headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", request_id)
        seen.add(request_id)
    assert len(seen) == 3


def test_request_id_is_echoed_sanitized_and_capped(secure_client: httpx.Client) -> None:
    echoed = secure_client.get("/health", headers={"X-Request-Id": "trace-42.a:b_c"})
    assert echoed.headers["x-request-id"] == "trace-42.a:b_c"
    dirty = secure_client.get("/health", headers={"X-Request-Id": "a b<script>\"'/\\c"})
    assert dirty.headers["x-request-id"] == "abscriptc"
    long = secure_client.get("/health", headers={"X-Request-Id": "x" * 1000})
    assert long.headers["x-request-id"] == "x" * 128
    junk = secure_client.get("/health", headers={"X-Request-Id": "<>!!"})
    assert re.fullmatch(r"[0-9a-f]{32}", junk.headers["x-request-id"])
    # On errors too.
    unauthorized = secure_client.get("/v1/models", headers={"X-Request-Id": "req-401"})
    assert unauthorized.status_code == 401
    assert unauthorized.headers["x-request-id"] == "req-401"


def test_cors_preflight(secure_client: httpx.Client) -> None:
    preflight = {
        "Origin": SECURE_ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    # No key: browsers never send credentials on a preflight.
    response = secure_client.options("/tokenize", headers=preflight)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == SECURE_ORIGIN
    assert "POST" in response.headers["access-control-allow-methods"]

    refused = secure_client.options(
        "/tokenize", headers={**preflight, "Origin": "http://evil.test"}
    )
    assert refused.status_code == 400
    assert "access-control-allow-origin" not in refused.headers
    assert refused.json()["error"]["code"] == "cors_preflight_refused"


def test_cors_headers_on_simple_and_error_responses(secure_client: httpx.Client) -> None:
    headers = {"Origin": SECURE_ORIGIN, **_auth(SECURE_KEYS[0])}
    ok = secure_client.get("/v1/models", headers=headers)
    assert ok.headers["access-control-allow-origin"] == SECURE_ORIGIN
    assert "x-request-id" in ok.headers["access-control-expose-headers"].lower()
    # A browser can read the 401 too, so a web client can tell "bad key" from "down".
    denied = secure_client.get("/v1/models", headers={"Origin": SECURE_ORIGIN})
    assert denied.status_code == 401
    assert denied.headers["access-control-allow-origin"] == SECURE_ORIGIN
    other = secure_client.get("/health", headers={"Origin": "http://evil.test"})
    assert "access-control-allow-origin" not in other.headers


def test_api_keys_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DUET_API_KEY", "alpha, beta,")
    monkeypatch.setenv("OPENAI_API_KEY", "not-ours")
    settings = RenderSettings()
    assert settings.api_keys == ["alpha", "beta"]
    assert "alpha" not in repr(settings)  # keys stay out of logs
    # Flags (constructor arguments) replace the environment's keys.
    assert RenderSettings(api_keys=["gamma"]).api_keys == ["gamma"]
    monkeypatch.delenv("DUET_API_KEY")
    assert RenderSettings().api_keys == []
