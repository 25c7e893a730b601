"""Load a model's config and weights from an HF safetensors directory or a GGUF file.

Both sources are turned into one `ModelConfig` and a stream of HF-named tensors, which the
model copies into its (fused) parameters. GGUF tensors are dequantized to fp32 with the
`gguf` package, and llama.cpp's Q/K row permutation is undone so that every model uses HF's
rotate_half rotary convention. A tensor-parallel rank reads both lazily, only its part of each
tensor (`gguf_tensors` for GGUF).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import gguf
import numpy as np
import torch
from gguf.gguf_reader import ReaderTensor
from safetensors import safe_open

from gpu_worker.attention.backend import AttentionBackend
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from gpu_worker.distributed.group import TPGroup
from gpu_worker.distributed.parallelize import parallelize
from gpu_worker.gguf_tensors import GGUFTensorSource
from gpu_worker.models import CausalLM, get_model_class
from gpu_worker.models.config import LongRope, ModelConfig, RopeScaling
from gpu_worker.models.weights import TensorSource
from gpu_worker.ops.gguf_linear import (
    QuantizedWeight,
    gguf_quantized_weights,
    quantized_kernels_available,
)
from gpu_worker.ops.layer_ops import LayerOps
from shared.gguf_metadata import GGUFMetadata, read_gguf_metadata
from shared.model_source import ModelSource

_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}

_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def _ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a config.json dict (transformers 4.x `rope_scaling` or 5.x
    `rope_parameters`)."""
    arch = (cfg.get("architectures") or [_MODEL_TYPE_TO_ARCH.get(cfg.get("model_type", ""), "")])[0]
    is_gemma = arch in _GEMMA
    _check_mlp(arch, cfg, is_gemma)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    local_rope = None
    if "full_attention" in rope:  # transformers 5's Gemma 3: rope parameters per layer type
        rope, local_rope = rope["full_attention"], rope.get("sliding_attention")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    is_phi3 = arch == "Phi3ForCausalLM"
    if is_phi3 and rope_type in ("su", "yarn"):  # Phi3Config's old names for longrope
        rope_type = "longrope"
    num_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * partial)
    longrope = None
    scaling = None
    linear_factor = None
    if rope_type == "llama3":
        scaling = RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    elif rope_type == "longrope":
        longrope = _longrope_from_hf(cfg, rope)
    elif rope_type == "linear":
        linear_factor = float(rope["factor"])
    elif rope_type != "default":
        raise NotImplementedError(f"rope type {rope_type!r} is not supported")
    # Gemma3TextConfig's global base when config.json leaves it out.
    default_theta = 1_000_000.0 if arch == "Gemma3ForCausalLM" else 10000.0
    is_qwen2 = arch == "Qwen2ForCausalLM"
    llama_bias = bool(cfg.get("attention_bias", False)) and not is_qwen2
    window = cfg.get("sliding_window")
    is_qwen = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
    if is_qwen and not cfg.get("use_sliding_window"):
        window = None
    if arch == "Qwen3MoeForCausalLM" and not cfg.get("use_sliding_window"):
        window = None  # Qwen3-MoE slides every layer when it slides at all
    layer_windows = _qwen_layer_windows(cfg, window) if is_qwen else None
    gemma = _gemma_from_hf(arch, cfg, local_rope) if is_gemma else {}
    if is_gemma:
        window, layer_windows = gemma.pop("sliding_window"), gemma.pop("layer_windows")
    return ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or default_theta),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
        attention_bias=is_qwen2 or llama_bias,
        attention_out_bias=llama_bias,
        sliding_window=window,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_ids(cfg.get("eos_token_id")),
        layer_windows=layer_windows,
        rotary_dim=rotary_dim if rotary_dim != head_dim else None,
        longrope=longrope,
        rope_linear_factor=linear_factor,
        **_moe_from_hf(arch, cfg),
        **gemma,
    )


def _check_mlp(arch: str, cfg: dict[str, Any], is_gemma: bool) -> None:
    """Gemma's MLPs are GeGLU (`hidden_activation`), the others' bias-free SwiGLU."""
    if is_gemma:
        if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise NotImplementedError(f"{arch}: only tanh-approximated GeGLU is supported")
    elif cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias", False):
        raise NotImplementedError(f"{arch}: only bias-free SiLU MLPs are supported")


def _gemma_from_hf(
    arch: str, cfg: dict[str, Any], local_rope: dict[str, Any] | None
) -> dict[str, Any]:
    """Gemma 2/3's fields, with their configs' defaults: which layers slide (`layer_types`,
    else Gemma 2's odd/even rule or Gemma 3's `sliding_window_pattern`, the last layer of
    each period global), the local layers' rope base, the attention scale and the caps."""
    is_gemma2 = arch == "Gemma2ForCausalLM"
    num_layers = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window", 4096)
    period = 2 if is_gemma2 else cfg.get("sliding_window_pattern", 6)
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % period else "full_attention" for i in range(num_layers)
    ]
    local_theta = (local_rope or {}).get("rope_theta") or cfg.get("rope_local_base_freq")
    if local_theta is None and not is_gemma2:
        local_theta = 10000.0  # Gemma3TextConfig's default local base
    softcaps = (50.0, 30.0) if is_gemma2 else (None, None)  # the config classes' defaults
    return {
        "sliding_window": window,
        "layer_windows": tuple(window if t == "sliding_attention" else None for t in types),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
        "attn_logit_softcapping": cfg.get("attn_logit_softcapping", softcaps[0]),
        "final_logit_softcapping": cfg.get("final_logit_softcapping", softcaps[1]),
        "rope_local_theta": None if local_theta is None else float(local_theta),
    }


