"""Deployment files: manifests valid against the Kubernetes schemas (as kustomize builds
them), Dockerfiles clean under hadolint, and every flag or DUET_* variable they use is
one the binaries actually have."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUSTOMIZATIONS = [DEPLOY / "k8s" / "base", DEPLOY / "k8s" / "overlays" / "example"]
DOCKERFILES = sorted((DEPLOY / "docker").glob("*.Dockerfile"))
BIN = Path(sys.executable).parent


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
