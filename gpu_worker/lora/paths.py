"""Where a runtime-loaded adapter may come from: a directory inside `--lora-root`, nowhere else.

A client names an adapter's path in `POST /v1/load_lora_adapter`; the worker reads it from
its own disk. Everything is resolved with symlinks followed before anything is read, so
neither `../` nor a symlink pointing out of the root reaches a file outside it, and the two
PEFT files are checked the same way (each may itself be a symlink). Errors carry the HTTP
status they mean and name the problem; they never echo what a file holds, nor where a
symlink points.
"""

from __future__ import annotations

import re
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


class LoRAError(Exception):
    """An adapter that cannot be served; `status` is the HTTP status the API answers with."""

    status = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidLoRAError(LoRAError):
    """A request or adapter the worker refuses: a URL, a path outside the root, a config or
    tensor it does not support (400)."""

    status = 400


class LoRANotFoundError(LoRAError):
    """An adapter directory or one of its files that does not exist (404)."""

    status = 404


def resolve_adapter_dir(path: str, lora_root: Path | None) -> Path:
    """The real directory of the adapter at `path` (relative to `lora_root`, or absolute),
    holding both PEFT files, all inside the real `lora_root`; else a `LoRAError`."""
    if lora_root is None:
        raise InvalidLoRAError("loading adapters by path needs the worker's --lora-root")
    if _URL.match(path):
        raise InvalidLoRAError("adapters load from the worker's disk, not from a URL")
    if not path or "\0" in path:
        raise InvalidLoRAError("the adapter path is empty or holds a NUL character")
    try:
        root = lora_root.resolve(strict=True)
    except OSError:
        raise LoRANotFoundError("the worker's --lora-root does not exist") from None
    # Containment is decided before existence, so a path outside the root answers the same
    # whether or not something is there.
    directory = _inside(root, root / path, path)
    if not directory.is_dir():
        raise LoRANotFoundError(f"no adapter directory at {path!r} under the LoRA root")
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        file = _inside(root, directory / name, f"{path}/{name}")
        if not file.is_file():
            raise LoRANotFoundError(f"the adapter at {path!r} has no {name}")
    return directory


def _inside(root: Path, candidate: Path, shown: str) -> Path:
    """`candidate` with every symlink followed, if that lies under `root`."""
    try:
        real = candidate.resolve(strict=False)
    except (OSError, RuntimeError):  # a symlink loop
        raise InvalidLoRAError(f"the adapter path {shown!r} does not resolve") from None
    if not real.is_relative_to(root):
        raise InvalidLoRAError(f"the adapter path {shown!r} leads outside the LoRA root")
    return real
