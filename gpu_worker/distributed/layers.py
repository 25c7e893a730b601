"""Tensor-parallel layer types: run on every rank of a group, they compute what their dense
counterparts compute, each rank holding only its shard of the weights.

They are drop-in types for a model's projections (`gpu_worker.ops.linear.Linear`), its
embedding (`nn.Embedding`), its logits head (`LogitsHead`) and a MoE layer's experts
(`gpu_worker.models.moe.Experts`), so the fast CPU paths
(prepacked bf16, GGUF blocks) still apply to a rank's shard and model code does not
change. Each takes its shard with `load_shard` from the full checkpoint tensor, which the
tests use; the loader reads only the rank's slice from safetensors instead (the same
`gpu_worker.distributed.sharding` functions on a lazily sliced tensor), so no rank ever
holds the whole model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.distributed.comm import all_reduce_, gather_to_rank0
from gpu_worker.distributed.group import TPGroup
from gpu_worker.distributed.sharding import (
    column_shard,
    even_rows,
    local_heads,
    qkv_rows,
    row_shard,
    row_shard_bias,
    slice_len,
    vocab_rows,
    vocab_shard,
)
from gpu_worker.models.moe import Experts
from gpu_worker.models.weights import TensorSource
from gpu_worker.ops.layer_ops import LayerOps
from gpu_worker.ops.linear import Linear, LogitsHead


class ColumnParallelLinear(Linear):
    """A (fused) projection split by output rows: the rank computes its rows of each part
    (q, k, v or gate, up) and keeps them sharded, with no communication: its output is
    what the row-parallel layer after it takes."""

    def __init__(
        self,
        in_features: int,
        part_sizes: Sequence[int],
        part_rows: Sequence[slice],
        bias: bool,
        group: TPGroup,
    ) -> None:
        super().__init__(in_features, sum(map(slice_len, part_rows)), bias=bias)
        self.group = group
        self.part_sizes = tuple(part_sizes)
        """Full rows of each fused part, in order."""
        self.part_rows = tuple(part_rows)
        """This rank's rows of each part, within the part."""

    @classmethod
    def qkv(
        cls,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        group: TPGroup,
    ) -> ColumnParallelLinear:
        """A fused QKV projection holding the rank's heads (`sharding.local_heads`)."""
        heads = local_heads(num_heads, num_kv_heads, group.world_size, group.rank)
        kv_size = num_kv_heads * head_dim
        sizes = (num_heads * head_dim, kv_size, kv_size)
        return cls(hidden_size, sizes, qkv_rows(heads, head_dim), bias, group)

    @classmethod
    def merged(
        cls, in_features: int, part_sizes: Sequence[int], bias: bool, group: TPGroup
    ) -> ColumnParallelLinear:
        """Parts split evenly, e.g. gate and up, each of intermediate_size rows."""
        rows = [even_rows(size, group.world_size, group.rank) for size in part_sizes]
        return cls(in_features, part_sizes, rows, bias, group)

    def local_rows(self, part: int) -> slice:
        """Where part `part` sits in this rank's fused weight (the loader's stacked rows)."""
        start = sum(map(slice_len, self.part_rows[:part]))
        return slice(start, start + slice_len(self.part_rows[part]))

    def shard_part(self, part: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of one checkpoint tensor of part `part` (e.g. k_proj)."""
        return full[self.part_rows[part]]

    @torch.no_grad()
    def load_shard(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Keep this rank's rows of the full fused weight (and bias)."""
        self.weight.copy_(column_shard(weight, self.part_sizes, self.part_rows))
        if self.bias is not None and bias is not None:
            self.bias.copy_(column_shard(bias, self.part_sizes, self.part_rows))


class RowParallelLinear(Linear):
    """A projection split by input columns (o_proj, down_proj): the rank multiplies its
    columns by the sharded activations it holds, and one all-reduce sums the partial
    outputs. The bias is rank 0's alone, so it is added once."""

    def __init__(self, in_columns: slice, out_features: int, bias: bool, group: TPGroup) -> None:
        super().__init__(slice_len(in_columns), out_features, bias=bias and group.rank == 0)
        self.group = group
        self.in_columns = in_columns
        """This rank's columns of the full weight."""

    @classmethod
    def for_heads(
        cls,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        out_features: int,
        bias: bool,
        group: TPGroup,
    ) -> RowParallelLinear:
        """o_proj over the rank's query heads (those of `ColumnParallelLinear.qkv`)."""
        heads = local_heads(num_heads, num_kv_heads, group.world_size, group.rank)
        return cls(heads.q_rows(head_dim), out_features, bias, group)

    @classmethod
    def even(
        cls, in_features: int, out_features: int, bias: bool, group: TPGroup
    ) -> RowParallelLinear:
        """Columns split evenly, e.g. down_proj after a `ColumnParallelLinear.merged`."""
        return cls(even_rows(in_features, group.world_size, group.rank), out_features, bias, group)

    @torch.no_grad()
    def load_shard(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Keep this rank's columns of the full weight, and the bias on rank 0."""
        self.weight.copy_(row_shard(weight, self.in_columns))
        local_bias = None if bias is None else row_shard_bias(bias, self.group.rank)
        if self.bias is not None and local_bias is not None:
            self.bias.copy_(local_bias)

    def local_forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial output, before the all-reduce (LoRA adds its own partial
        update here, so the one all-reduce sums both)."""
        return super().forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_(self.group, self.local_forward(x))


class ParallelExperts(Experts):
    """A sparse MoE layer's experts with each expert's SwiGLU split like the dense MLP
    (vLLM's layout without expert parallelism): the rank keeps its rows of every expert's
    gate and up and the matching columns of its down, runs the routed tokens through its
    slice of every expert, and one all-reduce sums the partial outputs. The router stays
    whole on every rank, so with the same input every rank routes each token alike."""

    def __init__(self, num_experts: int, hidden_size: int, inner_size: int, group: TPGroup) -> None:
        inner_rows = even_rows(inner_size, group.world_size, group.rank)
        super().__init__(num_experts, hidden_size, slice_len(inner_rows))
        self.group = group
        self.full_inner_size = inner_size
        self.inner_rows = inner_rows
        """This rank's rows of each expert's gate and of its up (its columns of down)."""

    def shard_gate_up(self, full: TensorSource) -> torch.Tensor:
        """The rank's part of the `[experts, 2 * inner, hidden]` stack (gate rows, then
        up): its gate rows, then its up rows, of every expert."""
        up_rows = slice(
            self.full_inner_size + self.inner_rows.start,
            self.full_inner_size + self.inner_rows.stop,
        )
        return torch.cat((full[:, self.inner_rows], full[:, up_rows]), dim=1)

    def shard_down(self, full: TensorSource) -> torch.Tensor:
        """The rank's columns of the `[experts, hidden, inner]` stack."""
        return full[:, :, self.inner_rows]

    @torch.no_grad()
    def load_shard(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Keep this rank's part of the full stacked expert weights."""
        self.gate_up_proj.copy_(self.shard_gate_up(gate_up))
        self.down_proj.copy_(self.shard_down(down))

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, ops: LayerOps
    ) -> torch.Tensor:
        return all_reduce_(self.group, super().forward(x, topk_weights, topk_ids, ops))


class VocabParallelEmbedding(nn.Embedding):
    """Token embeddings split by vocabulary rows (`sharding.vocab_shard`): each rank looks
    up the ids in its rows, zeroes the others, and one all-reduce assembles every row."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup) -> None:
        shard = vocab_shard(vocab_size, group.world_size, group.rank)
        # An empty `_weight` skips the random init, as `LlamaModel` does: weights are loaded.
        super().__init__(shard.rows, hidden_size, _weight=torch.empty(shard.rows, hidden_size))
        self.group = group
        self.shard = shard

    @torch.no_grad()
    def load_shard(self, weight: torch.Tensor) -> None:
        """Keep this rank's rows of the full [vocab, hidden] matrix, zero-padded."""
        self.weight.copy_(vocab_rows(weight, self.shard))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return super().forward(input_ids)
        local = input_ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.num_real)
        embeds = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce_(self.group, embeds.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(LogitsHead):
    """The logits head over a vocabulary-parallel weight (the rank's `shard_weight` rows:
    its lm_head shard, or a tied model's `VocabParallelEmbedding` weight, the same rows):
    each rank computes its vocabulary's logits and rank 0 gathers the full rows.

    A gather rather than a distributed argmax or top-k: the sampler needs each row whole
    for top-p, min-p, penalties, grammar masks and logprobs, and a gather of
    [tokens, vocab / N] fp32 per rank costs little beside the step. Ranks other than 0 get
    an empty [tokens, 0] tensor, so the model's `compute_logits` keeps one return type."""

    def __init__(self, vocab_size: int, group: TPGroup) -> None:
        super().__init__()
        self.group = group
        self.shard = vocab_shard(vocab_size, group.world_size, group.rank)

    def shard_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the full [vocab, hidden] head, zero-padded: what the model
        keeps as its head weight."""
        return vocab_rows(weight, self.shard)

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        local = super().__call__(hidden, weight)
        logits = gather_to_rank0(self.group, local, dim=-1)
        if logits is None:
            return local[:, :0]
        if logits.shape[-1] == self.shard.vocab_size:
            return logits
        return logits[:, : self.shard.vocab_size].contiguous()  # drop the padding rows' logits
