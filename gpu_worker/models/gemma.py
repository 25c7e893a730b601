"""What Gemma 2 and Gemma 3 share, on Llama's blocks (`gpu_worker.models.llama`).

- RMSNorm scales by (1 + weight), in fp32 (checkpoints store the offset from one);
- four norms per layer: around attention (input, post-attention) and around the MLP
  (pre- and post-feed-forward), the residual added after the post norms;
- GeGLU with tanh-approximated GELU;
- embeddings scaled by sqrt(hidden), the factor rounded to the model dtype first;
- final logits optionally soft-capped (`final_logit_softcapping`).

The attention scale (`query_pre_attn_scalar`) and score soft-capping are Llama attention's,
read from `ModelConfig`. Gemma 3's local layers rotate with their own base
(`rope_local_theta`), which is why the forward picks rotary tables per layer. Both
generations read their configs here, each with its own `GemmaDefaults`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.attention.backend import AttentionBackend
from gpu_worker.attention.metadata import AttentionMetadata
from gpu_worker.models.config import ModelConfig
from gpu_worker.models.gguf_config import base_config_from_gguf, required_integer
from gpu_worker.models.gguf_layout import GGUFLayout
from gpu_worker.models.hf_config import base_config_from_hf, layer_windows, rope_parameters
from gpu_worker.models.llama import (
    MLP,
    Attention,
    DecoderLayer,
    LlamaForCausalLM,
    RMSNorm,
    RotaryEmbedding,
)
from gpu_worker.ops.layer_ops import LayerOps, RotaryTables
from shared.gguf_metadata import GGUFMetadata

# Where llama.cpp's Gemma tensor holds something else under the usual GGUF name.
_GGUF_LAYER_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


@dataclass(frozen=True)
class GemmaDefaults:
    """What a Gemma generation's config may leave out, as its transformers config class
    (config.json) or llama.cpp (GGUF) fills it in."""

    rope_theta: float
    """The global layers' rotary base (config.json)."""
    rope_local_theta: float | None
    """The local layers' rotary base (GGUF: always this); None: the global one."""
    sliding_period: int
    """The last layer of each period attends globally, the others slide."""
    sliding_period_key: str | None
    """The config.json key that sets the period, where the generation has one."""
    logit_softcaps: tuple[float | None, float | None]
    """(attention, final) soft-caps when config.json leaves them out."""
    num_layers_27b: int
    """The 27B model's layer count: llama.cpp scales its attention by hidden / heads rather
    than head_dim, and GGUF has no key for it."""


class GemmaRMSNorm(RMSNorm):
    """transformers' Gemma2RMSNorm: `x * rsqrt(mean(x^2) + eps) * (1 + weight)` in fp32,
    rounded once at the end. In fp32 that is the layer ops' norm with weight 1 + w (kept in
    `scale`, built with the model's caches); other dtypes compute it here in torch, since
    the ops' kernels would round 1 + w to the model dtype first."""

    def __init__(self, dim: int, eps: float, ops: LayerOps | None = None) -> None:
        super().__init__(dim, eps, ops)
        self.scale: torch.Tensor
        self.register_buffer("scale", torch.empty(0), persistent=False)

    def build(self) -> None:
        """1 + weight in fp32; call after loading or changing the weight."""
        self.scale = 1.0 + self.weight.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return self.ops.rms_norm(x, self.scale, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.scale).to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype == torch.float32:
            return self.ops.add_rms_norm(x, residual, self.scale, self.eps)
        residual = residual + x
        return self.forward(residual), residual


