"""Tensor-parallel sharding in one process: which heads and rows each rank holds, that
the ranks' shards recompose the dense layers exactly, the TP config, and the world-of-1
path of the collectives and layers (the 2-rank runs are
tests/integration/test_tp_collectives.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.distributed.comm import all_reduce_, broadcast_step, gather_to_rank0
from gpu_worker.distributed.group import TPConfig, TPGroup
from gpu_worker.distributed.layers import (
    ColumnParallelLinear,
    ParallelExperts,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from gpu_worker.distributed.sharding import (
    HeadShard,
    column_shard,
    even_rows,
    local_heads,
    qkv_rows,
    row_shard,
    row_shard_bias,
    vocab_rows,
    vocab_shard,
)
from gpu_worker.models.moe import Experts, route, stack_expert_weights
from gpu_worker.ops.layer_ops import TorchLayerOps

# (num_heads, num_kv_heads, world_size): even, uneven (the built-in SmolLM2's 9/3 over 2),
# replicated (fewer KV heads than ranks, evenly and not), MHA.
HEAD_LAYOUTS = [(8, 4, 2), (9, 3, 2), (4, 1, 2), (8, 2, 4), (6, 2, 3), (12, 4, 8), (4, 4, 4)]


def test_local_heads_match_vllm_where_heads_divide() -> None:
    # vLLM: H / W query heads per rank; KV heads split, or replicated with rank r holding
    # KV head r // (W / kv).
    assert local_heads(8, 4, 2, 1) == HeadShard(4, 4, 2, 2)
    assert [local_heads(8, 2, 4, r) for r in range(4)] == [
        HeadShard(0, 2, 0, 1),
        HeadShard(2, 2, 0, 1),
        HeadShard(4, 2, 1, 1),
        HeadShard(6, 2, 1, 1),
    ]
    assert [local_heads(4, 1, 2, r).kv_head_start for r in range(2)] == [0, 0]


def test_uneven_heads_split_by_kv_group() -> None:
    assert [local_heads(9, 3, 2, r) for r in range(2)] == [
        HeadShard(0, 3, 0, 1),
        HeadShard(3, 6, 1, 2),
    ]


@pytest.mark.parametrize(("heads", "kv_heads", "world"), HEAD_LAYOUTS)
def test_every_query_head_once_beside_its_kv_head(heads: int, kv_heads: int, world: int) -> None:
    shards = [local_heads(heads, kv_heads, world, r) for r in range(world)]
    covered = [h for s in shards for h in range(s.head_start, s.head_start + s.num_heads)]
    assert covered == list(range(heads))
    group = heads // kv_heads
    for s in shards:
        assert s.num_heads >= 1
        assert s.num_heads % s.num_kv_heads == 0  # a whole GQA ratio on every rank
        kv = range(s.kv_head_start, s.kv_head_start + s.num_kv_heads)
        assert all(h // group in kv for h in range(s.head_start, s.head_start + s.num_heads))


def test_impossible_head_splits_are_refused() -> None:
    with pytest.raises(ValueError, match="exceeds the model's 2 attention heads"):
        local_heads(2, 1, 4, 0)
    with pytest.raises(ValueError, match="do not group"):
        local_heads(9, 2, 2, 0)


def test_column_shard_takes_each_parts_rows() -> None:
    head_dim = 2
    heads = local_heads(4, 1, 2, 1)  # query heads 2-3, the replicated KV head 0
    weight = torch.arange(12.0).unsqueeze(1)  # row i holds i: q rows 0-7, k 8-9, v 10-11
    local = column_shard(weight, (8, 2, 2), qkv_rows(heads, head_dim))
    assert local.squeeze(1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="fused weight has 12 rows"):
        column_shard(weight, (8, 2, 1), qkv_rows(heads, head_dim))


def test_vocab_shards_pad_to_one_shape() -> None:
    weight = torch.randn(10, 3)
    shards = [vocab_shard(10, 4, r) for r in range(4)]
    assert [(s.start, s.rows, s.num_real) for s in shards] == [
        (0, 3, 3),
        (3, 3, 3),
        (6, 3, 3),
        (9, 3, 1),
    ]
    parts = [vocab_rows(weight, s) for s in shards]
    assert all(p.shape == (3, 3) for p in parts)
    assert torch.equal(parts[3][1:], torch.zeros(2, 3))
    assert torch.equal(torch.cat(parts)[:10], weight)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Unmasked GQA over all tokens: enough to check that heads meet their KV heads."""
    tokens = q.shape[0]
    q = q.view(tokens, -1, head_dim).transpose(0, 1)
    k = k.view(tokens, -1, head_dim).transpose(0, 1)
    v = v.view(tokens, -1, head_dim).transpose(0, 1)
    k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
    v = v.repeat_interleave(q.shape[0] // v.shape[0], dim=0)
    out = torch.softmax(q @ k.transpose(1, 2), dim=-1) @ v
    return out.transpose(0, 1).reshape(tokens, -1)


@pytest.mark.parametrize(("heads", "kv_heads", "world"), HEAD_LAYOUTS)
def test_sharded_attention_and_mlp_sum_to_dense(heads: int, kv_heads: int, world: int) -> None:
    """Each rank's column shards feed its row shards; the partial outputs, summed as the
    all-reduce would, are the dense block's output."""
    torch.manual_seed(0)
    hidden, head_dim, inner, tokens = 16, 4, 10, 5
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(q_size + 2 * kv_size, hidden)
    o_proj, o_bias = torch.randn(hidden, q_size), torch.randn(hidden)
    gate_up, down = torch.randn(2 * inner, hidden), torch.randn(hidden, inner)
    x = torch.randn(tokens, hidden)

    def block(
        qkv_w: torch.Tensor,
        o_w: torch.Tensor,
        o_b: torch.Tensor | None,
        gu_w: torch.Tensor,
        down_w: torch.Tensor,
        kv: int,
    ) -> torch.Tensor:
        q, k, v = F.linear(x, qkv_w).split([qkv_w.shape[0] - 2 * kv, kv, kv], dim=1)
        gate, up = F.linear(x, gu_w).chunk(2, dim=1)
        mlp = F.linear(F.silu(gate) * up, down_w)
        return F.linear(attention(q, k, v, head_dim), o_w, o_b) + mlp

    dense = block(qkv, o_proj, o_bias, gate_up, down, kv_size)
    total = torch.zeros_like(dense)
    for rank in range(world):
        shard = local_heads(heads, kv_heads, world, rank)
        inner_rows = even_rows(inner, world, rank)
        total += block(
            column_shard(qkv, (q_size, kv_size, kv_size), qkv_rows(shard, head_dim)),
            row_shard(o_proj, shard.q_rows(head_dim)),
            row_shard_bias(o_bias, rank),
            column_shard(gate_up, (inner, inner), (inner_rows, inner_rows)),
            row_shard(down, inner_rows),
            shard.num_kv_heads * head_dim,
        )
    torch.testing.assert_close(total, dense, atol=1e-4, rtol=1e-4)


def _experts_of(gate_up: torch.Tensor, down: torch.Tensor) -> Experts:
    experts = Experts(down.shape[0], down.shape[1], down.shape[2])
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
    return experts


@pytest.mark.parametrize(("inner", "world"), [(8, 2), (10, 3)])
def test_sharded_experts_sum_to_dense(inner: int, world: int) -> None:
    """Each rank's slice of every expert (its gate and up rows, its down columns), fed the
    same routing, gives a partial output; summed as the all-reduce would, the dense
    experts' output, also where the inner rows split unevenly (3, 3, 4)."""
    torch.manual_seed(0)
    num_experts, hidden, tokens = 4, 6, 7
    gate_up = torch.randn(num_experts, 2 * inner, hidden)
    down = torch.randn(num_experts, hidden, inner)
    x = torch.randn(tokens, hidden)
    weights, ids = route(torch.randn(tokens, num_experts), top_k=2, renormalize=True)
    ops = TorchLayerOps()
    dense = _experts_of(gate_up, down)(x, weights, ids, ops)
    total = torch.zeros_like(dense)
    for rank in range(world):
        group = TPGroup(rank=rank, world_size=world, device=torch.device("cpu"), backend="gloo")
        shard = ParallelExperts(num_experts, hidden, inner, group)
        shard.load_shard(gate_up, down)
        assert shard.down_proj.shape[-1] == len(range(inner)[shard.inner_rows])
        # The rank's partial sum, before the all-reduce `ParallelExperts.forward` adds.
        total += Experts.forward(shard, x, weights, ids, ops)
    torch.testing.assert_close(total, dense, atol=1e-5, rtol=1e-5)


class _LazySlice:
    """A checkpoint tensor as safetensors' `get_slice` gives it (not a tensor: indexing
    reads), counting the elements read."""

    def __init__(self, tensor: torch.Tensor, reads: list[int]) -> None:
        self.tensor, self.reads = tensor, reads

    def __getitem__(self, index: Any) -> torch.Tensor:
        part = self.tensor[index]
        self.reads.append(part.numel())
        return part.clone()

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)


