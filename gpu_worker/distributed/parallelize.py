"""Turn a model built as today into one rank's tensor-parallel model.

`parallelize` swaps each projection, the embedding, the LM head and each MoE layer's
experts for its parallel layer type (`gpu_worker.distributed.layers`) and sets each
attention's local head counts, so the model files stay plain: their forward runs unchanged
on a rank's shard. It leaves a `TPWeightShard` on the model that `load_stacked_weights`
consults for every checkpoint tensor, so each rank reads only its rows or columns (from a
lazily sliced safetensors tensor, the file's bytes past them never read).

Call it before the weights are materialized (the loader does it on the meta device): the
parallel layers are created on the device and in the dtype of the layers they replace.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import torch
from torch import nn

from gpu_worker.distributed.group import TPGroup
from gpu_worker.distributed.layers import (
    ColumnParallelLinear,
    ParallelExperts,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from gpu_worker.distributed.sharding import local_heads, slice_len
from gpu_worker.models.llama import MLP, Attention, LlamaForCausalLM
from gpu_worker.models.moe import SparseMoeBlock
from gpu_worker.models.weights import WEIGHT_SHARD_ATTR, TensorSource


class _Linear(Protocol):
    weight: torch.Tensor


_M = TypeVar("_M", bound=nn.Module)


def _like(new: _M, old: _Linear) -> _M:
    """`new` in the dtype of the weight it replaces."""
    return new.to(dtype=old.weight.dtype)


def _build_on(old: _Linear) -> torch.device:
    """New layers are built where the old ones live: on meta, no memory is touched."""
    return old.weight.device


def parallelize(model: nn.Module, group: TPGroup) -> nn.Module:
    """Make `model` (a `LlamaForCausalLM` family model) rank `group.rank`'s shard of
    itself, in place; returns it. Its weights are left uninitialized: load them after."""
    if not isinstance(model, LlamaForCausalLM):
        raise NotImplementedError(f"{type(model).__name__} has no tensor-parallel layout")
    config = model.config
    for module in list(model.modules()):
        if isinstance(module, SparseMoeBlock):
            _parallel_experts(module, config.hidden_size, group)
        elif isinstance(module, Attention):
            _parallel_attention(module, config.hidden_size, group)
        elif isinstance(module, MLP):
            _parallel_mlp(module, config.hidden_size, group)
    embed = model.model.embed_tokens
    with torch.device(_build_on(embed)):
        parallel_embed = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group)
    model.model.embed_tokens = _like(parallel_embed, embed)
    head = ParallelLMHead(config.vocab_size, group)
    if model.lm_head is not None:
        old = model.lm_head
        with torch.device(_build_on(old)):
            local = nn.Linear(config.hidden_size, head.shard.rows, bias=False)
        model.lm_head = _like(local, old)
    # A tied model's head reads the embedding's rows: the same vocabulary shard.
    model.logits_head = head
    setattr(model, WEIGHT_SHARD_ATTR, TPWeightShard(model))
    return model


def _parallel_attention(attn: Attention, hidden: int, group: TPGroup) -> None:
    heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    qkv, o = attn.qkv_proj, attn.o_proj
    with torch.device(_build_on(qkv)):
        new_qkv = ColumnParallelLinear.qkv(
            hidden, heads, kv_heads, head_dim, qkv.bias is not None, group
        )
        new_o = RowParallelLinear.for_heads(
            heads, kv_heads, head_dim, hidden, o.bias is not None, group
        )
    attn.qkv_proj = _like(new_qkv, qkv)
    attn.o_proj = _like(new_o, o)
    local = local_heads(heads, kv_heads, group.world_size, group.rank)
    attn.num_heads, attn.num_kv_heads = local.num_heads, local.num_kv_heads
    attn.q_size, attn.kv_size = local.num_heads * head_dim, local.num_kv_heads * head_dim


def _parallel_mlp(mlp: MLP, hidden: int, group: TPGroup) -> None:
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    inner = mlp.intermediate_size
    if gate_up.bias is not None or down.bias is not None:
        raise NotImplementedError("tensor parallelism over MLPs with biases is not supported")
    with torch.device(_build_on(gate_up)):
        new_gate_up = ColumnParallelLinear.merged(hidden, (inner, inner), False, group)
        new_down = RowParallelLinear.even(inner, hidden, False, group)
    mlp.gate_up_proj = _like(new_gate_up, gate_up)
    mlp.down_proj = _like(new_down, down)
    mlp.intermediate_size = slice_len(new_down.in_columns)


def _parallel_experts(block: SparseMoeBlock, hidden: int, group: TPGroup) -> None:
    """The experts split like the dense MLP; the router (`block.gate`) stays whole."""
    experts = block.experts
    num_experts, _, inner = experts.down_proj.shape
    with torch.device(experts.down_proj.device):
        parallel = ParallelExperts(num_experts, hidden, inner, group)
    block.experts = parallel.to(dtype=experts.down_proj.dtype)


class TPWeightShard:
    """Which part of each checkpoint tensor this rank keeps (`gpu_worker.models.weights`'s
    shard hook): its rows of a column-parallel projection, its columns of a row-parallel
    one, its slice of every expert's gate, up and down (from the stacks
    `gpu_worker.models.moe.stack_expert_weights` yields, lazy when the checkpoint is), its
    vocabulary rows, all of a replicated tensor (norms, a MoE router)."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = dict(model.named_modules())
        head = getattr(model, "logits_head", None)
        self.head = head if isinstance(head, ParallelLMHead) else None
        self.lm_head_param = "lm_head.weight"

    def __call__(
        self, param: str, rows: tuple[int, int] | None, full: TensorSource
    ) -> tuple[torch.Tensor, slice | None] | None:
        """Rank's part of `full`, bound for `param` (rows `rows` of it when the model fuses
        several checkpoint tensors there), and where it goes in the rank's parameter
        (None: the whole parameter); None when this rank keeps nothing of it."""
        owner, _, kind = param.rpartition(".")
        module = self.modules.get(owner)
        if isinstance(module, ColumnParallelLinear):
            return self._column(module, rows, full)
        if isinstance(module, RowParallelLinear):
            if kind == "bias":
                return (full[:], None) if module.bias is not None else None
            return full[:, module.in_columns], None
        if isinstance(module, ParallelExperts):
            if kind == "gate_up_proj":
                return module.shard_gate_up(full), None
            return module.shard_down(full), None
        if isinstance(module, VocabParallelEmbedding):
            return _vocab(full, module.shard.start, module.shard.num_real, module.shard.rows), None
        if param == self.lm_head_param and self.head is not None:
            shard = self.head.shard
            return _vocab(full, shard.start, shard.num_real, shard.rows), None
        return full[:], (None if rows is None else slice(*rows))

    @staticmethod
    def _column(
        module: ColumnParallelLinear, rows: tuple[int, int] | None, full: TensorSource
    ) -> tuple[torch.Tensor, slice | None]:
        offsets = [sum(module.part_sizes[:i]) for i in range(len(module.part_sizes))]
        if rows is None:  # a checkpoint that fuses the parts itself (Phi-3)
            parts = [
                full[offset + part.start : offset + part.stop]
                for offset, part in zip(offsets, module.part_rows, strict=True)
            ]
            return torch.cat(parts), None
        part = offsets.index(rows[0])
        local = module.part_rows[part]
        return full[local], module.local_rows(part)


def _vocab(full: TensorSource, start: int, num_real: int, rows: int) -> torch.Tensor:
    """Rows `[start, start + num_real)` of a vocabulary matrix, zero-padded to `rows`."""
    real = full[start : start + num_real]
    if num_real == rows:
        return real
    padding = real.new_zeros((rows - num_real, *real.shape[1:]))
    return torch.cat((real, padding))
