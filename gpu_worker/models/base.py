"""What every model family provides to the loader and the model runner: its configs read
from config.json and GGUF metadata, its GGUF tensor layout, and the model itself."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from gpu_worker.attention.backend import AttentionBackend
from gpu_worker.attention.metadata import AttentionMetadata
from gpu_worker.models.config import ModelConfig
from gpu_worker.models.gguf_layout import GGUFLayout
from gpu_worker.ops.gguf_linear import QuantizedWeight
from gpu_worker.ops.layer_ops import LayerOps
from shared.gguf_metadata import GGUFMetadata


class CausalLM(nn.Module, ABC):
    """A decoder over a flattened batch and a paged KV cache. A family's file subclasses
    it; the registry (`gpu_worker.models`) maps architecture names to the subclasses."""

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, ops: LayerOps | None = None
    ) -> None:
        """The loader's call: build the layers for `config` (on the meta device; the loader
        fills the weights), attention on `backend`, elementwise ops from `ops` (torch's
        when None)."""
        super().__init__()
        self.config = config
        self.attn_backend = backend
        """The backend every attention layer calls; the model runner plans each step on it."""

    @classmethod
    @abstractmethod
    def config_from_hf(cls, architecture: str, hf_config: Mapping[str, Any]) -> ModelConfig:
        """The config of a checkpoint whose config.json names `architecture`."""

    @classmethod
    @abstractmethod
    def config_from_gguf(cls, architecture: str, metadata: GGUFMetadata) -> ModelConfig:
        """The config of a GGUF file whose `general.architecture` is `architecture`."""

    @classmethod
    def gguf_layout(cls, architecture: str) -> GGUFLayout:
        """How llama.cpp stores the tensors of `architecture` (its usual names here)."""
        return GGUFLayout()

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """input_ids/positions [num_tokens] -> final hidden states [num_tokens, hidden]."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states at the sampled positions [n, hidden] -> fp32 logits [n, vocab]."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors into the parameters, each exactly once."""

    @abstractmethod
    def build_caches(self, device: torch.device) -> None:
        """Derived state once the weights sit on `device` (rotary tables, fast copies)."""

    def attach_quantized(self, weights: Mapping[str, QuantizedWeight]) -> None:
        """Use a GGUF file's quantized blocks where the family supports them (none here)."""

    def attach_fast_copies(self) -> int:
        """--cpu-precision fast: bf16 copies of the projections and the LM head, where the
        family supports them (none here; `gpu_worker.ops.cpu_precision`). Returns the number
        of weights that got one."""
        return 0
