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
class LongRope:
    """Phi-3's LongRoPE: per-pair frequency divisors for contexts up to the original
    pretraining length (`short_factor`) and beyond it (`long_factor`), and a factor on
    cos/sin. Which set a model uses is `gpu_worker.models.llama.rope_inv_freq`'s rule."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float
    """Multiplies cos and sin (transformers' `attention_scaling`), whichever set is used."""


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
    num_experts: int = 0
    """Experts per sparse MoE layer (Mixtral, Qwen3-MoE); 0 for a dense model."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """Each expert's inner size (`intermediate_size` stays the dense layers')."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing weights to sum to one (Mixtral always does)."""
    dense_layers: tuple[int, ...] = ()
    """Layers of an MoE model whose MLP is dense (Qwen3-MoE's `mlp_only_layers` and
    `decoder_sparse_step`)."""
    rotary_dim: int | None = None
    """How many leading dims of each head rotate (Phi-3/4's `partial_rotary_factor`); the
    rest pass through. None: all of head_dim."""
    longrope: LongRope | None = None
    """LongRoPE scaling (Phi-3 `rope_type: longrope`); None for other kinds."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by this ** -0.5 (Gemma's); None: head_dim ** -0.5."""
    attn_logit_softcapping: float | None = None
    """Attention scores become `cap * tanh(scores / cap)` before masking (Gemma 2)."""
    final_logit_softcapping: float | None = None
    """Logits become `cap * tanh(logits / cap)` (Gemma 2)."""
    rope_local_theta: float | None = None
    """Rotary base of the sliding-window layers (Gemma 3's `rope_local_base_freq`); None:
    `rope_theta`, as the global layers."""
    rope_linear_factor: float | None = None
    """Linear rope scaling (positions divided by it): Gemma 3's global layers."""

    def window_of(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer`, or None if it attends globally."""
        if self.layer_windows is not None:
            return self.layer_windows[layer]
        return self.sliding_window

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer`'s MLP is a sparse mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers
