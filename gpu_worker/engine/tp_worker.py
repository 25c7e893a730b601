"""The ranks of a tensor-parallel engine: how each is built, and how rank 0 starts, leads
and stops the others.

Every rank builds the same thing from the same `EngineConfig`: its shard of the model
(`load_model(tp_group=...)`), a KV cache for its local KV heads and a `ModelRunner`
(`build_rank`). The caches hold the same number of blocks on every rank, the smallest any
rank can afford (a MIN all-reduce), because rank 0's block ids index every rank's cache.
Rank 0 is the `Engine` in the driver process: `TPLeader` spawns its node's other ranks,
each running `follower_main` until rank 0's stop message, and wraps `lead_step` so a
dead rank surfaces as a `TPRankFailed` naming it. A node other than node 0 runs only
followers (`run_follower_node`), started by `gpu-worker --node-rank N`.

Not yet at TP > 1: the CUDA memory profile (the KV cache needs `kv_cache_memory_gb`),
CUDA graphs (steps run eagerly) and prompt logprobs (their scoring gathers outside a step).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, replace
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, TypeAlias

import torch
import torch.distributed as dist

from gpu_worker.attention.backend import (
    AttentionBackend,
    get_attention_backend,
    resolve_backend_name,
)
from gpu_worker.core.config import EngineConfig
from gpu_worker.core.scheduler import ScheduledSequence
from gpu_worker.distributed.group import TPConfig, TPGroup, init_tp_group, rank_device
from gpu_worker.distributed.sharding import local_heads
from gpu_worker.engine.tp_step import follower_loop, lead_step, stop_followers
from gpu_worker.loader import load_model
from gpu_worker.models.base import CausalLM
from gpu_worker.models.config import ModelConfig
from gpu_worker.ops.layer_ops import get_layer_ops
from gpu_worker.runner.device import resolve_device, resolve_dtype
from gpu_worker.runner.kv_caches import allocate_kv_caches, size_kv_cache
from gpu_worker.runner.model_runner import ModelRunner, RunnerOutput
from shared.model_source import resolve_model

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

logger = logging.getLogger(__name__)

STOP_WAIT_S = 10.0
"""How long rank 0 waits for a stopped follower to exit before killing it."""


class TPRankFailed(RuntimeError):
    """A rank of the group died or failed; the engine cannot step any more."""


def resolve_tp_config(config: EngineConfig, environ: Mapping[str, str]) -> TPConfig:
    """This node's first rank: torchrun's variables when present, else the flags. Without
    `dist_init_addr` a single node rendezvouses on a free loopback port."""
    from_env = TPConfig.from_env(environ, timeout_s=config.dist_timeout_s)
    if from_env is not None:
        return from_env
    per_node = config.tensor_parallel_size // config.nnodes
    offset = config.node_rank * per_node
    return TPConfig(
        tensor_parallel_size=config.tensor_parallel_size,
        rank=offset,
        local_rank=0,
        dist_init_addr=config.dist_init_addr or f"127.0.0.1:{_free_port()}",
        nnodes=config.nnodes,
        node_rank=config.node_rank,
        tp_rank_offset=offset,
        timeout_s=config.dist_timeout_s,
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RankParts:
    """What one rank built: its model shard (with the full model's config), its runner."""

    model: CausalLM
    model_config: ModelConfig
    runner: ModelRunner
    attn_backend: AttentionBackend
    dtype: torch.dtype


def build_rank(config: EngineConfig, group: TPGroup) -> RankParts:
    """Load this rank's shard on `group.device`, size its KV cache to the group's smallest
    block count and build its runner. A collective: every rank of the group calls it."""
    if group.device.type == "cuda" and config.kv_cache_memory_gb is None:
        raise ValueError("tensor parallelism on CUDA needs --kv-cache-memory-gb for now")
    device = group.device
    dtype = resolve_dtype(config.dtype, device)
    backend_name = resolve_backend_name(config.attention_backend, device)
    attn_backend = get_attention_backend(backend_name)
    source = resolve_model(config.model, config.served_model_name)
    model, mc = load_model(
        source,
        device,
        dtype,
        attn_backend,
        layer_ops=get_layer_ops(backend_name),
        gguf_kernels=config.cpu_gguf_kernels,
        max_model_len=config.max_model_len,
        tp_group=group,
    )
    heads = local_heads(mc.num_heads, mc.num_kv_heads, group.world_size, group.rank)
    local_mc = replace(mc, num_kv_heads=heads.num_kv_heads)
    budget = size_kv_cache(local_mc, config, device, dtype, None)
    num_blocks = torch.tensor([budget.num_blocks], dtype=torch.int64, device=device)
    dist.all_reduce(num_blocks, op=dist.ReduceOp.MIN, group=group.device_group)
    kv_caches = allocate_kv_caches(
        mc.num_layers,
        int(num_blocks.item()),
        config.block_size,
        heads.num_kv_heads,
        mc.head_dim,
        dtype,
        device,
    )
    runner = ModelRunner(model, attn_backend, kv_caches, config.block_size, device)
    attn_backend.tune(
        local_mc,
        kv_caches[0],
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.context_limit(mc.max_position_embeddings),
    )
    return RankParts(model, mc, runner, attn_backend, dtype)


# A string: multiprocessing's Queue is generic to type checkers only.
ErrorQueue: TypeAlias = "Queue[tuple[int, str]]"


def follower_main(config: EngineConfig, tp_config: TPConfig, errors: ErrorQueue) -> None:
    """A follower process: join, build the rank, follow rank 0's steps until its stop.
    A failure's traceback goes to `errors` for rank 0 to report, and the exit is non-zero."""
    try:
        device = rank_device(resolve_device(config.device).type, tp_config.local_rank)
        group = init_tp_group(tp_config, device)
        try:
            with torch.inference_mode():
                follower_loop(build_rank(config, group).runner, group)
        finally:
            group.destroy()
    except BaseException:
        errors.put((tp_config.rank, traceback.format_exc()))
        raise SystemExit(1) from None


def _spawn(
    config: EngineConfig, tp_config: TPConfig, local_ranks: range, errors: ErrorQueue
) -> list[BaseProcess]:
    ctx = mp.get_context("spawn")  # fork would copy rank 0's threads and CUDA state
    processes: list[BaseProcess] = []
    for local_rank in local_ranks:
        process = ctx.Process(
            target=follower_main,
            args=(config, tp_config.for_local_rank(local_rank), errors),
            name=f"tp-rank-{tp_config.tp_rank_offset + local_rank}",
            daemon=True,
        )
        process.start()
        processes.append(process)
    return processes


class TPLeader:
    """Rank 0 of a group on this node: its own shard, the node's follower processes, and
    the step it leads. `close` stops the followers; any failure names the failed rank."""

    def __init__(self, config: EngineConfig) -> None:
        tp_config = resolve_tp_config(config, os.environ)
        if tp_config.rank != 0:
            raise ValueError("the engine is rank 0; start other nodes with --node-rank")
        per_node = config.tensor_parallel_size // tp_config.nnodes
        ctx = mp.get_context("spawn")
        self.errors: ErrorQueue = ctx.Queue()
        self.processes = _spawn(config, tp_config, range(1, per_node), self.errors)
        self.group: TPGroup | None = None
        try:
            device = rank_device(resolve_device(config.device).type, 0)
            self.group = init_tp_group(tp_config, device)
            self.parts = build_rank(config, self.group)
        except Exception as exc:
            failure = self._failure(wait_s=2.0)
            self.close()
            if failure is not None:
                raise TPRankFailed(f"at start-up: {failure}") from exc
            raise

    def step(self, scheduled: list[ScheduledSequence], released: list[str]) -> RunnerOutput:
        """`lead_step` over the group; a rank that died makes it raise `TPRankFailed`."""
        assert self.group is not None, "stepped after close"
        try:
            return lead_step(self.parts.runner, self.group, scheduled, released)
        except Exception as exc:
            failure = self._failure(wait_s=1.0) or f"a collective failed: {exc}"
            raise TPRankFailed(f"tensor-parallel group lost a rank: {failure}") from exc

    def _failure(self, wait_s: float) -> str | None:
        """Which rank failed and how: its traceback if it sent one, else its exit code."""
        try:
            rank, trace = self.errors.get(timeout=wait_s)
            return f"rank {rank} failed:\n{trace}"
        except queue.Empty:
            pass
        for process in self.processes:
            if process.exitcode is not None:
                return f"{process.name} (pid {process.pid}) exited with code {process.exitcode}"
        return None

    def close(self) -> None:
        """Stop the followers (idempotent): the stop message, then a kill for any rank
        still running after `STOP_WAIT_S`; then leave the group."""
        group, self.group = self.group, None
        if group is not None:
            try:
                stop_followers(group)
            except Exception:  # a dead rank: the others are killed below
                logger.warning("could not send the stop message to every follower")
        for process in self.processes:
            process.join(STOP_WAIT_S)
            if process.is_alive():
                process.kill()
                process.join()
        if group is not None:
            group.destroy()


def run_follower_node(config: EngineConfig) -> int:
    """A node other than node 0: run its ranks, all followers, until rank 0 stops them.
    Returns 0 when every rank ended cleanly, else 1 (each failure is logged)."""
    tp_config = resolve_tp_config(config, os.environ)
    per_node = config.tensor_parallel_size // tp_config.nnodes
    errors: ErrorQueue = mp.get_context("spawn").Queue()
    processes = _spawn(config, tp_config, range(per_node), errors)
    for process in processes:
        process.join()
    while True:
        try:
            rank, trace = errors.get(timeout=0.5)
        except queue.Empty:
            break
        logger.error("rank %d failed:\n%s", rank, trace)
    return 0 if all(process.exitcode == 0 for process in processes) else 1
