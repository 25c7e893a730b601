"""Tensor-parallel sharding in one process: which heads and rows each rank holds, that
the ranks' shards recompose the dense layers exactly, the TP config, and the world-of-1
path of the collectives and layers (the 2-rank runs are
tests/integration/test_tp_collectives.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.distributed.comm import all_reduce_, broadcast_step, gather_to_rank0
from gpu_worker.distributed.group import TPConfig, TPGroup
from gpu_worker.distributed.layers import (
    ColumnParallelLinear,
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
