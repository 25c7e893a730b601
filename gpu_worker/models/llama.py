"""The Llama family: Llama 2/3 (llama3 rope scaling), SmolLM2, Qwen2 (QKV bias), Mistral.

Plain torch over a flattened batch: `forward` takes every scheduled token of the step in one
1-D tensor, and attention goes through an `AttentionBackend` over the paged KV cache. Q/K/V and
gate/up are fused into one matmul each when the weights are loaded (`stacked_params`). The
elementwise ops are `LayerOps` (torch or Triton); the projections' fast paths (prepacked
bf16, GGUF blocks) are `gpu_worker.ops.linear`'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from gpu_worker.attention.backend import AttentionBackend
from gpu_worker.attention.metadata import AttentionMetadata
from gpu_worker.models.base import CausalLM
from gpu_worker.models.config import ModelConfig
from gpu_worker.models.gguf_config import base_config_from_gguf
from gpu_worker.models.gguf_layout import GGUFLayout
from gpu_worker.models.hf_config import base_config_from_hf, check_silu_mlp, layer_windows
from gpu_worker.models.weights import load_stacked_weights
from gpu_worker.ops.cpu_precision import bf16_copy, fast_linears
from gpu_worker.ops.gguf_linear import QuantizedWeight
from gpu_worker.ops.layer_ops import LayerOps, RotaryTables, TorchLayerOps
from gpu_worker.ops.linear import (
    Linear,
    LogitsHead,
    StackedParams,
    attach_quantized,
    prepack_linears,
)
from shared.gguf_metadata import GGUFMetadata


class RMSNorm(nn.Module):
    """Root-mean-square layer norm; the arithmetic is the layer ops'
    (`gpu_worker.ops.layer_ops`)."""

    def __init__(self, dim: int, eps: float, ops: LayerOps | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.ops = ops or TorchLayerOps()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`residual + x`, normed: returns `(norm(residual + x), residual + x)` in one pass
        where the ops fuse it."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Per-pair inverse frequencies [rotary_dim // 2], with llama3 scaling, GGUF factors or
    LongRoPE.

    LongRoPE's set is fixed per model, not per step: long factors iff the model serves
    positions past the original context (`max_position_embeddings` > original), as
    llama.cpp decides by its context size. transformers picks per forward by the longest
    sequence, and its generate recomputes the whole cache with long factors once a sequence
    passes the original length; a paged cache cannot redo its keys, and keys that depend
    only on token and position keep prefix caching exact. So every sequence gets
    transformers' numbers in the regime the model is configured for (a long-context model:
    sequences past the original length; a model capped at it: all of them)."""
    dim = config.rotary_dim or config.head_dim
    # fp32 throughout, op for op as transformers does, so cos/sin match it bit for bit.
    exponents = torch.arange(0, dim, 2).float() / dim
    longrope = config.longrope
    if longrope is not None:
        use_long = config.max_position_embeddings > longrope.original_max_position_embeddings
        factors = longrope.long_factor if use_long else longrope.short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * config.rope_theta**exponents)
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is not None:
        # llama3: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = scaling.factor
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        old_len = scaling.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(is_mid, blended, inv_freq)
    if config.rope_freq_factors is not None:
        # llama.cpp stores llama3 scaling as per-pair divisors instead of parameters.
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    if config.rope_linear_factor is not None:
        inv_freq = inv_freq / config.rope_linear_factor
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin for every position, computed once in fp32 (HF's rotate_half convention).

    Both tables span the rotated dims (head_dim, or `rotary_dim`): cos is [cos, cos] and
    sin is [-sin, sin], so that rotating is `x * cos + roll(x, half) * sin`, four ops for q
    and k together. The products are the ones HF forms (`-x2 * sin` there, `x2 * -sin`
    here), bit for bit.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)

    def build(self, device: torch.device) -> None:
        """Fill the caches; called by the loader once the model sits on its device."""
        inv_freq = rope_inv_freq(self.config).to(device)
        positions = torch.arange(self.config.max_position_embeddings, device=device).float()
        freqs = torch.outer(positions, inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        if self.config.longrope is not None:
            cos = cos * self.config.longrope.attention_factor
            sin = sin * self.config.longrope.attention_factor
        self.cos_cache = torch.cat((cos, cos), dim=-1)
        self.sin_cache = torch.cat((-sin, sin), dim=-1)


class Attention(nn.Module):
    """Self-attention with a fused QKV projection and grouped KV heads."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, ops: LayerOps) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim or config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.softcap = config.attn_logit_softcapping
        self.backend = backend
        self.window: int | None = None
        """This layer's sliding window (None: global); `LlamaModel` sets it per layer."""
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_out_bias)

    def forward(
        self,
        x: torch.Tensor,
        rotary: RotaryTables,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        # q and k rotate in one go: their heads sit side by side at the front of qkv.
        qk = qkv[:, : self.q_size + self.kv_size].view(
            -1, self.num_heads + self.num_kv_heads, self.head_dim
        )
        q, k = self.rotate(self.norm_qk(qk), rotary)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(
            q, k, v, kv_cache, meta, self.scale, self.window, softcap=self.softcap
        )
        return self.o_proj(out.reshape(-1, self.q_size))

    def rotate(self, qk: torch.Tensor, rotary: RotaryTables) -> tuple[torch.Tensor, torch.Tensor]:
        """qk [tokens, heads + kv_heads, head_dim] -> rotated q and k."""
        if self.rotary_dim == self.head_dim:
            return self.ops.rotate(qk, self.num_heads, rotary)
        # Partial rotary (Phi-3/4): the tables span the leading rotary_dim dims, which the
        # ops rotate as if they were the whole head; the rest pass through unchanged.
        q, k = self.ops.rotate(qk[..., : self.rotary_dim], self.num_heads, rotary)
        q_pass, k_pass = qk[..., self.rotary_dim :].split([self.num_heads, self.num_kv_heads], 1)
        return torch.cat((q, q_pass), dim=-1), torch.cat((k, k_pass), dim=-1)

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """A hook before rotary for families that norm q and k per head (Qwen3); Llama
        rotates them as projected."""
        return qk


class MLP(nn.Module):
    """SwiGLU feed-forward with gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig, ops: LayerOps) -> None:
        super().__init__()
        self.ops = ops
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


MLPFactory = Callable[[ModelConfig, LayerOps, int], nn.Module]
"""Builds decoder layer `i`'s feed-forward block (`LlamaForCausalLM.build_mlp`)."""


class DecoderLayer(nn.Module):
    """Pre-norm transformer block over a residual stream carried between layers: each
    residual add is fused into the norm after it."""

    norm_class: type[RMSNorm] = RMSNorm
    """The norm of the layer's blocks and of the model's output (Gemma's scales by 1 + w)."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        ops: LayerOps,
        attention: type[Attention] = Attention,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = attention(config, backend, ops)
        self.post_attention_layernorm = self.norm_class(
            config.hidden_size, config.rms_norm_eps, ops
        )
        self.mlp = mlp if mlp is not None else MLP(config, ops)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryTables,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the previous layer's output (the embeddings for the first layer, whose
        `residual` is None); returns this layer's output and the residual stream."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, rotary, meta, kv_cache)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and the final norm."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        ops: LayerOps,
        attention: type[Attention] = Attention,
        mlp: MLPFactory | None = None,
        layer: type[DecoderLayer] = DecoderLayer,
    ) -> None:
        super().__init__()
        # An empty `_weight` skips the random init (on meta it would import torch._dynamo):
        # the loader overwrites every weight anyway.
        shape = (config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        layers = [
            layer(config, backend, ops, attention, None if mlp is None else mlp(config, ops, i))
            for i in range(config.num_layers)
        ]
        for i, block in enumerate(layers):
            block.self_attn.window = config.window_of(i)
        self.layers = nn.ModuleList(layers)
        self.norm = layer.norm_class(config.hidden_size, config.rms_norm_eps, ops)


def qwen_windows(config: ModelConfig, hf_config: Mapping[str, Any]) -> ModelConfig:
    """Qwen2/3's sliding layers, as transformers decides: none without `use_sliding_window`,
    else config.json's `layer_types`, else every layer from `max_window_layers` on (the first
    ones attend globally)."""
    window = config.sliding_window if hf_config.get("use_sliding_window") else None
    if window is None:
        return dataclasses.replace(config, sliding_window=None)
    first = hf_config.get("max_window_layers", 28)
    default = [
        "sliding_attention" if i >= first else "full_attention" for i in range(config.num_layers)
    ]
    types = hf_config.get("layer_types") or default
    return dataclasses.replace(config, layer_windows=layer_windows(types, window))


class LlamaForCausalLM(CausalLM):
    """Causal LM head over `LlamaModel`; serves every architecture in the Llama family."""

    attention: type[Attention] = Attention
    """The layers' attention: families that differ from Llama only there subclass it."""
    decoder_layer: type[DecoderLayer] = DecoderLayer
    """The block around attention and MLP (Gemma's has four norms)."""

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, ops: LayerOps | None = None
    ) -> None:
        super().__init__(config, backend, ops)
        self.ops = ops = ops or TorchLayerOps()
        self.model = LlamaModel(
            config, backend, ops, self.attention, self.build_mlp, self.decoder_layer
        )
        self.rotary = RotaryEmbedding(config)
        # Tied models read the embedding matrix directly, so no second parameter can drift.
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logits_head = LogitsHead()

    @classmethod
    def config_from_hf(cls, architecture: str, hf_config: Mapping[str, Any]) -> ModelConfig:
        """Llama's and Mistral's fields as every family reads them; Qwen2's q/k/v carry a
        bias (its output projection none) and its sliding window is `qwen_windows`'."""
        check_silu_mlp(architecture, hf_config)
        config = base_config_from_hf(architecture, hf_config)
        if architecture == "Qwen2ForCausalLM":
            config = dataclasses.replace(config, attention_bias=True, attention_out_bias=False)
            config = qwen_windows(config, hf_config)
        return config

    @classmethod
    def config_from_gguf(cls, architecture: str, metadata: GGUFMetadata) -> ModelConfig:
        """Every family's fields; qwen2's q/k/v carry a bias."""
        config = base_config_from_gguf(architecture, metadata)
        if architecture == "qwen2":
            return dataclasses.replace(config, attention_bias=True)
        if architecture == "llama" and config.num_experts:
            # llama.cpp writes Mixtral as llama with experts; the registry knows it as mixtral.
            return dataclasses.replace(config, architecture="mixtral")
        return config

    @classmethod
    def gguf_layout(cls, architecture: str) -> GGUFLayout:
        # llama.cpp permutes q/k rows only for its llama arch (Mixtral included).
        return GGUFLayout(permuted_qk=architecture in ("llama", "mixtral"))

    def build_mlp(self, config: ModelConfig, ops: LayerOps, layer: int) -> nn.Module:
        """Decoder layer `layer`'s feed-forward block: families with experts override it."""
        return MLP(config, ops)

    def stacked_params(self) -> StackedParams:
        """HF projection name -> (our fused projection, its rows there)."""
        c = self.config
        q, kv, inner = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        return {
            "q_proj": ("qkv_proj", 0, q),
            "k_proj": ("qkv_proj", q, q + kv),
            "v_proj": ("qkv_proj", q + kv, q + 2 * kv),
            "gate_proj": ("gate_up_proj", 0, inner),
            "up_proj": ("gate_up_proj", inner, 2 * inner),
        }

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """input_ids/positions [num_tokens] -> final-normed hidden states [num_tokens, hidden]."""
        rotary = self.ops.rotary_tables(positions, self.rotary.cos_cache, self.rotary.sin_cache)
        x = self.model.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rotary, attn_metadata, kv_cache)
        if residual is None:  # a model without layers
            return self.model.norm(x)
        return self.model.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states at the sampled positions [n, hidden] -> fp32 logits [n, vocab]."""
        return self.logits_head(hidden, self.head_weight())

    # ---- after loading ---------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the parameters, fusing q/k/v and gate/up; every
        parameter must be written exactly once."""

        def skip(name: str) -> bool:
            # Old checkpoints store inv_freq (we compute our own); some tied ones still
            # carry a copy of the head.
            tied_copy = name == "lm_head.weight" and self.lm_head is None
            return name.endswith("rotary_emb.inv_freq") or tied_copy

        load_stacked_weights(self, weights, self.stacked_params(), skip)

    def build_caches(self, device: torch.device) -> None:
        """Compute the derived state once the weights sit on `device`: rotary tables and the
        projections' fast copies (`gpu_worker.ops.linear`). Call it again after changing
        any weight; that also drops the quantized copies, which cannot follow the change."""
        self.rotary.build(device)
        prepack_linears(self)
        self.logits_head.prepack(self.head_weight())

    def attach_quantized(self, weights: Mapping[str, QuantizedWeight]) -> None:
        """Give the projections and the LM head the GGUF blocks of their weights (HF names,
        rows as in the dense weights)."""
        attach_quantized(self, weights, self.stacked_params())
        head_name = "model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight"
        self.logits_head.attach(weights.get(head_name), self.head_weight())

    def attach_fast_copies(self) -> int:
        self.logits_head.fast_weight = bf16_copy(self.head_weight())
        return fast_linears(self) + (self.logits_head.fast_weight is not None)
