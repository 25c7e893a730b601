"""Model implementations, looked up by architecture name.

Keys are HF `architectures[0]` names (config.json) and GGUF `general.architecture` values;
the loader picks the class from `ModelConfig.architecture`.
"""

from __future__ import annotations

from torch import nn

from gpu_worker.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    # GGUF architecture names (Mistral GGUFs say "llama").
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class that serves `architecture`, or a ValueError naming the supported ones."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        known = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {known}") from None


__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "get_model_class"]
