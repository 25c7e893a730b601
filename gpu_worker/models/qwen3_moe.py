"""Qwen3-MoE: Qwen3's attention (per-head q/k norms, explicit head_dim) with a sparse MoE
block (`gpu_worker.models.moe`) in the layers the config makes sparse
(`decoder_sparse_step`, `mlp_only_layers`), a dense `MLP` in the others; `norm_topk_prob`
decides whether the top-k routing weights are renormalised."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from gpu_worker.models.config import ModelConfig
from gpu_worker.models.moe import moe_or_dense_mlp, stack_expert_weights
from gpu_worker.models.qwen3 import Qwen3ForCausalLM
from gpu_worker.ops.layer_ops import LayerOps


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3 MoE models (HF `Qwen3MoeForCausalLM`, GGUF `qwen3moe`)."""

    @classmethod
    def config_from_hf(cls, architecture: str, hf_config: Mapping[str, Any]) -> ModelConfig:
        """Qwen3's, sliding every layer when it slides at all, with the experts as
        transformers' Qwen3MoeConfig reads them."""
        config = super().config_from_hf(architecture, hf_config)
        step = hf_config.get("decoder_sparse_step", 1)
        only = set(hf_config.get("mlp_only_layers") or ())
        # transformers 5 saves `num_experts` under its attribute-map name.
        num_experts = hf_config.get("num_experts") or hf_config.get("num_local_experts") or 128
        dense = [i for i in range(config.num_layers) if i in only or (i + 1) % step]
        return dataclasses.replace(
            config,
            layer_windows=None,
            num_experts=num_experts,
            num_experts_per_tok=hf_config.get("num_experts_per_tok", 8),
            moe_intermediate_size=hf_config.get("moe_intermediate_size", 768),
            norm_topk_prob=bool(hf_config.get("norm_topk_prob", False)),
            dense_layers=tuple(dense),
        )

    def build_mlp(self, config: ModelConfig, ops: LayerOps, layer: int) -> nn.Module:
        return moe_or_dense_mlp(config, ops, layer)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(stack_expert_weights(weights, self.config.num_experts))
