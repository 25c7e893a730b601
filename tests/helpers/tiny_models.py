"""Tiny random HF-format models, and a tiny paged runner to drive our models like the engine.

`save_tiny_model` is the one builder of a model directory in the tests: a random model of a
family, saved with transformers' `save_pretrained` (so our loader reads exactly what a real
HF checkpoint holds), with the tokenizer the test needs. `tiny_hf_model` is its in-memory
half, for tests that write another format (GGUF) from the same weights.

Weights are drawn larger than HF's init (std 0.02 leaves attention almost uniform, which
would hide rotary or permutation bugs), norms and biases are perturbed from their ones/zeros
init so a misplaced norm or a dropped bias shows in the logits.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, cast

import torch
import transformers
from torch import nn

from gpu_worker.attention.backend import AttentionBackend
from gpu_worker.attention.metadata import build_attention_metadata
from gpu_worker.models.base import CausalLM
from gpu_worker.models.config import ModelConfig
from gpu_worker.runner.kv_caches import allocate_kv_caches

Family = Literal[
    "llama", "qwen2", "mistral", "qwen3", "mixtral", "qwen3_moe", "phi3", "gemma2", "gemma3"
]
TokenizerKind = Literal["words", "bytes"]
"""`save_tiny_model`'s tokenizers: "words" has one token per id of the model's vocabulary
(an `Engine` serves it; no text), "bytes" is byte-level (render-serve and llguidance read
text through it)."""

_SIZES: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
# Families' own defaults, which `overrides` may replace: few, small experts, top-2.
_FAMILY_SIZES: dict[str, dict[str, Any]] = {
    "mixtral": dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    # Phi3Config's pad (an embedding row) and eos default to id 32000, past a tiny vocab.
    "phi3": dict(pad_token_id=None, eos_token_id=2),
    # Gemma's default head_dim (256) would dwarf the tiny hidden size; eager attention is
    # transformers' only one with soft-capping.
    "gemma2": dict(head_dim=16, attn_implementation="eager"),
    "gemma3": dict(head_dim=16, attn_implementation="eager"),
}

EOS, BOS, PAD = 256, 257, 258
"""The specials of `save_byte_tokenizer`, after the 256 byte tokens."""
BYTE_VOCAB_SIZE = 259
SPECIAL_TOKENS = {"<eos>": EOS, "<bos>": BOS, "<pad>": PAD}
# What a model's config takes to match the byte tokenizer: its vocabulary and specials.
_BYTE_VOCAB: dict[str, Any] = dict(
    vocab_size=BYTE_VOCAB_SIZE, eos_token_id=EOS, bos_token_id=BOS, pad_token_id=PAD
)


class TinyModel(NamedTuple):
    """A saved tiny model: its directory, and transformers' fp32 (or `dtype`) model of the
    same weights, the reference to compare against."""

    path: Path
    hf: transformers.PreTrainedModel


def tiny_hf_model(
    family: Family = "llama", *, tie_word_embeddings: bool = False, seed: int = 0, **overrides: Any
) -> transformers.PreTrainedModel:
    """A random-weight transformers model of `family`, in fp32 eval mode: the tiny sizes
    above, then the family's, then `overrides` (any config field). The same arguments give
    the same weights. `overrides` are copied first: transformers writes into a rope dict it
    is given, and a caller's constant must not change under the next test."""
    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
        "qwen3": transformers.Qwen3Config,
        "mixtral": transformers.MixtralConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "phi3": transformers.Phi3Config,
        "gemma2": transformers.Gemma2Config,
        "gemma3": transformers.Gemma3TextConfig,
    }[family]
    sizes = {**_SIZES, **_FAMILY_SIZES.get(family, {}), **copy.deepcopy(overrides)}
    config = config_cls(**sizes, tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                # Gemma's norms scale by 1 + weight: their weights are offsets from one.
                offset = 0 if family.startswith("gemma") else 1
                param.copy_(offset + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.5 * torch.randn_like(param))
            elif "embed_tokens" in name:
                param.normal_(0.0, 1.0)
            else:
                param.normal_(0.0, 0.15)
    return model.eval()


def save_tiny_model(
    out_dir: Path,
    family: Family = "llama",
    *,
    tie_word_embeddings: bool = False,
    tokenizer: TokenizerKind | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> TinyModel:
    """Write a tiny random `family` model (`tiny_hf_model`'s) to `out_dir` as a HF checkpoint.

    - `tokenizer`: none (a loader's test), "words" over the model's vocabulary, or "bytes",
      whose vocabulary and specials (`BYTE_VOCAB_SIZE`; `EOS`, `BOS`, `PAD`) the config
      takes over any in `overrides` (a family table's vocab_size, say).
    - `dtype`: the weights are drawn in fp32 and saved (and returned) in this dtype.
    - `max_shard_size`: small, for a sharded checkpoint with its index file.
    - `overrides`: any config field, after the tiny sizes.
    """
    if tokenizer == "bytes":
        overrides = {**overrides, **_BYTE_VOCAB}
    model = tiny_hf_model(family, tie_word_embeddings=tie_word_embeddings, seed=seed, **overrides)
    if dtype != torch.float32:
        model = model.to(dtype)
    kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, **kwargs)
    if tokenizer == "words":
        save_tiny_tokenizer(out_dir, model.config.vocab_size)
    elif tokenizer == "bytes":
        save_byte_tokenizer(out_dir)
    return TinyModel(out_dir, model)


def save_tiny_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A word-level `tokenizer.json` with one token per id, so an `Engine` (which identifies
    its vocabulary by that file) can serve a tiny model directory. `save_tiny_model` writes
    it for `tokenizer="words"`; called alone, for a tokenizer over another vocabulary size
    or beside a checkpoint saved another way."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(out_dir / "tokenizer.json"))


def save_byte_tokenizer(out_dir: Path) -> None:
    """A byte-level BPE `tokenizer.json` without merges (token id = byte value) plus the
    specials, so both llguidance (structured outputs) and the render tier can read it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from shared.byte_level import unicode_to_bytes

    tokenizer = Tokenizer(models.BPE(vocab=dict(unicode_to_bytes()), merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(text, special=True) for text in SPECIAL_TOKENS])
    assert all(tokenizer.token_to_id(text) == i for text, i in SPECIAL_TOKENS.items())
    tokenizer.save(str(out_dir / "tokenizer.json"))


@dataclass
class _SeqState:
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


class PagedRunner:
    """Runs one of our models step by step through a paged KV cache.

    A test-local block allocator hands out blocks in shuffled order, so block tables are never
    contiguous, and a small block size makes sequences straddle several partially filled blocks.
    """

    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        *,
        num_blocks: int = 64,
        block_size: int = 4,
        seed: int = 0,
    ) -> None:
        self.model = model
        # The instance the model's layers call: it keeps the plan of each step.
        self.attn_backend = cast(AttentionBackend, model.attn_backend)
        self.block_size = block_size
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches = allocate_kv_caches(config.num_layers, *shape, dtype, device)
        # Block 0 stays unused so that a table padded with 0 would read garbage if trusted.
        self.free_blocks = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.seqs: dict[int, _SeqState] = {}

    @torch.no_grad()
    def step(self, batch: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """One flattened step over `seq_id -> new token ids`; returns each sequence's fp32
        logits for its new tokens [len(tokens), vocab]."""
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        ids: list[int] = []
        positions: list[int] = []
        for seq_id, tokens in batch.items():
            state = self.seqs.setdefault(seq_id, _SeqState())
            total = state.num_computed_tokens + len(tokens)
            while len(state.block_table) * self.block_size < total:
                state.block_table.append(self.free_blocks.pop())
            query_lens.append(len(tokens))
            context_lens.append(state.num_computed_tokens)
            tables.append(list(state.block_table))
            ids.extend(tokens)
            positions.extend(range(state.num_computed_tokens, total))
        device = self.kv_caches[0].device
        meta = build_attention_metadata(query_lens, context_lens, tables, self.block_size, device)
        self.attn_backend.plan(meta, self.kv_caches[0])
        hidden = self.model(
            torch.tensor(ids, device=device),
            torch.tensor(positions, device=device),
            meta,
            self.kv_caches,
        )
        for seq_id, tokens in batch.items():
            self.seqs[seq_id].num_computed_tokens += len(tokens)
        logits = cast(CausalLM, self.model).compute_logits(hidden).split(query_lens)
        return dict(zip(batch.keys(), logits, strict=True))

    def greedy(self, seq_id: int, prompt: list[int], max_tokens: int) -> list[int]:
        """Prefill `prompt` in one step, then decode `max_tokens` greedy tokens one by one."""
        logits = self.step({seq_id: prompt})[seq_id]
        out: list[int] = []
        for _ in range(max_tokens):
            out.append(int(logits[-1].argmax()))
            logits = self.step({seq_id: [out[-1]]})[seq_id]
        return out