def _moe_from_hf(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's expert fields, as transformers' Mixtral and Qwen3-MoE configs read them."""
    if arch == "MixtralForCausalLM":
        return {
            "num_experts": cfg.get("num_local_experts", 8),
            "num_experts_per_tok": cfg.get("num_experts_per_tok", 2),
            "moe_intermediate_size": cfg["intermediate_size"],
            "norm_topk_prob": True,
        }
    if arch == "Qwen3MoeForCausalLM":
        num_layers, step = cfg["num_hidden_layers"], cfg.get("decoder_sparse_step", 1)
        only = set(cfg.get("mlp_only_layers") or ())
        # transformers 5 saves `num_experts` under its attribute-map name.
        num_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 128
        dense = [i for i in range(num_layers) if i in only or (i + 1) % step]
        return {
            "num_experts": num_experts,
            "num_experts_per_tok": cfg.get("num_experts_per_tok", 8),
            "moe_intermediate_size": cfg.get("moe_intermediate_size", 768),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "dense_layers": tuple(dense),
        }
    return {}


def _longrope_from_hf(cfg: dict[str, Any], rope: dict[str, Any]) -> LongRope:
    """transformers' `_compute_longrope_parameters`: Phi-3 keeps the original context at
    the top level (it wins over the rope dict's); without an explicit `factor` the
    attention factor follows from max / original context."""
    original = int(
        cfg.get("original_max_position_embeddings")
        or rope.get("original_max_position_embeddings")
        or cfg["max_position_embeddings"]
    )
    factor = rope.get("factor")
    if factor is None:
        factor = cfg["max_position_embeddings"] / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0
        if factor > 1.0:
            attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
    return LongRope(
        short_factor=tuple(float(f) for f in rope["short_factor"]),
        long_factor=tuple(float(f) for f in rope["long_factor"]),
        original_max_position_embeddings=original,
        attention_factor=float(attention_factor),
    )


def _qwen_layer_windows(cfg: dict[str, Any], window: int | None) -> tuple[int | None, ...] | None:
    """Which Qwen layers slide, as transformers decides: config.json's `layer_types`, else
    every layer from `max_window_layers` on (the first ones attend globally)."""
    if window is None:
        return None
    num_layers = cfg["num_hidden_layers"]
    first = cfg.get("max_window_layers", 28)
    default = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    types = cfg.get("layer_types") or default
    return tuple(window if t == "sliding_attention" else None for t in types)


def _safetensors_files(model_dir: Path) -> list[str]:
    """`model.safetensors`, or every shard `model.safetensors.index.json` names."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["model.safetensors"]


def iter_hf_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint's safetensors files."""
    for file in _safetensors_files(model_dir):
        with safe_open(str(model_dir / file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_tensor(name)


def iter_hf_slices(model_dir: Path) -> Iterator[tuple[str, TensorSource]]:
    """`iter_hf_weights`, each tensor lazy: indexing it reads only the rows or columns it
    names from the file, so a tensor-parallel rank never holds a whole tensor."""
    for file in _safetensors_files(model_dir):
        with safe_open(str(model_dir / file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_slice(name)


def _gguf_tensor_values(meta: GGUFMetadata, name: str) -> list[float]:
    """A (small) tensor's values, read from the file at its offset in the header."""
    info = meta.tensors[name]
    qtype = gguf.GGMLQuantizationType(info.ggml_type)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    num_bytes = int(np.prod(info.shape)) // block_size * type_size
    raw = np.fromfile(meta.path, dtype=np.uint8, count=num_bytes, offset=info.offset)
    return gguf.quants.dequantize(raw, qtype).ravel().tolist()


def _required(value: int | None, meta: GGUFMetadata, key: str) -> int:
    if value is None:
        raise ValueError(f"{meta.path.name}: GGUF metadata lacks {key}")
    return value


def config_from_gguf(meta: GGUFMetadata) -> ModelConfig:
    """ModelConfig from a GGUF file's `{arch}.*` metadata and its tensor table."""
    arch = meta.string("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3", "phi3", "qwen3moe", "gemma2", "gemma3"):
        raise NotImplementedError(f"GGUF architecture {arch!r} is not supported")

    def integer(key: str) -> int:
        return _required(meta.integer(f"{arch}.{key}"), meta, f"{arch}.{key}")

    hidden = integer("embedding_length")
    num_heads = integer("attention.head_count")
    vocab = meta.integer(f"{arch}.vocab_size")
    if vocab is None:  # older files: the embedding matrix says it (gguf shapes are reversed)
        vocab = meta.tensors["token_embd.weight"].shape[-1]
    freq_factors = None
    if "rope_freqs.weight" in meta.tensors:
        freq_factors = tuple(_gguf_tensor_values(meta, "rope_freqs.weight"))
    head_dim = meta.integer(f"{arch}.attention.key_length", hidden // num_heads)
    rotary_dim = meta.integer(f"{arch}.rope.dimension_count", head_dim)
    # Phi-3's window; llama.cpp writes 0 for Phi-4, which has none.
    window = meta.integer(f"{arch}.attention.sliding_window") if arch == "phi3" else None
    longrope = None
    if "rope_factors_long.weight" in meta.tensors:  # Phi-3's LongRoPE, as llama.cpp stores it
        longrope = LongRope(
            short_factor=tuple(_gguf_tensor_values(meta, "rope_factors_short.weight")),
            long_factor=tuple(_gguf_tensor_values(meta, "rope_factors_long.weight")),
            original_max_position_embeddings=integer("rope.scaling.original_context_length"),
            attention_factor=meta.number(f"{arch}.rope.scaling.attn_factor", 1.0),
        )
    moe = _moe_from_gguf(meta, arch, integer("block_count"))
    gemma = _gemma_from_gguf(meta, arch, head_dim) if arch in ("gemma2", "gemma3") else {}
    if gemma:
        window = gemma.pop("sliding_window")
    return ModelConfig(
        # llama.cpp writes Mixtral as llama with experts; the registry knows it as mixtral.
        architecture="mixtral" if arch == "llama" and moe else arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=integer("feed_forward_length"),
        num_layers=integer("block_count"),
        num_heads=num_heads,
        num_kv_heads=meta.integer(f"{arch}.attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=meta.number(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=meta.number(f"{arch}.rope.freq_base", 10000.0),
        max_position_embeddings=meta.integer(f"{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in meta.tensors,
        rope_freq_factors=freq_factors,
        attention_bias=arch == "qwen2",
        bos_token_id=meta.integer("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_ids(meta.get("tokenizer.ggml.eos_token_id")),
        sliding_window=window or None,
        rotary_dim=rotary_dim if rotary_dim != head_dim else None,
        longrope=longrope,
        **moe,
        **gemma,
    )


# llama.cpp's attention scale for the 27B models (by layer count), whose
# query_pre_attn_scalar is hidden / heads rather than head_dim; GGUF has no key for it.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_from_gguf(meta: GGUFMetadata, arch: str, head_dim: int) -> dict[str, Any]:
    """Gemma 2/3's fields as llama.cpp reads them: sliding layers from
    `attention.sliding_window_pattern` (a period, or a flag per layer) else its fixed
    period (2 for Gemma 2, 6 for Gemma 3; the last layer of each global), Gemma 3's local
    rope base fixed at 10000 and its linear scaling (global layers), the caps."""
    num_layers = _required(meta.integer(f"{arch}.block_count"), meta, f"{arch}.block_count")
    window = meta.integer(f"{arch}.attention.sliding_window")
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        period = int(pattern or (2 if arch == "gemma2" else 6))
        sliding = [(i + 1) % period != 0 for i in range(num_layers)]
    scalar = float(head_dim)
    if num_layers == _GEMMA_27B_LAYERS[arch]:
        hidden = meta.integer(f"{arch}.embedding_length", 0)
        scalar = float(hidden // meta.integer(f"{arch}.attention.head_count", 1))
    linear = None
    if meta.string(f"{arch}.rope.scaling.type") == "linear":
        linear = meta.number(f"{arch}.rope.scaling.factor")
    return {
        "sliding_window": window,
        "layer_windows": tuple(window if s else None for s in sliding),
        "query_pre_attn_scalar": scalar,
        "attn_logit_softcapping": meta.number(f"{arch}.attn_logit_softcapping"),
        "final_logit_softcapping": meta.number(f"{arch}.final_logit_softcapping"),
        "rope_local_theta": 10000.0 if arch == "gemma3" else None,
        "rope_linear_factor": linear,
    }


def _moe_from_gguf(meta: GGUFMetadata, arch: str, num_layers: int) -> dict[str, Any]:
    """ModelConfig's expert fields from llama.cpp's `{arch}.expert_*` keys. llama.cpp
    renormalises the top-k weights of Mixtral and Qwen3-MoE unless the file says otherwise;
    a layer without a router tensor is dense."""
    num_experts = meta.integer(f"{arch}.expert_count", 0)
    if not num_experts:
        return {}
    inner = meta.integer(f"{arch}.expert_feed_forward_length")
    norm = meta.get(f"{arch}.expert_weights_norm")
    routed = {i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in meta.tensors}
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": _required(
            meta.integer(f"{arch}.expert_used_count"), meta, f"{arch}.expert_used_count"
        ),
        "moe_intermediate_size": inner or meta.integer(f"{arch}.feed_forward_length"),
        "norm_topk_prob": True if norm is None else bool(norm),
        "dense_layers": tuple(i for i in range(num_layers) if i not in routed),
    }


_GGUF_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_LAYER = {
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

# llama.cpp permutes q/k rows only for its llama arch (Mixtral included).
_PERMUTED_QK = ("llama", "mixtral")


# Where an architecture's tensor holds something else under the same GGUF name.
_GGUF_GEMMA_LAYER = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GGUF_LAYER_OF_ARCH = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # gate and up, fused as in HF's checkpoint
    "gemma2": _GGUF_GEMMA_LAYER,
    "gemma3": _GGUF_GEMMA_LAYER,
}

# llama.cpp's converter stores Gemma's norm weights with the 1 of (1 + weight) added.
_NORM_PLUS_ONE = ("gemma2", "gemma3")


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unused."""
    parts = name.split(".")
    layer_names = _GGUF_LAYER_OF_ARCH.get(arch, {})
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_LAYER.keys() | layer_names:
        hf = layer_names.get(parts[2]) or _GGUF_LAYER[parts[2]]
        return f"model.layers.{parts[1]}.{hf}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[parts[0]]}.{parts[1]}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's converter `permute`, which is
    `w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)`:
    it interleaves each head's two rotary halves into (even, odd) pairs. Reading the rows back
    as (n_head, half, 2) and swapping the last two row axes restores (2, half) = HF's order."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor: ReaderTensor, name: str, config: ModelConfig) -> torch.Tensor:
    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # gguf lists dimensions innermost first; numpy/torch want them outermost first.
    array = array.reshape(tuple(int(d) for d in reversed(tensor.shape)))
    if config.architecture in _PERMUTED_QK:
        if ".q_proj." in name:
            array = unpermute_qk(array, config.num_heads)
        elif ".k_proj." in name:
            array = unpermute_qk(array, config.num_kv_heads)
    if _is_stored_plus_one(name, config):
        array = array - 1.0  # a new array
    if not array.flags.writeable:  # F32 tensors come back as views of the read-only mmap
        array = array.copy()
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


def _is_stored_plus_one(name: str, config: ModelConfig) -> bool:
    return config.architecture in _NORM_PLUS_ONE and name.endswith("norm.weight")


def _qk_row_order(name: str, rows: int, config: ModelConfig) -> np.ndarray | None:
    """`unpermute_qk` as row indices (for weights kept in their GGUF blocks); None for
    tensors it leaves alone."""
    if config.architecture not in _PERMUTED_QK:
        return None
    if ".q_proj." in name:
        return unpermute_qk(np.arange(rows), config.num_heads)
    if ".k_proj." in name:
        return unpermute_qk(np.arange(rows), config.num_kv_heads)
    return None


def gguf_block_weights(reader: gguf.GGUFReader, config: ModelConfig) -> dict[str, QuantizedWeight]:
    """HF name -> `QuantizedWeight` for each matrix in a type the CPU kernel reads
    (`gguf_linear.SUPPORTED_TYPES`: Q4_0 .. Q8_0, Q4_K, Q5_K, Q6_K), Q/K rows in HF order."""
    arch = config.architecture
    named = [(n, t) for t in reader.tensors if (n := gguf_to_hf_name(t.name, arch)) is not None]
    orders = {}
    for name, tensor in named:
        order = _qk_row_order(name, int(tensor.shape[-1]), config)
        if order is not None:
            orders[name] = order
    return gguf_quantized_weights(named, orders)


def iter_gguf_weights(
    reader: gguf.GGUFReader, config: ModelConfig, num_threads: int | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantized fp32 tensors under HF names, with Q/K rows back in HF's rotary order.

    numpy releases the GIL, so a few tensors are dequantized ahead on worker threads; the
    window is bounded so that at most `num_threads` fp32 tensors wait in memory at once."""
    # Unmapped tensors (rope_freqs, rope_factors_*) are already folded into the config.
    arch = config.architecture
    named = [(t, n) for t in reader.tensors if (n := gguf_to_hf_name(t.name, arch)) is not None]
    window = num_threads or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(window) as pool:
        pending: deque[tuple[str, Future[torch.Tensor]]] = deque()
        for tensor, name in named:
            pending.append((name, pool.submit(_dequantize, tensor, name, config)))
            if len(pending) >= window:
                done_name, future = pending.popleft()
                yield done_name, future.result()
        while pending:
            done_name, future = pending.popleft()
            yield done_name, future.result()


def iter_gguf_slices(
    reader: gguf.GGUFReader, config: ModelConfig
) -> Iterator[tuple[str, TensorSource]]:
    """`iter_gguf_weights`, each tensor lazy: indexing it dequantizes only the rows (and the
    blocks of columns) it names, Q/K rows read through their HF order, so a
    tensor-parallel rank never dequantizes a whole tensor."""
    arch = config.architecture
    for tensor in reader.tensors:
        name = gguf_to_hf_name(tensor.name, arch)
        if name is None:
            continue
        order = _qk_row_order(name, int(tensor.shape[-1]), config)
        offset = 1.0 if _is_stored_plus_one(name, config) else 0.0
        yield name, GGUFTensorSource(tensor, order, offset)


def load_config(source: ModelSource) -> ModelConfig:
    """The config alone (cheap for HF; a GGUF file's header must still be parsed)."""
    if source.kind == "gguf":
        return config_from_gguf(read_gguf_metadata(source.path))
    return config_from_hf(json.loads((source.path / "config.json").read_text()))


def load_model(
    source: ModelSource,
    device: torch.device,
    dtype: torch.dtype | None = None,
    attn_backend: AttentionBackend | None = None,
    *,
    layer_ops: LayerOps | None = None,
    gguf_kernels: bool = True,
    max_model_len: int | None = None,
    tp_group: TPGroup | None = None,
) -> tuple[CausalLM, ModelConfig]:
    """Build the model on `device` in `dtype` (default bf16 on CUDA, fp32 elsewhere) and fill
    it with the source's weights. Attention and layer ops default to plain torch. `gguf_kernels`
    lets an fp32 CPU model read a GGUF file's quantized blocks in decode-sized matmuls.
    `max_model_len`, the context the engine serves, replaces the model's own: the rotary
    tables cover it, and LongRoPE takes its short factors when it fits the original context.

    With a `tp_group` the model is that rank's shard (`gpu_worker.distributed.parallelize`):
    the rank reads only its rows and columns of each tensor, from safetensors or GGUF (a
    GGUF tensor's blocks covering them, dequantized; its Q/K rows found through llama.cpp's
    order). The shard runs on dense weights in `dtype`, not on the file's quantized blocks
    (`gguf_kernels` is for one rank alone). The returned config is the full model's."""
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sharded = tp_group is not None and tp_group.world_size > 1
    weights: Iterator[tuple[str, TensorSource]]
    if source.kind == "gguf":
        config = config_from_gguf(read_gguf_metadata(source.path))
        reader = gguf.GGUFReader(source.path)  # for the tensors alone
        read = iter_gguf_slices if sharded else iter_gguf_weights
        weights = read(reader, config)
    else:
        config = config_from_hf(json.loads((source.path / "config.json").read_text()))
        weights = iter_hf_slices(source.path) if sharded else iter_hf_weights(source.path)
    if max_model_len is not None:
        config = dataclasses.replace(config, max_position_embeddings=max_model_len)
    model_cls = get_model_class(config.architecture)
    # Build on the meta device: no random init of weights that are overwritten at once.
    with torch.device("meta"):
        model = model_cls(config, attn_backend or TorchAttentionBackend(), layer_ops)
        if tp_group is not None and sharded:
            parallelize(model, tp_group)
    model = model.to(dtype).to_empty(device=device)
    # A rank's shard takes lazy tensors: its shard hook (`load_stacked_weights`) reads them.
    model.load_weights(cast(Iterator[tuple[str, torch.Tensor]], weights))
    model.build_caches(device)
    quantized = gguf_kernels and not sharded
    if source.kind == "gguf" and quantized and quantized_kernels_available(device, dtype):
        # fp32 on CPU: decode reads the file's 4-8 bit blocks instead (gpu_worker.ops.gguf_linear).
        model.attach_quantized(gguf_block_weights(reader, config))
    model.eval().requires_grad_(False)
    return model, config
