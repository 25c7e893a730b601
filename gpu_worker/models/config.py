"""ModelConfig: the shape and numerics of a decoder-only model, whatever file it came from.

The loader fills it from config.json or GGUF metadata; model files read it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style rope scaling (the only kind the Llama family here needs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only model, whatever file it came from."""

    architecture: str
    """HF class name (`LlamaForCausalLM`) or GGUF architecture (`llama`, `qwen2`)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    """llama3 rope scaling from config.json; None for plain rope."""
    rope_freq_factors: tuple[float, ...] | None = None
    """Per-pair rope divisors from a GGUF `rope_freqs` tensor (llama.cpp's llama3 scaling)."""
    attention_bias: bool = False
    """Bias on the q/k/v projections (Qwen2)."""
    attention_out_bias: bool = False
    """Bias on the output projection (Llama with `attention_bias: true`)."""
    sliding_window: int | None = None
    """The sliding attention window (Mistral v0.1's): a query at position p sees keys
    p - window < k <= p; which layers slide is `layer_windows`'s, else every layer."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    layer_windows: tuple[int | None, ...] | None = None
    """Each layer's sliding window, None for a global layer (Qwen2's `max_window_layers`,
    Gemma's local/global patterns); None here means every layer has `sliding_window`."""

    def window_of(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer`, or None if it attends globally."""
        if self.layer_windows is not None:
            return self.layer_windows[layer]
        return self.sliding_window
