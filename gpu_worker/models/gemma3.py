"""Gemma 3 text (HF `Gemma3ForCausalLM`, config `gemma3_text`; GGUF `gemma3`): Gemma 2's
decoder (`gpu_worker.models.gemma`) with q and k RMS-normed per head ((1 + w), before
rotary), no soft-capping by default, five local layers to one global, and the local layers'
own rotary base (`ModelConfig.rope_local_theta`; linear rope scaling on the global ones)."""

from __future__ import annotations

import torch

from gpu_worker.attention.backend import AttentionBackend
from gpu_worker.models.config import ModelConfig
from gpu_worker.models.gemma import GemmaDefaults, GemmaForCausalLM, GemmaRMSNorm
from gpu_worker.models.llama import Attention
from gpu_worker.ops.layer_ops import LayerOps


class Gemma3Attention(Attention):
    """Llama attention with Gemma's norm over head_dim on q and k (one weight each)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, ops: LayerOps) -> None:
        super().__init__(config, backend, ops)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, ops)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, ops)

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        # One [tokens, q_heads + kv_heads, head_dim] again, so q and k rotate in one call.
        return torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)


class Gemma3ForCausalLM(GemmaForCausalLM):
    """Gemma 3 1B and the text decoder of the larger ones."""

    attention = Gemma3Attention
    # Gemma3TextConfig's: five local layers to one global, no soft-caps.
    config_defaults = GemmaDefaults(
        rope_theta=1_000_000.0,
        rope_local_theta=10000.0,
        sliding_period=6,
        sliding_period_key="sliding_window_pattern",
        logit_softcaps=(None, None),
        num_layers_27b=62,
    )
