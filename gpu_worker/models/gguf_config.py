"""What every family reads alike from a GGUF file's `{arch}.*` metadata and tensor table.

A family's `config_from_gguf` (in its model file) starts from `base_config_from_gguf` and
replaces the fields llama.cpp writes differently for it. Defaults are llama.cpp's.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np

from gpu_worker.models.config import LongRope, ModelConfig
from gpu_worker.models.hf_config import token_ids
from shared.gguf_metadata import GGUFMetadata


def required_integer(metadata: GGUFMetadata, key: str) -> int:
    """An integer key the config cannot do without."""
    value = metadata.integer(key)
    if value is None:
        raise ValueError(f"{metadata.path.name}: GGUF metadata lacks {key}")
    return value


def tensor_values(metadata: GGUFMetadata, name: str) -> list[float]:
    """A (small) tensor's values, read from the file at its offset in the header."""
    info = metadata.tensors[name]
    qtype = gguf.GGMLQuantizationType(info.ggml_type)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    num_bytes = int(np.prod(info.shape)) // block_size * type_size
    raw = np.fromfile(metadata.path, dtype=np.uint8, count=num_bytes, offset=info.offset)
    return gguf.quants.dequantize(raw, qtype).ravel().tolist()


def base_config_from_gguf(architecture: str, metadata: GGUFMetadata) -> ModelConfig:
    """The fields every family reads alike, experts included (llama.cpp's `expert_*` keys
    are the same for every arch); no sliding window, no attention bias."""
    arch, meta = architecture, metadata

    def integer(key: str) -> int:
        return required_integer(meta, f"{arch}.{key}")

    hidden = integer("embedding_length")
    num_heads = integer("attention.head_count")
    vocab = meta.integer(f"{arch}.vocab_size")
    if vocab is None:  # older files: the embedding matrix says it (gguf shapes are reversed)
        vocab = meta.tensors["token_embd.weight"].shape[-1]
    freq_factors = None
    if "rope_freqs.weight" in meta.tensors:
        freq_factors = tuple(tensor_values(meta, "rope_freqs.weight"))
    head_dim = meta.integer(f"{arch}.attention.key_length", hidden // num_heads)
    rotary_dim = meta.integer(f"{arch}.rope.dimension_count", head_dim)
    longrope = None
    if "rope_factors_long.weight" in meta.tensors:  # Phi-3's LongRoPE, as llama.cpp stores it
        longrope = LongRope(
            short_factor=tuple(tensor_values(meta, "rope_factors_short.weight")),
            long_factor=tuple(tensor_values(meta, "rope_factors_long.weight")),
            original_max_position_embeddings=integer("rope.scaling.original_context_length"),
            attention_factor=meta.number(f"{arch}.rope.scaling.attn_factor", 1.0),
        )
    num_layers = integer("block_count")
    num_experts = meta.integer(f"{arch}.expert_count", 0)
    num_experts_per_tok = integer("expert_used_count") if num_experts else 0
    config = ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=integer("feed_forward_length"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=meta.integer(f"{arch}.attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=meta.number(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=meta.number(f"{arch}.rope.freq_base", 10000.0),
        max_position_embeddings=meta.integer(f"{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in meta.tensors,
        rope_freq_factors=freq_factors,
        bos_token_id=meta.integer("tokenizer.ggml.bos_token_id"),
        eos_token_ids=token_ids(meta.get("tokenizer.ggml.eos_token_id")),
        rotary_dim=rotary_dim if rotary_dim != head_dim else None,
        longrope=longrope,
    )
    if not num_experts:
        return config
    return _with_experts(config, meta, num_experts, num_experts_per_tok)


def _with_experts(
    config: ModelConfig, meta: GGUFMetadata, num_experts: int, num_experts_per_tok: int
) -> ModelConfig:
    """The other expert fields from llama.cpp's `{arch}.expert_*` keys. llama.cpp
    renormalises the top-k weights of Mixtral and Qwen3-MoE unless the file says otherwise;
    a layer without a router tensor is dense."""
    arch, num_layers = config.architecture, config.num_layers
    inner = meta.integer(f"{arch}.expert_feed_forward_length")
    norm = meta.get(f"{arch}.expert_weights_norm")
    routed = {i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in meta.tensors}
    return dataclasses.replace(
        config,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_size=inner or config.intermediate_size,
        norm_topk_prob=True if norm is None else bool(norm),
        dense_layers=tuple(i for i in range(num_layers) if i not in routed),
    )
