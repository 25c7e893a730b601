"""Model implementations, looked up by architecture name.

Keys are HF `architectures[0]` names (config.json) and GGUF `general.architecture` values;
the loader picks the class from `ModelConfig.architecture`.
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

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    # GGUF architecture names (Mistral GGUFs say "llama").
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "phi3": Phi3ForCausalLM,
    "qwen3moe": Qwen3MoeForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    # The loader's name for a GGUF llama with `llama.expert_count` (Mixtral).
    "mixtral": MixtralForCausalLM,
}


def get_model_class(architecture: str) -> type[CausalLM]:
    """The class that serves `architecture`, or a ValueError naming the supported ones."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        known = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {known}") from None


__all__ = [
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
