"""Phi-3 and Phi-4 (dense; HF `Phi3ForCausalLM`, GGUF `phi3`): Llama's blocks.

What sets the family apart is all config or checkpoint layout, none of it model code here:
- the checkpoint stores Q/K/V and gate/up already fused (`qkv_proj`, `gate_up_proj`) in the
  row order our fused projections use, so they load as they are;
- `partial_rotary_factor` (Phi-4-mini) rotates only the leading `rotary_dim` dims of each
  head, and LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini) rescales the frequencies: both are
  `gpu_worker.models.llama`'s rotary (`rope_inv_freq`, `Attention.rotate`), read from
  `ModelConfig.rotary_dim` / `longrope`;
- Phi-3-mini-4k's sliding window is the generic one (`ModelConfig.sliding_window`);
- Phi3Config's old names for rope type longrope (`su`, `yarn`), and llama.cpp's `ffn_up`,
  which holds gate and up fused as HF's checkpoint does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from gpu_worker.models.config import ModelConfig
from gpu_worker.models.gguf_config import base_config_from_gguf
from gpu_worker.models.gguf_layout import GGUFLayout
from gpu_worker.models.hf_config import base_config_from_hf, check_silu_mlp
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.ops.linear import StackedParams
from shared.gguf_metadata import GGUFMetadata


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 mini/medium, Phi-3.5-mini, Phi-4, Phi-4-mini."""

    @classmethod
    def config_from_hf(cls, architecture: str, hf_config: Mapping[str, Any]) -> ModelConfig:
        check_silu_mlp(architecture, hf_config)
        return base_config_from_hf(architecture, hf_config, longrope_names=("su", "yarn"))

    @classmethod
    def config_from_gguf(cls, architecture: str, metadata: GGUFMetadata) -> ModelConfig:
        # Phi-3's window; llama.cpp writes 0 for Phi-4, which has none.
        window = metadata.integer(f"{architecture}.attention.sliding_window")
        config = base_config_from_gguf(architecture, metadata)
        return dataclasses.replace(config, sliding_window=window or None)

    @classmethod
    def gguf_layout(cls, architecture: str) -> GGUFLayout:
        return GGUFLayout(layer_names={"ffn_up": "mlp.gate_up_proj"})

    def stacked_params(self) -> StackedParams:
        # Nothing to stack: the checkpoint's fused tensors are our parameters, by name.
        return {}
