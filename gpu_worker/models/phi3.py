"""Phi-3 and Phi-4 (dense; HF `Phi3ForCausalLM`, GGUF `phi3`): Llama's blocks.

What sets the family apart is all config or checkpoint layout, none of it code here:
- the checkpoint stores Q/K/V and gate/up already fused (`qkv_proj`, `gate_up_proj`) in the
  row order our fused projections use, so they load as they are;
- `partial_rotary_factor` (Phi-4-mini) rotates only the leading `rotary_dim` dims of each
  head, and LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini) rescales the frequencies: both are
  `gpu_worker.models.llama`'s rotary (`rope_inv_freq`, `Attention.rotate`), read from
  `ModelConfig.rotary_dim` / `longrope`;
- Phi-3-mini-4k's sliding window is the generic one (`ModelConfig.sliding_window`).
"""

from __future__ import annotations

from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.ops.linear import StackedParams


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 mini/medium, Phi-3.5-mini, Phi-4, Phi-4-mini."""

    def stacked_params(self) -> StackedParams:
        # Nothing to stack: the checkpoint's fused tensors are our parameters, by name.
        return {}