class GemmaMLP(MLP):
    """GeGLU: `down(gelu_tanh(gate) * up)`. Plain torch on every backend (the layer ops
    have SiLU-and-mul only): two elementwise ops more than a fused kernel would take."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(DecoderLayer):
    """Norms before and after attention and MLP both; the residual stream is carried
    between layers as in Llama's, its adds fused into the pre-norms."""

    norm_class = GemmaRMSNorm

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        ops: LayerOps,
        attention: type[Attention] = Attention,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__(config, backend, ops, attention, mlp)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, ops)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, ops)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryTables,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, rotary, meta, kv_cache))
        h, residual = self.pre_feedforward_layernorm.add_forward(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    """The Gemma 2 / Gemma 3 text decoder; the families' files pick the attention."""

    decoder_layer = GemmaDecoderLayer

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, ops: LayerOps | None = None
    ) -> None:
        super().__init__(config, backend, ops)
        self.local_rotary: RotaryEmbedding | None = None
        """Tables of the sliding-window layers when their base differs (Gemma 3)."""
        if config.rope_local_theta is not None:
            local = dataclasses.replace(
                config, rope_theta=config.rope_local_theta, rope_linear_factor=None
            )
            self.local_rotary = RotaryEmbedding(local)
        self.is_local = [config.window_of(i) is not None for i in range(config.num_layers)]
        self.embed_scale: torch.Tensor
        self.register_buffer("embed_scale", torch.empty(0), persistent=False)

    config_defaults: ClassVar[GemmaDefaults]
    """The generation's defaults (its own file's)."""

    @classmethod
    def config_from_hf(cls, architecture: str, hf_config: Mapping[str, Any]) -> ModelConfig:
        """Which layers slide (`layer_types`, else each period's last layer global), the
        local layers' rope base, the attention scale and the caps."""
        cfg, defaults = hf_config, cls.config_defaults
        if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise NotImplementedError(f"{architecture}: only tanh-approximated GeGLU is supported")
        config = base_config_from_hf(architecture, cfg, default_rope_theta=defaults.rope_theta)
        window = cfg.get("sliding_window", 4096)
        period = defaults.sliding_period
        if defaults.sliding_period_key is not None:
            period = cfg.get(defaults.sliding_period_key, period)
        types = cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % period else "full_attention"
            for i in range(config.num_layers)
        ]
        local_rope = rope_parameters(cfg)[1]
        local_theta = (local_rope or {}).get("rope_theta") or cfg.get("rope_local_base_freq")
        if local_theta is None:
            local_theta = defaults.rope_local_theta
        attn_cap, final_cap = defaults.logit_softcaps
        return dataclasses.replace(
            config,
            sliding_window=window,
            layer_windows=layer_windows(types, window),
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping", attn_cap),
            final_logit_softcapping=cfg.get("final_logit_softcapping", final_cap),
            rope_local_theta=None if local_theta is None else float(local_theta),
        )

    @classmethod
    def config_from_gguf(cls, architecture: str, metadata: GGUFMetadata) -> ModelConfig:
        """As llama.cpp reads it: sliding layers from `attention.sliding_window_pattern` (a
        period, or a flag per layer) else the generation's period, the local rope base
        fixed, linear rope scaling (global layers), the caps."""
        arch, meta, defaults = architecture, metadata, cls.config_defaults
        config = base_config_from_gguf(arch, meta)
        num_layers = required_integer(meta, f"{arch}.block_count")
        window = meta.integer(f"{arch}.attention.sliding_window")
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
        if isinstance(pattern, list):
            sliding = [bool(p) for p in pattern]
        else:
            period = int(pattern or defaults.sliding_period)
            sliding = [(i + 1) % period != 0 for i in range(num_layers)]
        scalar = float(config.head_dim)
        if num_layers == defaults.num_layers_27b:
            scalar = float(config.hidden_size // config.num_heads)
        linear = None
        if meta.string(f"{arch}.rope.scaling.type") == "linear":
            linear = meta.number(f"{arch}.rope.scaling.factor")
        return dataclasses.replace(
            config,
            sliding_window=window or None,
            layer_windows=tuple(window if s else None for s in sliding),
            query_pre_attn_scalar=scalar,
            attn_logit_softcapping=meta.number(f"{arch}.attn_logit_softcapping"),
            final_logit_softcapping=meta.number(f"{arch}.final_logit_softcapping"),
            rope_local_theta=defaults.rope_local_theta,
            rope_linear_factor=linear,
        )

    @classmethod
    def gguf_layout(cls, architecture: str) -> GGUFLayout:
        # llama.cpp's converter stores the norm weights with the 1 of (1 + weight) added.
        return GGUFLayout(layer_names=_GGUF_LAYER_NAMES, norm_plus_one=True)

    def build_mlp(self, config: ModelConfig, ops: LayerOps, layer: int) -> nn.Module:
        return GemmaMLP(config, ops)

    def build_caches(self, device: torch.device) -> None:
        super().build_caches(device)
        if self.local_rotary is not None:
            self.local_rotary.build(device)
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.build()
        # transformers multiplies by sqrt(hidden) as a tensor of the embedding dtype.
        dtype = self.model.embed_tokens.weight.dtype
        self.embed_scale = torch.tensor(self.config.hidden_size**0.5, dtype=dtype, device=device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        rotary = self.ops.rotary_tables(positions, self.rotary.cos_cache, self.rotary.sin_cache)
        local = rotary
        if self.local_rotary is not None:
            cos, sin = self.local_rotary.cos_cache, self.local_rotary.sin_cache
            local = self.ops.rotary_tables(positions, cos, sin)
        x = self.model.embed_tokens(input_ids) * self.embed_scale
        residual = None
        for layer, kv_cache, is_local in zip(
            self.model.layers, kv_caches, self.is_local, strict=True
        ):
            tables = local if is_local else rotary
            x, residual = layer(x, residual, tables, attn_metadata, kv_cache)
        if residual is None:
            return self.model.norm(x)
        return self.model.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap
