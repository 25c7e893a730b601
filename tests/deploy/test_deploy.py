"""Deployment files: manifests valid against the Kubernetes schemas (as kustomize builds
them), Dockerfiles clean under hadolint, every flag or DUET_* variable they use one the
binaries actually have, the render pods' probes answered by a real render-serve holding
the manifests' API key, and every compose service restarted when it exits."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.helpers.processes import ServerProcess, start_server, stop_server

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUSTOMIZATIONS = [DEPLOY / "k8s" / "base", DEPLOY / "k8s" / "overlays" / "example"]
DOCKERFILES = sorted((DEPLOY / "docker").glob("*.Dockerfile"))
BIN = Path(sys.executable).parent

KeyedServers = Callable[[str], ServerProcess]


def _tool(name: str) -> str:
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (it comes with the `test` extra)")
    return str(path)


def _kustomize(directory: Path) -> list[dict]:
    built = subprocess.run(
        [_tool("kubectl"), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [doc for doc in yaml.safe_load_all(built) if doc]


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda d: d.name)
def test_kustomize_output_validates_against_kubernetes_schemas(directory: Path) -> None:
    import kubernetes_validate

    documents = _kustomize(directory)
    kinds = {doc["kind"] for doc in documents}
    assert {
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "StatefulSet",
        "NetworkPolicy",
        "ConfigMap",
        "Secret",
        "PersistentVolumeClaim",
    } <= kinds
    for doc in documents:
        kubernetes_validate.validate(doc, "1.33.0", strict=True)


def test_worker_pods_request_a_gpu_and_probes_exist() -> None:
    documents = {(d["kind"], d["metadata"]["name"]): d for d in _kustomize(KUSTOMIZATIONS[0])}
    worker = documents[("StatefulSet", "duet-worker")]["spec"]["template"]["spec"]
    container = worker["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "readinessProbe" in container
    assert "livenessProbe" in container
    render = documents[("Deployment", "duet-render")]["spec"]["template"]["spec"]["containers"][0]
    assert render["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert render["livenessProbe"]["httpGet"]["path"] == "/health"
    assert documents[("Service", "duet-worker")]["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_pass_hadolint(dockerfile: Path) -> None:
    result = subprocess.run(
        [_tool("hadolint"), "--ignore", "DL3008", "--ignore", "DL3013", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _help_flags(command: str) -> set[str]:
    text = subprocess.run(
        [_tool(command), "--help"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return set(re.findall(r"--[a-z][a-z0-9-]*", text))


def _flags_in(args: list[str]) -> set[str]:
    return {arg.split("=", 1)[0] for arg in args if arg.startswith("--")}


def _container_args() -> dict[str, set[str]]:
    used: dict[str, set[str]] = {"render-serve": set(), "gpu-worker": set()}
    for directory in KUSTOMIZATIONS:
        for doc in _kustomize(directory):
            if doc["kind"] not in ("Deployment", "StatefulSet"):
                continue
            for container in doc["spec"]["template"]["spec"]["containers"]:
                command = "render-serve" if "render" in container["image"] else "gpu-worker"
                used[command] |= _flags_in(container.get("args", []))
                for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                    exec_command = container.get(probe, {}).get("exec", {}).get("command")
                    if exec_command:
                        used.setdefault(exec_command[0], set()).update(_flags_in(exec_command))
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    for name, service in compose["services"].items():
        command = service.get("command")
        if not command:
            continue
        binary = "gpu-worker" if name == "worker" else "render-serve"
        used[binary] |= _flags_in(command)
        healthcheck = service.get("healthcheck", {}).get("test", [])
        if len(healthcheck) > 1:
            used.setdefault(healthcheck[1], set()).update(_flags_in(healthcheck))
    return used


def test_compose_and_manifests_use_only_real_flags() -> None:
    for binary, flags in _container_args().items():
        unknown = flags - _help_flags(binary)
        assert not unknown, f"{binary} has no {sorted(unknown)}"


def test_duet_environment_variables_are_real_settings() -> None:
    from render_server.settings import RenderSettings

    names = set(RenderSettings.model_fields) | {"api_key", "api_keys"}
    for directory in KUSTOMIZATIONS:
        for doc in _kustomize(directory):
            data = doc.get("data") or doc.get("stringData") or {}
            for key in data:
                if key.startswith("DUET_"):
                    assert key.removeprefix("DUET_").lower() in names, key


PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def _render_pod(documents: list[dict]) -> tuple[dict, dict[str, str]]:
    """The render container of the render Deployment, and the environment its Secret and
    ConfigMap give it (envFrom)."""
    by_name = {(doc["kind"], doc["metadata"]["name"]): doc for doc in documents}
    pod = by_name[("Deployment", "duet-render")]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "secretRef" in source:
            doc = by_name[("Secret", source["secretRef"]["name"])]
        else:
            doc = by_name[("ConfigMap", source["configMapRef"]["name"])]
        env.update(doc.get("stringData") or doc.get("data") or {})
    return container, env


def _probe_port(container: dict, port: int | str) -> int:
    """A probe's port as the kubelet resolves it: a number, or a named container port."""
    if isinstance(port, int):
        return port
    named = {entry.get("name"): entry["containerPort"] for entry in container["ports"]}
    assert port in named, f"probe port {port!r} names no container port"
    return named[port]


