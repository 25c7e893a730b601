"""How llama.cpp names and stores a family's tensors in a GGUF file, against HF's checkpoint.

Most names are llama.cpp's for every arch; a family's `gguf_layout` (in its model file) names
the tensors it stores under another meaning, and says whether llama.cpp permuted its Q/K
rows or added one to its norm weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    # MoE (Mixtral, Qwen3-MoE): the router, and each projection of all experts at once.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}


@dataclass(frozen=True)
class GGUFLayout:
    """One family's GGUF tensors, as llama.cpp's converter wrote them."""

    layer_names: Mapping[str, str] = field(default_factory=dict)
    """GGUF layer tensor -> HF module, where the family's differs from llama.cpp's usual
    meaning (or is its own)."""
    permuted_qk: bool = False
    """Whether Q/K rows are in llama.cpp's interleaved rotary order (its llama arch alone)."""
    norm_plus_one: bool = False
    """Whether norm weights are stored as 1 + weight (Gemma's, whose norms scale by it)."""

    def hf_name(self, gguf_name: str) -> str | None:
        """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unused."""
        parts = gguf_name.split(".")
        if parts[0] == "blk" and len(parts) == 4:
            module = self.layer_names.get(parts[2]) or _LAYER_NAMES.get(parts[2])
            if module is not None:
                return f"model.layers.{parts[1]}.{module}.{parts[3]}"
        if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
        return None

    def is_stored_plus_one(self, hf_name: str) -> bool:
        """Whether the tensor under `hf_name` holds 1 + the model's weight."""
        return self.norm_plus_one and hf_name.endswith("norm.weight")
