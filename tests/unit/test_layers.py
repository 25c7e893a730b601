"""The layers of ARCHITECTURE.md, checked: no module imports a concern above its own.

Each concern (a subpackage of a tier, or a top-level package) may import only the concerns
listed for it. The table is the architecture; a new import that runs back up the layers
fails here, with the file that does it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shared", "kernels", "render_server", "gpu_worker")

# concern -> the concerns it may import (besides itself). Render tier first, top down.
ALLOWED: dict[str, set[str]] = {
    "render_server.cli": {
        "render_server.serve",
        "render_server.processes",
        "render_server.settings",
        "render_server.templating",
        "render_server.worker_client",
        "shared",
    },
    "render_server.processes": {"render_server.serve", "render_server.settings"},
    "render_server.serve": {
        "render_server.http",
        "render_server.settings",
        "render_server.templating",
        "shared",
    },
    "render_server.http": {
        "render_server.generation",
        "render_server.parsing",
        "render_server.schemas",
        "render_server.settings",
        "render_server.store",
        "render_server.templating",
        "render_server.worker_client",
        "shared",
    },
    "render_server.settings": {"render_server.parsing", "render_server.worker_client", "shared"},
    "render_server.generation": {
        "render_server.schemas",
        "render_server.templating",
        "render_server.worker_client",
        "shared",
    },
    "render_server.parsing": {"render_server.schemas", "shared"},
    "render_server.templating": {"shared"},
    # Images: fetched safely, decoded and processed for the model (third-party libs below).
    "render_server.multimodal": {"shared"},
    "render_server.worker_client": {"shared"},
    "render_server.store": {"shared"},
    "render_server.schemas": {"shared"},
    # GPU tier, top down.
    "gpu_worker.cli": {
        "gpu_worker.server",
        "gpu_worker.engine",
        "gpu_worker.core",
        "gpu_worker.runner",
        "shared",
    },
    # core: the KV cache events it publishes (gpu_worker/server/kv_events.py).
    "gpu_worker.server": {"gpu_worker.engine", "gpu_worker.core", "gpu_worker.runner", "shared"},
    "gpu_worker.engine": {
        "gpu_worker.core",
        "gpu_worker.distributed",
        "gpu_worker.lora",
        "gpu_worker.runner",
        "gpu_worker.sampling",
        "gpu_worker.spec_decode",
        "gpu_worker.loader",
        "gpu_worker.models",
        "gpu_worker.attention",
        "gpu_worker.ops",
        "shared",
    },
    "gpu_worker.runner": {
        "gpu_worker.core",
        "gpu_worker.models",
        "gpu_worker.attention",
        "gpu_worker.ops",
        "shared",
    },
    "gpu_worker.loader": {
        "gpu_worker.gguf_tensors",
        "gpu_worker.models",
        "gpu_worker.attention",
        "gpu_worker.ops",
        "gpu_worker.distributed",
        "shared",
    },
    # Multi-LoRA: adapters, their slots and the batched add, hooked into a built model.
    "gpu_worker.lora": {
        "gpu_worker.models",
        "gpu_worker.ops",
        "gpu_worker.distributed",
        "kernels",
        "shared",
    },
    # Speculative decoding's drafters and verification: below the engine, beside sampling.
    "gpu_worker.spec_decode": {"gpu_worker.sampling", "shared"},
    # A GGUF tensor read lazily, for a TP rank's slices: gguf, numpy and torch alone.
    "gpu_worker.gguf_tensors": set(),
    "gpu_worker.models": {"gpu_worker.attention", "gpu_worker.ops", "shared"},
    "gpu_worker.attention": {"gpu_worker.ops", "kernels", "shared"},
    "gpu_worker.ops": {"kernels", "shared"},
    # Tensor parallelism: the TP group, its collectives, the parallel layer types and
    # `parallelize`, which swaps them into a built model.
    "gpu_worker.distributed": {"gpu_worker.models", "gpu_worker.ops", "shared"},
    # The pure-Python engine core: scheduler, KV block manager, sequences, config.
    "gpu_worker.core": {"gpu_worker.sampling.state", "gpu_worker.spec_decode.config", "shared"},
    "gpu_worker.sampling": {"shared"},
    "gpu_worker.__init__": {"gpu_worker.engine"},
    "render_server.__init__": set(),
    "kernels": set(),
    "shared": set(),
}


def concern(module: str) -> str:
    """`render_server.http.api.chat` -> `render_server.http`; `shared.protocol` -> `shared`."""
    parts = module.split(".")
    if parts[0] in ("render_server", "gpu_worker") and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def imports(path: Path) -> list[str]:
    """Every project module `path` imports, lazily or not."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
    return [name for name in found if name.split(".")[0] in PACKAGES]


def modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def is_allowed(source: str, target: str) -> bool:
    allowed = ALLOWED[source]
    return concern(target) == source or any(
        target == entry or target.startswith(entry + ".") or concern(target) == entry
        for entry in allowed
    )


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_import_runs_back_up_the_layers(path: Path) -> None:
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    source = concern(module)
    assert source in ALLOWED, f"{module}: its concern {source} is missing from ALLOWED"
    wrong = [target for target in imports(path) if not is_allowed(source, target)]
    assert wrong == [], f"{module} ({source}) imports {wrong}"
