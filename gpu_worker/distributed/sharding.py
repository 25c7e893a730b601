"""How each weight of a tensor-parallel model is split over the ranks of a TP group.

Pure functions of sizes and tensors, no process group: the loader calls them on each
checkpoint tensor, and tests check them in one process.

- Column-parallel (q/k/v, gate/up): a rank keeps some output rows. A fused projection is
  split part by part, so a rank's fused rows are its q rows, then its k rows, then its v
  rows, and its layer needs no communication: its output is exactly the input of its
  row-parallel partner.
- Row-parallel (o_proj, down_proj): a rank keeps the input columns its column-parallel
  partner produces; the ranks' outputs are partial sums, added by one all-reduce. The bias
  is added once, on rank 0.
- Vocabulary-parallel (embedding, LM head): a rank keeps `ceil(vocab / world)` rows, the
  last rank's padded with zero rows, so every shard has one shape (a gather needs that).

Attention heads are split by KV group, so a rank's query heads always attend to KV heads
it holds. With at least as many KV heads as ranks, rank r holds KV heads
`[r * kv // world, (r + 1) * kv // world)` and their query heads. With fewer, KV heads are
replicated as vLLM does: rank r holds KV head `r * kv // world`, and the ranks sharing a
KV head split its query heads. Where heads and KV heads divide by the world this is
vLLM's layout exactly; vLLM refuses the rest (e.g. 9 heads and 3 KV heads over 2 ranks,
the built-in SmolLM2), which here split unevenly (rank 0: 1 KV head and 3 query heads,
rank 1: 2 and 6). Only fewer query heads than ranks is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def even_rows(size: int, world_size: int, rank: int) -> slice:
    """Rank `rank`'s share of `size` rows: sizes differ by at most one, the larger last."""
    return slice(rank * size // world_size, (rank + 1) * size // world_size)


def slice_len(rows: slice) -> int:
    """Rows in a `slice(start, stop)` as these functions build them."""
    return int(rows.stop) - int(rows.start)


@dataclass(frozen=True)
class HeadShard:
    """One rank's attention heads: a contiguous run of query heads and of KV heads."""

    head_start: int
    """Global index of the rank's first query head."""
    num_heads: int
    """Query heads the rank computes."""
    kv_head_start: int
    """Global index of the rank's first KV head (the one it holds, when replicated)."""
    num_kv_heads: int
    """KV heads the rank holds (and caches)."""

    def q_rows(self, head_dim: int) -> slice:
        """The rank's rows of q_proj (and columns of o_proj)."""
        return slice(self.head_start * head_dim, (self.head_start + self.num_heads) * head_dim)

    def kv_rows(self, head_dim: int) -> slice:
        """The rank's rows of k_proj and of v_proj."""
        start = self.kv_head_start * head_dim
        return slice(start, start + self.num_kv_heads * head_dim)


def local_heads(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> HeadShard:
    """Rank `rank`'s heads (see the module docstring for the rule)."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} attention heads do not group over {num_kv_heads} KV heads")
    if num_heads < world_size:
        raise ValueError(
            f"tensor parallel size {world_size} exceeds the model's {num_heads} attention "
            "heads: every rank needs at least one"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size}")
    group = num_heads // num_kv_heads
    if num_kv_heads >= world_size:
        kv = even_rows(num_kv_heads, world_size, rank)
        return HeadShard(kv.start * group, slice_len(kv) * group, kv.start, slice_len(kv))
    kv_head = rank * num_kv_heads // world_size
    sharers = [r for r in range(world_size) if r * num_kv_heads // world_size == kv_head]
    # num_heads >= world_size makes group >= len(sharers): every sharer gets a head.
    q = even_rows(group, len(sharers), rank - sharers[0])
    return HeadShard(kv_head * group + q.start, slice_len(q), kv_head, 1)


def qkv_rows(heads: HeadShard, head_dim: int) -> tuple[slice, slice, slice]:
    """The rank's rows of q_proj, k_proj and v_proj, each within its own part."""
    kv = heads.kv_rows(head_dim)
    return heads.q_rows(head_dim), kv, kv


def column_shard(
    weight: torch.Tensor, part_sizes: Sequence[int], part_rows: Sequence[slice]
) -> torch.Tensor:
    """The rank's rows of a fused column-parallel weight (or bias): `weight` stacks parts
    of `part_sizes` rows; the result stacks each part's `part_rows`, in order."""
    if weight.shape[0] != sum(part_sizes):
        raise ValueError(f"fused weight has {weight.shape[0]} rows, parts {list(part_sizes)}")
    parts = weight.split(list(part_sizes), dim=0)
    return torch.cat([part[rows] for part, rows in zip(parts, part_rows, strict=True)])


def row_shard(weight: torch.Tensor, columns: slice) -> torch.Tensor:
    """The rank's input columns of a row-parallel [out, in] weight."""
    return weight[:, columns]


def row_shard_bias(bias: torch.Tensor, rank: int) -> torch.Tensor | None:
    """A row-parallel bias lives on rank 0 only: the all-reduce would add it once per rank."""
    return bias if rank == 0 else None


@dataclass(frozen=True)
class VocabShard:
    """One rank's rows of the vocabulary: `[start, start + rows)`, the rows past
    `vocab_size` zero padding."""

    start: int
    rows: int
    """Rows every rank holds: ceil(vocab_size / world_size)."""
    vocab_size: int

    @property
    def num_real(self) -> int:
        """Rows that are real tokens; the rest of `rows` is padding."""
        return max(0, min(self.rows, self.vocab_size - self.start))


def vocab_shard(vocab_size: int, world_size: int, rank: int) -> VocabShard:
    """Rank `rank`'s rows of an embedding or LM head padded to a multiple of the world."""
    rows = -(-vocab_size // world_size)
    return VocabShard(rank * rows, rows, vocab_size)


def vocab_rows(weight: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """The rank's rows of a full [vocab, hidden] matrix, padded with zero rows."""
    if weight.shape[0] != shard.vocab_size:
        raise ValueError(f"vocabulary matrix has {weight.shape[0]} rows, not {shard.vocab_size}")
    real = weight[shard.start : shard.start + shard.num_real]
    if shard.num_real == shard.rows:
        return real
    padding = weight.new_zeros((shard.rows - shard.num_real, *weight.shape[1:]))
    return torch.cat((real, padding))
