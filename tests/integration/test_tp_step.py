"""The TP step over 2 real ranks (gloo, spawned processes): rank 0 schedules and leads each
step, rank 1 follows it, and both compute the same forward, until rank 0's stop message
ends rank 1's loop.

Both ranks hold the same full tiny model (not yet split: that is the loader's part), so a
rank that ran anything but rank 0's batch, or in another KV cache layout, would give other
logits. After every step each rank's logits and prompt hidden states go to rank 0, which
requires them bitwise equal.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from gpu_worker.distributed.comm import all_reduce_, gather_to_rank0
from gpu_worker.distributed.group import TPGroup
from gpu_worker.engine.tp_step import IdleKeepAlive, follower_loop, lead_step, stop_followers
from gpu_worker.runner.kv_caches import allocate_kv_caches
from gpu_worker.runner.model_runner import HostBatch, ModelRunner, RunnerOutput
from tests.helpers.runner_output import runner_output
from tests.integration.test_tp_collectives import run_ranks
from tests.unit.test_tp_step import BS, CONFIG, NUM_BLOCKS, busy_scheduler, greedy, tiny_model


class ComparingRunner(ModelRunner):
    """Sends every step's outputs to rank 0 right after running them; rank 0 counts the
    steps where a rank's differ from its own."""

    def __init__(self, group: TPGroup) -> None:
        model = tiny_model()
        shape = (NUM_BLOCKS, BS, CONFIG.num_kv_heads, CONFIG.head_dim)
        caches = allocate_kv_caches(CONFIG.num_layers, *shape, torch.float32, torch.device("cpu"))
        super().__init__(model, model.attn_backend, caches, BS, torch.device("cpu"))
        self.group = group
        self.num_mismatches = 0

    @torch.inference_mode()
    def execute_host(
        self, batch: HostBatch, adapter_slots: np.ndarray | None = None
    ) -> RunnerOutput:
        out = super().execute_host(batch, adapter_slots)
        parts = [out.logits.flatten()]
        if out.prompt_hidden is not None:
            parts.append(out.prompt_hidden.flatten())
        mine = torch.cat(parts)
        gathered = gather_to_rank0(self.group, mine, dim=0)
        if gathered is not None:
            lead, *others = gathered.chunk(self.group.world_size)
            self.num_mismatches += sum(not torch.equal(lead, other) for other in others)
        return out


def check_lead_and_follow(group: TPGroup) -> None:
    runner = ComparingRunner(group)
    if not group.is_driver:
        num_steps = follower_loop(runner, group)
        all_reduce_(group, torch.tensor([num_steps]))
        return
    scheduler = busy_scheduler(8, seed=2)
    num_steps = num_chunks = num_released = num_prompt_steps = 0
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        assert out.scheduled, "every step of this load schedules work"
        run = lead_step(runner, group, out.scheduled, out.finished_request_ids)
        num_steps += 1
        num_chunks += sum(not item.will_sample for item in out.scheduled)
        num_released += len(out.finished_request_ids)
        num_prompt_steps += run.prompt_hidden is not None
        scheduler.update(out, runner_output(greedy(out, run.logits)))
    stop_followers(group)
    total = all_reduce_(group, torch.tensor([num_steps]))
    assert runner.num_mismatches == 0, f"{runner.num_mismatches} of {num_steps} steps differ"
    assert int(total.item()) == 2 * num_steps, "the follower ran another number of steps"
    # The load did cover what the wire carries.
    assert num_chunks > 0
    assert num_released > 0
    assert num_prompt_steps > 0


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_followers_run_the_leaders_steps(tmp_path: Path) -> None:
    run_ranks(check_lead_and_follow, tmp_path, timeout_s=30.0, wall_s=75.0)


IDLE_TIMEOUT_S = 1.0


def check_idle_followers_keep_waiting(group: TPGroup) -> None:
    # A host group whose collectives time out after IDLE_TIMEOUT_S; the group it comes from
    # has a long timeout, so both ranks' start-ups cannot trip it.
    short = dist.new_group(backend="gloo", timeout=timedelta(seconds=IDLE_TIMEOUT_S))
    idle = TPGroup(group.rank, group.world_size, group.device, "gloo", short, short)
    if not idle.is_driver:
        assert follower_loop(ComparingRunner(idle), idle) == 0
        return
    keep_alive = IdleKeepAlive(idle, interval_s=IDLE_TIMEOUT_S / 4)
    time.sleep(4 * IDLE_TIMEOUT_S)  # idle: no request for four group timeouts
    keep_alive.stop()  # as TPLeader.close: the thread ends, then the stop message
    stop_followers(idle)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_an_idle_leader_keeps_its_followers_waiting(tmp_path: Path) -> None:
    run_ranks(check_idle_followers_keep_waiting, tmp_path, timeout_s=30.0, wall_s=45.0)