@pytest.fixture(scope="module")
def keyed_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedServers]:
    """render-serve --render-only with DUET_API_KEY set as the manifests' Secret sets it,
    one per distinct key (the model and workers of the manifests do not exist here, and
    the key check in front of /ready is the same with or without workers)."""
    servers: dict[str, ServerProcess] = {}

    def server_for(key: str) -> ServerProcess:
        if key not in servers:
            log = tmp_path_factory.mktemp("keyed") / "render.log"
            servers[key] = start_server(["--render-only"], log, env={"DUET_API_KEY": key})
        return servers[key]

    yield server_for
    for server in servers.values():
        stop_server(server)


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda d: d.name)
def test_render_probes_pass_on_a_server_with_the_manifests_api_key(
    directory: Path, keyed_servers: KeyedServers
) -> None:
    """Each HTTP probe of the render pods, sent as the kubelet sends it (its path, its
    port resolved by name, its headers and no others but the kubelet's own), gets 200
    from render-serve holding the API key of the manifests' Secret."""
    container, env = _render_pod(_kustomize(directory))
    assert env.get("DUET_API_KEY"), "the manifests set no API key: nothing to test"
    server = keyed_servers(env["DUET_API_KEY"])
    assert httpx.get(f"{server.base_url}/v1/models").status_code == 401  # the key holds
    listen_port = int(
        next(arg for arg in container["args"] if arg.startswith("--port=")).split("=")[1]
    )
    probes = {name: container[name]["httpGet"] for name in PROBES if name in container}
    assert {"readinessProbe", "livenessProbe"} <= set(probes)
    for name, probe in probes.items():
        assert probe.get("scheme", "HTTP") == "HTTP", name
        assert "host" not in probe, name  # the kubelet then asks the pod's own address
        # The probe reaches the port render-serve listens on in the pod; here that server
        # listens on a free port instead.
        assert _probe_port(container, probe["port"]) == listen_port, name
        headers = {"User-Agent": "kube-probe/1.33", "Accept": "*/*"}
        headers.update({header["name"]: header["value"] for header in probe.get("httpHeaders", [])})
        response = httpx.get(f"{server.base_url}{probe['path']}", headers=headers)
        assert response.status_code == 200, f"{name} {probe['path']}: {response.text}"


def test_ready_without_a_key_tells_only_whether_it_is_ready(keyed_servers: KeyedServers) -> None:
    """/ready is public like /health, and says no more without a key than it did with one:
    a status word, and the standard headers."""
    key = _render_pod(_kustomize(KUSTOMIZATIONS[0]))[1]["DUET_API_KEY"]
    server = keyed_servers(key)
    anonymous = httpx.get(f"{server.base_url}/ready")
    keyed = httpx.get(f"{server.base_url}/ready", headers={"Authorization": f"Bearer {key}"})
    assert anonymous.status_code == keyed.status_code == 200
    assert anonymous.content == keyed.content == b'{"status":"ready"}'
    assert set(anonymous.headers) == {"content-type", "content-length", "date", "x-request-id"}


def test_every_compose_service_restarts_when_it_exits() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    policies = {name: service.get("restart") for name, service in compose["services"].items()}
    assert {"worker", "render-1", "render-2", "lb"} <= set(policies)
    assert all(policy in ("always", "unless-stopped") for policy in policies.values()), policies