@pytest.mark.parametrize("per_expert", [True, False], ids=["per-expert", "all-experts"])
def test_lazy_expert_stacks_read_only_a_ranks_slice(per_expert: bool) -> None:
    """Lazy expert tensors, per expert (HF) or one per projection (GGUF's 3-D layout),
    stack unread; the rank's shard of the stacks equals the shard of the eager stacks, and
    only its rows (gate, up) and columns (down) are read, once each."""
    torch.manual_seed(0)
    num_experts, hidden, inner = 3, 5, 7
    parts = {
        "gate_proj": torch.randn(num_experts, inner, hidden),
        "up_proj": torch.randn(num_experts, inner, hidden),
        "down_proj": torch.randn(num_experts, hidden, inner),
    }
    prefix = "model.layers.0.mlp.experts"
    if per_expert:
        checkpoint = [
            (f"{prefix}.{e}.{part}.weight", w[e])
            for e in range(num_experts)
            for part, w in parts.items()
        ]
    else:
        checkpoint = [(f"{prefix}.{part}.weight", w) for part, w in parts.items()]
    eager = dict(stack_expert_weights(checkpoint, num_experts))
    reads: list[int] = []
    lazy_checkpoint: list[tuple[str, Any]] = [
        (name, _LazySlice(tensor, reads)) for name, tensor in checkpoint
    ]
    lazy = dict(stack_expert_weights(lazy_checkpoint, num_experts))
    assert reads == []
    group = TPGroup(rank=1, world_size=2, device=torch.device("cpu"), backend="gloo")
    shard = ParallelExperts(num_experts, hidden, inner, group)
    shard.load_shard(eager[f"{prefix}.gate_up_proj"], eager[f"{prefix}.down_proj"])
    gate_up = shard.shard_gate_up(lazy[f"{prefix}.gate_up_proj"])
    down = shard.shard_down(lazy[f"{prefix}.down_proj"])
    assert torch.equal(gate_up, shard.gate_up_proj)
    assert torch.equal(down, shard.down_proj)
    # Rank 1 of 2 holds 4 of the 7 inner rows.
    assert sum(reads) == 3 * num_experts * 4 * hidden
    with pytest.raises(TypeError, match="contiguous slices"):
        lazy[f"{prefix}.down_proj"][:, ::2]


