"""A real TP group of 2 ranks on CPU (gloo, spawned processes on a loopback port): each
parallel layer computes what its dense counterpart does, the collectives deliver what
they promise, and a dead rank makes the survivor's collective raise instead of hanging.

Each check runs inside the ranks; a rank that fails writes its traceback for the test to
show. All ranks seed alike, so each builds the same full weights and takes its shard.
Outputs match the dense layer's within fp32 rounding (atol 1e-5, rtol 1e-6): a sharded
matmul adds its products in another order.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch
import torch.nn.functional as F

from gpu_worker.distributed.comm import all_reduce_, broadcast_step, gather_to_rank0
from gpu_worker.distributed.group import TPConfig, TPGroup, init_tp_group
from gpu_worker.distributed.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from gpu_worker.distributed.sharding import local_heads
from tests.helpers.processes import free_port

WORLD = 2
DEAD_RANK_TIMEOUT_S = 5.0

RankCheck = Callable[[TPGroup], None]


def rank_main(check: RankCheck, rank: int, port: int, timeout_s: float, errors: Path) -> None:
    """One rank: join the group, run `check`, leave; a failure's traceback goes to a file."""
    torch.set_num_threads(1)  # two ranks on a shared 2-core box
    config = TPConfig(WORLD, rank, rank, f"127.0.0.1:{port}", timeout_s=timeout_s)
    try:
        group = init_tp_group(config, torch.device("cpu"))
        try:
            check(group)
        finally:
            group.destroy()
    except BaseException:
        (errors / f"rank{rank}.txt").write_text(traceback.format_exc())
        raise


def run_ranks(check: RankCheck, tmp_path: Path, timeout_s: float, wall_s: float) -> None:
    """Run `check` on every rank of a fresh group; fail with each failing rank's traceback,
    or when a rank is still running after `wall_s` (it is killed)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    ranks = [
        ctx.Process(target=rank_main, args=(check, rank, port, timeout_s, tmp_path))
        for rank in range(WORLD)
    ]
    for process in ranks:
        process.start()
    try:
        deadline = time.monotonic() + wall_s
        for process in ranks:
            process.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, process in enumerate(ranks) if process.is_alive()]
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join()
    failures = [path.read_text() for path in sorted(tmp_path.glob("rank*.txt"))]
    assert failures == [], "\n".join(failures)
    assert hung == [], f"ranks {hung} were still running after {wall_s} s"
    assert [process.exitcode for process in ranks] == [0] * WORLD


def check_layers(group: TPGroup) -> None:
    # Its own generator: the layers' init draws from the global one, by the rank's shapes.
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    hidden, head_dim, inner, vocab, tokens = 12, 4, 9, 11, 5
    x = randn(tokens, hidden)
    # 6/3: KV heads split unevenly (1 and 2); 4/1: the one KV head replicated on both.
    for heads, kv_heads in ((6, 3), (4, 1)):
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        weight, bias = randn(q_size + 2 * kv_size, hidden), randn(q_size + 2 * kv_size)
        qkv = ColumnParallelLinear.qkv(hidden, heads, kv_heads, head_dim, True, group)
        qkv.load_shard(weight, bias)
        q, k, v = F.linear(x, weight, bias).split([q_size, kv_size, kv_size], dim=1)
        shard = local_heads(heads, kv_heads, WORLD, group.rank)
        kv_rows = shard.kv_rows(head_dim)
        expected = torch.cat((q[:, shard.q_rows(head_dim)], k[:, kv_rows], v[:, kv_rows]), 1)
        torch.testing.assert_close(qkv(x), expected, atol=1e-5, rtol=1e-6)

        o_weight, o_bias = randn(hidden, q_size), randn(hidden)
        attn_out = randn(tokens, q_size)
        o_proj = RowParallelLinear.for_heads(heads, kv_heads, head_dim, hidden, True, group)
        o_proj.load_shard(o_weight, o_bias)
        assert (o_proj.bias is not None) == group.is_driver
        local_out = o_proj(attn_out[:, shard.q_rows(head_dim)])
        torch.testing.assert_close(
            local_out, F.linear(attn_out, o_weight, o_bias), atol=1e-5, rtol=1e-6
        )

    gate_up, down = randn(2 * inner, hidden), randn(hidden, inner)
    gate_up_proj = ColumnParallelLinear.merged(hidden, (inner, inner), False, group)
    gate_up_proj.load_shard(gate_up)
    down_proj = RowParallelLinear.even(inner, hidden, False, group)
    down_proj.load_shard(down)
    gate, up = gate_up_proj(x).chunk(2, dim=1)  # the rank's gate rows, then its up rows
    dense_gate, dense_up = F.linear(x, gate_up).chunk(2, dim=1)
    dense_mlp = F.linear(F.silu(dense_gate) * dense_up, down)
    torch.testing.assert_close(down_proj(F.silu(gate) * up), dense_mlp, atol=1e-5, rtol=1e-6)

    table = randn(vocab, hidden)  # 11 rows: rank 1's shard ends in a padding row
    embed = VocabParallelEmbedding(vocab, hidden, group)
    embed.load_shard(table)
    ids = torch.tensor([0, 5, 6, 10, 3, 10])
    torch.testing.assert_close(embed(ids), table[ids], atol=0, rtol=0)
    head = ParallelLMHead(vocab, group)
    logits = head(x, embed.weight)  # tied: the embedding's shard is the head's
    if group.is_driver:
        torch.testing.assert_close(logits, x @ table.T, atol=1e-5, rtol=1e-6)
    else:
        assert logits.shape == (tokens, 0)


def check_collectives(group: TPGroup) -> None:
    summed = all_reduce_(group, torch.full((3,), float(group.rank + 1)))
    assert summed.tolist() == [3.0, 3.0, 3.0]

    # A step description as the engine will send it: msgspec bytes, longer than 255.
    steps = [msgspec.msgpack.encode({"token_ids": list(range(300)), "step": 7}), b"", b"\x00"]
    for step in steps:
        received = broadcast_step(group, step if group.is_driver else None)
        assert received == step
    if not group.is_driver:
        with pytest.raises(ValueError, match="only rank 0"):
            broadcast_step(group, b"not mine")

    shard = torch.arange(6.0).view(2, 3) + 10 * group.rank
    for dim, shape in ((-1, (2, 6)), (0, (4, 3))):
        gathered = gather_to_rank0(group, shard, dim)
        if group.is_driver:
            assert gathered is not None
            expected = torch.cat(
                (torch.arange(6.0).view(2, 3), torch.arange(6.0).view(2, 3) + 10), dim
            )
            assert gathered.shape == shape
            assert torch.equal(gathered, expected)
        else:
            assert gathered is None


def check_dead_rank(group: TPGroup) -> None:
    all_reduce_(group, torch.ones(1))  # both ranks are up
    if not group.is_driver:
        os._exit(0)  # dies without leaving the group, as a killed rank would
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        all_reduce_(group, torch.ones(1))
    assert time.monotonic() - start < DEAD_RANK_TIMEOUT_S + 5


def check_stalled_rank(group: TPGroup) -> None:
    all_reduce_(group, torch.ones(1))
    if not group.is_driver:
        # Alive with its sockets open (stuck, or a node gone without a reset): only the
        # timeout can tell. It outlives rank 0's wait, at most the timeout + 5 s.
        time.sleep(DEAD_RANK_TIMEOUT_S + 5)
        os._exit(0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="[Tt]imed out"):
        all_reduce_(group, torch.ones(1))
    assert DEAD_RANK_TIMEOUT_S - 1 < time.monotonic() - start < DEAD_RANK_TIMEOUT_S + 5


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_parallel_layers_match_dense(tmp_path: Path) -> None:
    run_ranks(check_layers, tmp_path, timeout_s=30.0, wall_s=75.0)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_collectives_over_two_ranks(tmp_path: Path) -> None:
    run_ranks(check_collectives, tmp_path, timeout_s=30.0, wall_s=75.0)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_dead_rank_fails_the_collective_within_the_timeout(tmp_path: Path) -> None:
    run_ranks(check_dead_rank, tmp_path, timeout_s=DEAD_RANK_TIMEOUT_S, wall_s=75.0)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_stalled_rank_fails_the_collective_at_the_timeout(tmp_path: Path) -> None:
    run_ranks(check_stalled_rank, tmp_path, timeout_s=DEAD_RANK_TIMEOUT_S, wall_s=75.0)
