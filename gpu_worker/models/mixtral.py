"""Mixtral: Llama's attention with a sparse MoE block (`gpu_worker.models.moe`) in every
layer, routed top-k and always renormalised.

Checkpoints name the block `block_sparse_moe` and its experts' projections w1 (gate), w3 (up)
and w2 (down); they load under the Qwen-style names the shared block uses.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from gpu_worker.models.config import ModelConfig
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.models.moe import moe_or_dense_mlp, stack_expert_weights
from gpu_worker.ops.layer_ops import LayerOps

_EXPERT_PROJ = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_PROJ_NAMES = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def _hf_moe_names(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        name = _EXPERT_PROJ.sub(lambda m: f".experts.{m[1]}.{_PROJ_NAMES[m[2]]}.", name)
        yield name, tensor


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral (HF `MixtralForCausalLM`; GGUF `llama` with `llama.expert_count`)."""

    @classmethod
    def config_from_hf(cls, architecture: str, hf_config: Mapping[str, Any]) -> ModelConfig:
        """Llama's, with the experts as transformers' MixtralConfig reads them."""
        return dataclasses.replace(
            super().config_from_hf(architecture, hf_config),
            num_experts=hf_config.get("num_local_experts", 8),
            num_experts_per_tok=hf_config.get("num_experts_per_tok", 2),
            moe_intermediate_size=hf_config["intermediate_size"],
            norm_topk_prob=True,
        )

    def build_mlp(self, config: ModelConfig, ops: LayerOps, layer: int) -> nn.Module:
        return moe_or_dense_mlp(config, ops, layer)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        stacked = stack_expert_weights(_hf_moe_names(weights), self.config.num_experts)
        super().load_weights(stacked)
