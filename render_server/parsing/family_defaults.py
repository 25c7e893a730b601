"""Per-family output parsers: what a server started without `--tool-call-parser` /
`--reasoning-parser` reads a model's text with.

The family comes from the model's architecture (config.json `architectures`, GGUF
`general.architecture`) and, where one architecture covers several formats (Llama 2 and 3,
Mistral GGUFs that say "llama"), from the chat template's turn markers. Explicit flags always
win, and for tools so does the format the chat template itself asks for (`tool_setup`):
the family fills in only what neither names.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from shared.gguf_metadata import GGUFError, read_gguf_metadata
from shared.model_source import ModelSource

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FamilyDefaults:
    family: str | None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


# family -> (tool-call parser, reasoning parser)
_PARSERS: dict[str, tuple[str | None, str | None]] = {
    "qwen3": ("hermes", "qwen3"),
    "llama3": ("llama3_json", None),
    "mistral": ("mistral", None),
    # Neither has a call format a parser knows: no default, rather than a wrong one.
    "gemma": (None, None),
    "phi": (None, None),
}


def model_architecture(source: ModelSource) -> str | None:
    """config.json's `architectures[0]` (else `model_type`), or GGUF `general.architecture`;
    None when the files do not say."""
    try:
        if source.kind == "gguf":
            meta = read_gguf_metadata(source.path, keys={"general.architecture"})
            return meta.string("general.architecture")
        config = json.loads((source.path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, GGUFError) as exc:
        logger.warning("cannot read the architecture of %s: %s", source.path, exc)
        return None
    if not isinstance(config, dict):
        return None
    architectures = config.get("architectures")
    if isinstance(architectures, list) and architectures and isinstance(architectures[0], str):
        return architectures[0]
    model_type = config.get("model_type")
    return model_type if isinstance(model_type, str) else None


def model_family(architecture: str | None, chat_template: str | None) -> str | None:
    """`qwen3`, `llama3`, `mistral`, `gemma`, `phi`, or None for any other model."""
    arch = (architecture or "").lower()
    template = chat_template or ""
    if arch.startswith("qwen3"):  # Qwen3ForCausalLM, Qwen3MoeForCausalLM, qwen3, qwen3moe
        return "qwen3"
    if arch.startswith(("gemma", "phi")):
        return "gemma" if arch.startswith("gemma") else "phi"
    if arch.startswith("mistral") or (arch.startswith("llama") and "[INST]" in template):
        return "mistral"
    if arch.startswith("llama") and "<|start_header_id|>" in template:
        return "llama3"  # Llama 2 and SmolLM2 say "llama" too, with other turn markers
    return None


def family_defaults(source: ModelSource, chat_template: str | None) -> FamilyDefaults:
    """The parsers the model's family implies (None where it implies none)."""
    family = model_family(model_architecture(source), chat_template)
    tools, reasoning = _PARSERS.get(family or "", (None, None))
    return FamilyDefaults(family, tools, reasoning)
