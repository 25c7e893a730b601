"""The ranks of a tensor-parallel engine: how rank 0 starts, leads and stops the others.

Every rank builds the same thing from the same `EngineConfig` (`gpu_worker.engine.rank`):
its shard of the model, a KV cache for its local KV heads, sized alike on every rank, and
a runner. Rank 0 is the `Engine` in the driver process: `TPLeader` spawns its node's other
ranks, each running `follower_main` until rank 0's stop message, and wraps `lead_step`
so a dead rank surfaces as a `TPRankFailed` naming it; a follower that fails at start-up
sends rank 0 its traceback, which rank 0 raises. A node other than node 0 runs only
followers (`run_follower_node`), started by `gpu-worker --node-rank N`.

A follower that fails before it joins the group is reported once rank 0's rendezvous
times out (`dist_timeout_s`): joining cannot be interrupted.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, TypeAlias

import torch

from gpu_worker.core.config import EngineConfig
from gpu_worker.core.scheduler import ScheduledSequence
from gpu_worker.distributed.group import TPConfig, TPGroup, init_tp_group, rank_device
from gpu_worker.engine.profile_sampling import follow_profile_scoring
from gpu_worker.engine.rank import attach_lora_slots, build_runner, load_rank_model
from gpu_worker.engine.tp_step import IdleKeepAlive, follower_loop, lead_step, stop_followers
from gpu_worker.lora.manager import LoRAMirror, LoRARegistry
from gpu_worker.runner.device import resolve_device
from gpu_worker.runner.model_runner import ModelRunner, RunnerOutput
from shared.model_source import resolve_model

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

logger = logging.getLogger(__name__)

STOP_WAIT_S = 10.0
"""How long rank 0 waits for a stopped follower to exit before killing it."""

KEEP_ALIVE_FRACTION = 0.25
"""An idle rank 0 messages its followers at least this often, in group timeouts."""


class TPRankFailed(RuntimeError):
    """A rank of the group died or failed; the engine cannot step any more."""


def resolve_tp_config(config: EngineConfig, environ: Mapping[str, str]) -> TPConfig:
    """This node's first rank: torchrun's variables when present, else the flags. Without
    `dist_init_addr` a single node rendezvouses on a free loopback port."""
    from_env = TPConfig.from_env(environ, timeout_s=config.dist_timeout_s)
    if from_env is not None:
        return from_env
    per_node = config.tensor_parallel_size // config.nnodes
    offset = config.node_rank * per_node if config.tp_rank_offset is None else config.tp_rank_offset
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
                source = resolve_model(config.model, config.served_model_name)
                rank = load_rank_model(config, source, group)
                attached = attach_lora_slots(config, rank)
                post_forward = follow_profile_scoring(rank.model.compute_logits)
                if attached is None:
                    runner = build_runner(config, rank, group, post_forward)
                    follower_loop(runner, group)
                else:
                    slots, state = attached
                    runner = build_runner(config, rank, group, post_forward, (None, state))
                    follower_loop(runner, group, LoRAMirror(slots, rank.model_config))
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
        self._group: TPGroup | None = None
        self._keep_alive: IdleKeepAlive | None = None
        self._timeout_s = tp_config.timeout_s
        with self.starting():
            device = rank_device(resolve_device(config.device).type, 0)
            self._group = init_tp_group(tp_config, device)

    @property
    def group(self) -> TPGroup:
        """The group rank 0 leads; gone after `close`."""
        if self._group is None:
            raise RuntimeError("the tensor-parallel group is closed")
        return self._group

    @contextmanager
    def starting(self) -> Iterator[None]:
        """Rank 0's part of the group's start-up (joining, loading, building the runner):
        on any failure, stop the group, and when a follower failed first (a rank 0 in a
        collective sees only that its peer left), raise `TPRankFailed` with its error."""
        try:
            yield
        except Exception as exc:
            failure = self._failure(wait_s=2.0)
            self.close()
            if failure is not None:
                raise TPRankFailed(f"at start-up: {failure}") from exc
            raise

    def started(self) -> None:
        """Every rank has built its runner and waits for steps: from now on an idle rank 0
        keeps its followers waiting (`IdleKeepAlive`)."""
        if self._keep_alive is None:
            self._keep_alive = IdleKeepAlive(self.group, self._timeout_s * KEEP_ALIVE_FRACTION)

    def leading(self) -> contextlib.AbstractContextManager[None]:
        """Rank 0 runs collectives with its followers meanwhile (a step, and the gathers
        that score its prompts): no idle message goes out between them."""
        return contextlib.nullcontext() if self._keep_alive is None else self._keep_alive.sending()

    def step(
        self,
        runner: ModelRunner,
        scheduled: list[ScheduledSequence],
        released: list[str],
        lora: LoRARegistry | None = None,
    ) -> RunnerOutput:
        """`lead_step` over the group, inside `leading()`; a rank that died makes it raise
        `TPRankFailed`."""
        try:
            return lead_step(runner, self.group, scheduled, released, lora)
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
        if self._keep_alive is not None:
            self._keep_alive.stop()
        group, self._group = self._group, None
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
