"""Qwen3 (dense): Llama's blocks with q and k RMS-normed per head before rotary.

Everything else is `gpu_worker.models.llama`: no QKV bias (unless the config asks for it, as
HF's does), an explicit `head_dim` that may differ from hidden / heads, tied or untied
embeddings; Qwen2's sliding layers (`qwen_windows`). The norms' weights load under HF's
names (`self_attn.q_norm.weight`); the GGUF loader maps llama.cpp's `attn_q_norm` /
`attn_k_norm` onto them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gpu_worker.attention.backend import AttentionBackend
from gpu_worker.models.config import ModelConfig
from gpu_worker.models.llama import Attention, LlamaForCausalLM, RMSNorm, qwen_windows
from gpu_worker.ops.layer_ops import LayerOps


class Qwen3Attention(Attention):
    """Llama attention with per-head q/k RMSNorm over head_dim (one weight for all heads)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, ops: LayerOps) -> None:
        super().__init__(config, backend, ops)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops)

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        # One contiguous [tokens, q_heads + kv_heads, head_dim] again, so q and k still
        # rotate in one call.
        return torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense models (HF `Qwen3ForCausalLM`, GGUF `qwen3`)."""

    attention = Qwen3Attention

    @classmethod
    def config_from_hf(cls, architecture: str, hf_config: Mapping[str, Any]) -> ModelConfig:
        return qwen_windows(super().config_from_hf(architecture, hf_config), hf_config)
