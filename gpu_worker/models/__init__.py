"""Model implementations, looked up by architecture name.

Keys are HF `architectures[0]` names (config.json) and GGUF `general.architecture` values;
the loader picks the class from `ModelConfig.architecture`. Each class reads its own configs
(`CausalLM.config_from_hf` / `config_from_gguf`), so a family is its file and its lines here.
"""

from __future__ import annotations

from gpu_worker.models.base import CausalLM
from gpu_worker.models.gemma2 import Gemma2ForCausalLM
from gpu_worker.models.gemma3 import Gemma3ForCausalLM
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.models.mixtral import MixtralForCausalLM
from gpu_worker.models.phi3 import Phi3ForCausalLM
from gpu_worker.models.qwen3 import Qwen3ForCausalLM
from gpu_worker.models.qwen3_moe import Qwen3MoeForCausalLM

HF_ARCHITECTURES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}
"""config.json's `architectures[0]` -> the class that serves it."""

HF_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
"""config.json's `model_type` -> its architecture, for a config.json without `architectures`."""

GGUF_ARCHITECTURES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,  # Mistral's and Mixtral's GGUFs say llama too
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "phi3": Phi3ForCausalLM,
    "qwen3moe": Qwen3MoeForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}
"""GGUF `general.architecture` -> the class that serves it."""

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    **HF_ARCHITECTURES,
    **GGUF_ARCHITECTURES,
    # The loader's name for a GGUF llama with `llama.expert_count` (Mixtral).
    "mixtral": MixtralForCausalLM,
}
"""Every name `ModelConfig.architecture` may hold -> the class that serves it."""


def get_model_class(architecture: str) -> type[CausalLM]:
    """The class that serves `architecture`, or a ValueError naming the supported ones."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        known = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {known}") from None


__all__ = [
    "GGUF_ARCHITECTURES",
    "HF_ARCHITECTURES",
    "HF_MODEL_TYPES",
    "MODEL_REGISTRY",
    "CausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "MixtralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "get_model_class",
]
