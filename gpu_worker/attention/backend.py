"""The interface the model is written against for attention, and the backends by name.

Every step, the model runner calls `plan` once with the step's metadata, before the first
layer; every layer then calls `forward`. A backend that prepares per-step work (index
tensors, masks) does it in `plan`, so all layers share it; one that reads the metadata
directly (Triton) has nothing to plan.
"""

from __future__ import annotations

from typing import Protocol

import torch

from gpu_worker.attention.metadata import AttentionMetadata


class AttentionModelConfig(Protocol):
    """What `tune` reads of the model's config. `gpu_worker.models.config.ModelConfig` is
    one; attention sits below the models, so it names the fields instead of importing it."""

    @property
    def num_layers(self) -> int: ...

    @property
    def num_heads(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def attn_logit_softcapping(self) -> float | None: ...

    def window_of(self, layer: int) -> int | None: ...


def attention_variants(model_config: AttentionModelConfig) -> list[tuple[int | None, float | None]]:
    """The distinct (window, soft-cap) pairs the model's layers attend with: each is its own
    compiled kernel, so each is tuned. Global layers (None) first."""
    cap = model_config.attn_logit_softcapping
    windows = {model_config.window_of(layer) for layer in range(model_config.num_layers)}
    return [(window, cap) for window in sorted(windows, key=lambda w: -1 if w is None else w)]


class AttentionBackend(Protocol):
    """What the model calls for attention; the torch and Triton backends implement it."""

    def tune(
        self,
        model_config: AttentionModelConfig,
        kv_cache: torch.Tensor,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        """Run, once at start-up, every autotuner this backend's kernels will use, over
        representative bucketed shapes of every window/soft-cap variant the model's layers
        use, so that no request ever waits for a tuning run. Called after the KV cache is
        allocated (`kv_cache` is any layer's cache) and before CUDA graph capture."""
        ...

    def plan(self, meta: AttentionMetadata, kv_cache: torch.Tensor) -> None:
        """Prepare this step's work for every layer. `kv_cache` is any layer's cache: all
        layers share its shape, dtype and device. The cache's dtype may differ from the
        queries' (--kv-cache-dtype): keys and values are rounded to it when stored and read
        back in the queries' dtype."""
        ...

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store new k/v `[num_tokens, num_kv_heads, head_dim]` into their cache slots."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        *,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Write k/v into the cache, then attend: q `[num_tokens, num_heads, head_dim]` ->
        out of the same shape, each query seeing its sequence's keys up to its own position,
        and with a sliding `window` (the layer's) only the last `window` of them: the query
        at position p sees keys p - window < k <= p, as in transformers. The cache keeps
        every key either way; the window is a mask. With `softcap` (Gemma 2's attention
        logit soft-capping) the scaled scores become `softcap * tanh(scores / softcap)`
        before the mask and the softmax."""
        ...


def get_attention_backend(name: str, query_dtype: torch.dtype | None = None) -> AttentionBackend:
    """Backend by name: "torch" (reference, any device) or "triton" (CUDA kernels).
    `query_dtype` is the model's dtype, which the KV cache's may differ from
    (--kv-cache-dtype): the torch backend plans its masks and kernels for it (the Triton
    kernels read it from the queries)."""
    if name == "torch":
        from gpu_worker.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(query_dtype)
    if name == "triton":
        from gpu_worker.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; expected 'torch' or 'triton'")


def resolve_backend_name(name: str, device: torch.device) -> str:
    """`auto` is Triton on CUDA and torch elsewhere."""
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name
