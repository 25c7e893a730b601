"""Deployment files: manifests valid against the Kubernetes schemas (as kustomize builds
them), Dockerfiles clean under hadolint, every flag or DUET_* variable they use one the
binaries actually have, the render pods' probes answered by a real render-serve holding
the manifests' API key, every compose service restarted when it exits, and the
multi-node tensor-parallel overlay's LeaderWorkerSet one group whose ranks agree."""

from __future__ import annotations

import json
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
OVERLAYS = DEPLOY / "k8s" / "overlays"
TP_OVERLAY = OVERLAYS / "tp-multinode"
KUSTOMIZATIONS = [DEPLOY / "k8s" / "base", OVERLAYS / "example", TP_OVERLAY]
# JSON schemas of the custom resources the manifests use (kubernetes-validate knows only
# the built-in kinds), named as kubernetes-validate names its own: kind-group-version.
CRD_SCHEMAS = Path(__file__).parent / "schemas"
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


def _validate(doc: dict) -> None:
    """Validate `doc` against Kubernetes 1.33's strict schema of its kind, or, for a custom
    resource, against its vendored schema, whose embedded Kubernetes types (pod templates)
    resolve to the same strict definitions."""
    import jsonschema
    import kubernetes_validate
    from kubernetes_validate.utils import schema_contents
    from referencing import Registry, Resource

    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", doc["apiVersion"])
    schema_file = CRD_SCHEMAS / f"{doc['kind'].lower()}-{group_version}.json"
    if not schema_file.exists():
        kubernetes_validate.validate(doc, "1.33.0", strict=True)
        return
    definitions = schema_contents(
        "kubernetes-json-schema/v1.33.0-local-strict/_definitions.json", "1.33.0"
    )
    schema = json.loads(schema_file.read_text())
    registry = Resource.from_contents(definitions) @ Registry()
    jsonschema.Draft202012Validator(schema, registry=registry).validate(doc)


def _pod_templates(doc: dict) -> list[dict]:
    """The pod templates of a workload: a LeaderWorkerSet has its leader's and its workers'."""
    if doc["kind"] in ("Deployment", "StatefulSet"):
        return [doc["spec"]["template"]]
    if doc["kind"] == "LeaderWorkerSet":
        group = doc["spec"]["leaderWorkerTemplate"]
        return [group[name] for name in ("leaderTemplate", "workerTemplate") if name in group]
    return []


SHARED_KINDS = {
    "Deployment",
    "Service",
    "HorizontalPodAutoscaler",
    "PodDisruptionBudget",
    "NetworkPolicy",
    "ConfigMap",
    "Secret",
    "PersistentVolumeClaim",
}


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda d: d.name)
def test_kustomize_output_validates_against_kubernetes_schemas(directory: Path) -> None:
    documents = _kustomize(directory)
    kinds = {doc["kind"] for doc in documents}
    # The TP overlay's workers are a LeaderWorkerSet in place of the base's StatefulSet.
    workers = "LeaderWorkerSet" if directory == TP_OVERLAY else "StatefulSet"
    assert SHARED_KINDS | {workers} <= kinds
    for doc in documents:
        _validate(doc)