def test_tp_config_from_torchrun_env() -> None:
    env = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.7",
        "MASTER_PORT": "29511",
    }
    config = TPConfig.from_env(env, timeout_s=5.0)
    assert config == TPConfig(8, 5, 1, "10.0.0.7:29511", 2, 1, 4, 5.0)
    assert config is not None
    assert config.for_local_rank(3).rank == 7
    assert TPConfig.from_env({}) is None
    ipv6 = TPConfig.from_env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "::1"})
    assert ipv6 is not None
    assert ipv6.address() == ("[::1]", 29500)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tensor_parallel_size": 2, "rank": 2, "local_rank": 2}, "outside a group of 2"),
        ({"tensor_parallel_size": 2, "rank": 1}, "not tp_rank_offset 0 \\+ local rank 0"),
        ({"dist_init_addr": "localhost"}, "is not HOST:PORT"),
        ({"tensor_parallel_size": 2, "nnodes": 3}, "cannot span 3 nodes"),
        ({"timeout_s": 0.0}, "must be positive"),
    ],
)
def test_tp_config_refuses_inconsistent_fields(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TPConfig(**fields)  # type: ignore[arg-type]


def test_world_of_one_is_dense_without_a_process_group() -> None:
    torch.manual_seed(0)
    group = TPGroup.single(torch.device("cpu"))
    x = torch.randn(3, 8)
    assert all_reduce_(group, x) is x
    assert gather_to_rank0(group, x) is x
    assert broadcast_step(group, b"step") == b"step"

    qkv = ColumnParallelLinear.qkv(8, 4, 2, 2, bias=True, group=group)
    weight, bias = torch.randn(16, 8), torch.randn(16)
    qkv.load_shard(weight, bias)
    torch.testing.assert_close(qkv(x), F.linear(x, weight, bias))
    o_proj = RowParallelLinear.for_heads(4, 2, 2, 8, bias=False, group=group)
    o_weight = torch.randn(8, 8)
    o_proj.load_shard(o_weight)
    torch.testing.assert_close(o_proj(x), F.linear(x, o_weight))

    embed = VocabParallelEmbedding(11, 8, group)
    table = torch.randn(11, 8)
    embed.load_shard(table)
    ids = torch.tensor([0, 10, 4])
    assert torch.equal(embed(ids), table[ids])
    head = ParallelLMHead(11, group)
    torch.testing.assert_close(head(x, head.shard_weight(table)), x @ table.T)
