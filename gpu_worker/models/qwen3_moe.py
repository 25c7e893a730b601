"""Qwen3-MoE: Qwen3's attention (per-head q/k norms, explicit head_dim) with a sparse MoE
block (`gpu_worker.models.moe`) in the layers the config makes sparse
(`decoder_sparse_step`, `mlp_only_layers`), a dense `MLP` in the others; `norm_topk_prob`
decides whether the top-k routing weights are renormalised."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from gpu_worker.models.config import ModelConfig
from gpu_worker.models.moe import moe_or_dense_mlp, stack_expert_weights
from gpu_worker.models.qwen3 import Qwen3ForCausalLM
from gpu_worker.ops.layer_ops import LayerOps


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3 MoE models (HF `Qwen3MoeForCausalLM`, GGUF `qwen3moe`)."""

    def build_mlp(self, config: ModelConfig, ops: LayerOps, layer: int) -> nn.Module:
        return moe_or_dense_mlp(config, ops, layer)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(stack_expert_weights(weights, self.config.num_experts))
