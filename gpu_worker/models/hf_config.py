"""What every family reads alike from an HF config.json: shapes, rope, tokens, the window.

A family's `config_from_hf` (in its model file) starts from `base_config_from_hf` and
replaces the fields its config reads differently. Defaults are transformers' config classes'.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from gpu_worker.models.config import LongRope, ModelConfig, RopeScaling

HFConfig = Mapping[str, Any]
"""A config.json as `json.loads` gives it."""


def token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """One token id or a list of them (config.json's and GGUF's `eos_token_id`)."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def rope_parameters(hf_config: HFConfig) -> tuple[Mapping[str, Any], Mapping[str, Any] | None]:
    """(global, local) rope parameters: transformers 4's `rope_scaling` or 5's
    `rope_parameters`, which 5 keys by layer type where they differ (Gemma 3); local is
    None otherwise."""
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    if "full_attention" in rope:
        return rope["full_attention"], rope.get("sliding_attention")
    return rope, None


def check_silu_mlp(architecture: str, hf_config: HFConfig) -> None:
    """Refuse a config whose MLP is not the bias-free SwiGLU every Llama-like block runs."""
    if hf_config.get("hidden_act", "silu") != "silu" or hf_config.get("mlp_bias", False):
        raise NotImplementedError(f"{architecture}: only bias-free SiLU MLPs are supported")


def layer_windows(types: Sequence[str], window: int | None) -> tuple[int | None, ...]:
    """Each layer's window from transformers' `layer_types`: `window` where it slides."""
    return tuple(window if t == "sliding_attention" else None for t in types)


def base_config_from_hf(
    architecture: str,
    hf_config: HFConfig,
    *,
    longrope_names: tuple[str, ...] = (),
    default_rope_theta: float = 10000.0,
) -> ModelConfig:
    """The fields every family reads alike. `longrope_names`: the family's other names for
    rope type longrope; `default_rope_theta`: its base when config.json leaves it out. The
    window is Mistral's (every layer); attention bias, if any, is Llama's (q/k/v and o)."""
    cfg = hf_config
    rope = rope_parameters(cfg)[0]
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in longrope_names:
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
    bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        architecture=architecture,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or default_rope_theta),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
        attention_bias=bias,
        attention_out_bias=bias,
        sliding_window=cfg.get("sliding_window"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=token_ids(cfg.get("eos_token_id")),
        rotary_dim=rotary_dim if rotary_dim != head_dim else None,
        longrope=longrope,
        rope_linear_factor=linear_factor,
    )


def _longrope_from_hf(cfg: HFConfig, rope: Mapping[str, Any]) -> LongRope:
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