def test_the_leaderworkerset_schema_refuses_what_the_api_server_would() -> None:
    """The vendored schema is strict at both of its levels: its own fields, and the pod
    template it takes from Kubernetes' definitions."""
    import jsonschema

    [group] = [doc for doc in _kustomize(TP_OVERLAY) if doc["kind"] == "LeaderWorkerSet"]
    _validate(group)
    misspelt = json.loads(json.dumps(group))
    misspelt["spec"]["leaderWorkerTemplate"]["sise"] = 2
    bad_pod = json.loads(json.dumps(group))
    bad_pod["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["argz"] = []
    bad_policy = json.loads(json.dumps(group))
    bad_policy["spec"]["startupPolicy"] = "LeaderStarted"
    for broken in (misspelt, bad_pod, bad_policy):
        with pytest.raises(jsonschema.ValidationError):
            _validate(broken)


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
            containers = [c for pod in _pod_templates(doc) for c in pod["spec"]["containers"]]
            for container in containers:
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


def _kubelet_expand(arg: str, env: dict[str, str]) -> str:
    """`arg` as the kubelet passes it: each $(NAME) of a variable in `env` replaced."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg)


def test_tp_overlay_pods_form_one_group_reached_through_its_leader() -> None:
    """Each pod of a LeaderWorkerSet group, given the environment LWS gives it, parses
    into the same engine config but its node rank: as many nodes as pods, as many ranks as
    their GPUs, every rank joining the rendezvous port the leader opens. Render pods reach
    the leader alone, through the headless Service, and the ranks reach each other."""
    import dataclasses

    from gpu_worker.cli import build_parser, config_from_args, server_config_from_args

    documents = _kustomize(TP_OVERLAY)
    by_name = {(doc["kind"], doc["metadata"]["name"]): doc for doc in documents}
    lws = by_name[("LeaderWorkerSet", "duet-worker-tp")]
    group = lws["spec"]["leaderWorkerTemplate"]
    size = group["size"]
    assert size > 1
    # Workers must start before the leader is ready: it is ready once every rank has joined.
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    # LWS's Shared subdomain: the leader pod `<set>-<replica>` under a headless Service
    # named after the set.
    leader_host = f"duet-worker-tp-0.duet-worker-tp.{lws['metadata']['namespace']}"
    leader, worker = group["leaderTemplate"], group["workerTemplate"]
    [leader_container] = leader["spec"]["containers"]
    leader_ports = {port["name"]: port["containerPort"] for port in leader_container["ports"]}
    config_map = by_name[("ConfigMap", "duet-config")]["data"]

    configs = []
    for index in range(size):
        [container] = (leader if index == 0 else worker)["spec"]["containers"]
        env = {"LWS_LEADER_ADDRESS": leader_host, "LWS_WORKER_INDEX": str(index)}
        args = [_kubelet_expand(arg, env) for arg in container["args"]]
        assert not [arg for arg in args if "$(" in arg], "a variable LWS does not set"
        parsed = build_parser().parse_args(args)
        config = config_from_args(parsed)
        assert (config.nnodes, config.node_rank) == (size, index)
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert config.tensor_parallel_size == gpus * size
        assert config.dist_init_addr == f"{leader_host}:{leader_ports['rendezvous']}"
        # Render pods tokenize for the model the ranks load, under the name they serve.
        assert (parsed.model, parsed.served_model_name) == (
            config_map["DUET_MODEL"],
            config_map["DUET_SERVED_MODEL_NAME"],
        )
        configs.append(dataclasses.replace(config, node_rank=0))
        if index == 0:
            leader_bind = server_config_from_args(parsed).bind
    assert all(config == configs[0] for config in configs)

    service = by_name[("Service", "duet-worker")]["spec"]
    assert service["clusterIP"] == "None"
    labels = {
        name: pod["metadata"]["labels"] for name, pod in (("leader", leader), ("worker", worker))
    }
    selects = {name: service["selector"].items() <= labels[name].items() for name in labels}
    assert selects == {"leader": True, "worker": False}
    [port] = service["ports"]
    assert leader_bind.endswith(f":{_probe_port(leader_container, port['targetPort'])}")
    assert {"readinessProbe", "livenessProbe"} <= set(leader_container)

    ranks = by_name[("NetworkPolicy", "duet-worker-tp-ranks")]["spec"]
    peers = ranks["podSelector"]["matchLabels"].items()
    assert all(peers <= pod_labels.items() for pod_labels in labels.values())
    [rule] = ranks["ingress"]
    assert "ports" not in rule  # NCCL picks its ports at run time
    assert [source["podSelector"]["matchLabels"].items() for source in rule["from"]] == [peers]
