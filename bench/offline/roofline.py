"""The least time a workload can take on this machine, whatever the engine.

A Llama-shaped model's work per token is fixed by its shapes: every projection's weights
multiplied once, attention over the context so far, and the LM head for each token
sampled. At fp32 that work cannot go faster than the machine's best fp32 matmul rate (the
faster of MKL and oneDNN on a large square, measured here), and a decode step cannot go
faster than reading its weight bytes at the memory read rate. Dividing a measured time by
these gives how close an engine is to the machine, and dividing a baseline's time by them
gives the highest speedup over that baseline any engine could show.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpu_worker.ops import linear

GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """What sets a Llama-shaped decoder's arithmetic per token."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config: Any) -> ModelShape:
        """From a transformers config of the Llama family (SwiGLU MLP, grouped KV heads)."""
        heads = config.num_attention_heads
        return cls(
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab=config.vocab_size,
        )

    @property
    def layer_weights(self) -> int:
        """Weights of one layer's projections: q, k, v, o, gate, up, down."""
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (2 * q_out + 2 * kv_out) + 3 * self.hidden * self.intermediate

    def token_flops(self, context: int) -> float:
        """One token through every layer, attending to `context` tokens (itself included):
        a multiply-add per weight, and q.k plus p.v per head and context token."""
        attention = 4 * self.heads * self.head_dim * context
        return self.layers * (2.0 * self.layer_weights + attention)

    @property
    def head_flops(self) -> float:
        """The LM head for one sampled token."""
        return 2.0 * self.hidden * self.vocab

    def request_flops(self, prompt_len: int, new_tokens: int) -> float:
        """A request of `prompt_len` tokens that samples `new_tokens`: the prompt, each
        sampled token but the last fed back, and the head once per sampled token."""
        fed = prompt_len + new_tokens - 1
        body = sum(self.token_flops(c) for c in range(1, fed + 1))
        return body + new_tokens * self.head_flops

    def decode_flops(self, prompt_len: int, new_tokens: int) -> float:
        """The `new_tokens` decode steps that follow a prompt's first sampled token."""
        body = sum(self.token_flops(prompt_len + i) for i in range(1, new_tokens + 1))
        return body + new_tokens * self.head_flops


def _best_seconds(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def peak_flops(size: int = 2048) -> float:
    """FLOP/s of the best fp32 `size`-cube matmul at torch's current thread count, by MKL
    (`a @ b`) or by oneDNN on a prepacked weight where torch has it (on an AMD EPYC oneDNN
    ran 1.1-1.3x faster): the rate fp32 arithmetic cannot beat here in practice."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    best = _best_seconds(lambda: a @ b, repeats=10)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(b, size)
        best = min(
            best,
            _best_seconds(
                lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""),
                repeats=10,
            ),
        )
    except (RuntimeError, AttributeError):  # no oneDNN in this build of torch
        pass
    return 2.0 * size**3 / best


def bandwidth() -> tuple[float, float]:
    """Bytes/s of a sum over 512 MiB and of a 512 MiB copy, at torch's current thread
    count: the rates a decode step can stream its weights at best."""
    src = torch.ones(GIB // 2 // 4)
    dst = torch.empty_like(src)
    read = src.numel() * 4 / _best_seconds(lambda: src.sum())
    copy = 2 * src.numel() * 4 / _best_seconds(lambda: dst.copy_(src))
    return read, copy


def streamed_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step of duet's `model` reads: each projection's GGUF
    blocks where it has them, else its fp32 weight, and the LM head's blocks where it has
    them (a dense head is the embedding matrix, not counted)."""

    def blocks_bytes(weight: Any) -> int:
        return sum(int(b.data.numel()) for b in weight.blocks())

    total = sum(
        blocks_bytes(m.quantized) if m.quantized is not None else m.weight.numel() * 4
        for m in model.modules()
        if isinstance(m, linear.Linear)
    )
    head = getattr(model, "logits_head", None)
    if head is not None and head.quantized is not None:
        total += blocks_bytes(head.quantized)
    return total


@dataclass(frozen=True)
class Bound:
    """A case's least time on this machine: its fp32 arithmetic at the matmul peak, or
    (decode) its weight bytes at the memory read rate, whichever is longer."""

    flops: float
    seconds: float
    limit: str

    @classmethod
    def of(
        cls, flops: float, peak: float, weight_reads: float = 0.0, read_rate: float = 1.0
    ) -> Bound:
        compute, memory = flops / peak, weight_reads / read_rate
        if memory > compute:
            return cls(flops, memory, "weight reads")
        return cls(flops, compute, "arithmetic")


@dataclass(frozen=True)
class MachineLimits:
    """This machine's fp32 matmul peak (FLOP/s) and memory read rate (bytes/s) at torch's
    thread count when measured."""

    peak: float
    read_rate: float

    @classmethod
    def measure(cls) -> MachineLimits:
        return cls(peak_flops(), bandwidth()[0])

    def describe(self) -> str:
        return (
            f"{self.peak / 1e9:.0f} GFLOP/s fp32 matmul peak, {self.read_rate / 1e9:.1f} GB/s read"
        )
