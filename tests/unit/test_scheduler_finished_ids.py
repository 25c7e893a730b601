"""SchedulerOutput.finished_request_ids: who left the running set since the last schedule().

The runner and the sampler free their per-request rows from these ids, so each departure
(finish, abort, preemption) must be reported exactly once, in the next output.
"""

from __future__ import annotations

from gpu_worker.core.config import CacheConfig, SchedulerConfig
from gpu_worker.core.kv_cache import KVCacheManager
from gpu_worker.core.scheduler import Scheduler, SchedulerOutput
from gpu_worker.core.sequence import FinishReason, Sequence
from shared.sampling import SamplingParams
from tests.helpers.runner_output import runner_output

BS = 16


def _scheduler(num_blocks: int = 64) -> Scheduler:
    kv = KVCacheManager(CacheConfig(block_size=BS, num_blocks=num_blocks))
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1024)
    return Scheduler(config, kv, eos_token_ids=[2])


def _seq(request_id: str, prompt_len: int, max_tokens: int) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Sequence(request_id, [10 + i % 50 for i in range(prompt_len)], params, block_size=BS)


def _step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sched.update(
        out, runner_output({s.seq.request_id: 1000 for s in out.scheduled if s.will_sample})
    )
    return out


def test_finished_and_aborted_ids_are_handed_out_once() -> None:
    sched = _scheduler()
    a, b, c = _seq("a", 20, max_tokens=1), _seq("b", 20, max_tokens=5), _seq("c", 20, 5)
    for seq in (a, b, c):
        sched.add(seq)
    assert _step(sched).finished_request_ids == []  # a finishes in this step's update
    sched.finish_requests(["b"], FinishReason.ABORT)  # running: reported
    out = _step(sched)
    assert out.finished_request_ids == ["a", "b"]
    assert [s.seq.request_id for s in out.scheduled] == ["c"]
    assert _step(sched).finished_request_ids == []  # once only


def test_waiting_abort_is_not_reported_it_never_ran() -> None:
    sched = _scheduler()
    sched.add(_seq("a", 20, max_tokens=5))
    sched.finish_requests(["a"], FinishReason.ABORT)
    assert sched.schedule().finished_request_ids == []


def test_preempted_id_is_reported_in_the_step_that_preempts_it() -> None:
    # 6 blocks; three 30-token prompts take two each, then a needs a third: c goes.
    sched = _scheduler(num_blocks=6)
    for request_id in "abc":
        sched.add(_seq(request_id, 30, max_tokens=6))
    for _ in range(3):
        assert _step(sched).finished_request_ids == []
    out = _step(sched)
    assert [s.request_id for s in out.preempted] == ["c"]
    assert out.finished_request_ids == ["c"]
    # c comes back later under the same id; when it finishes it is reported again.
    reported: list[str] = []
    while sched.has_unfinished():
        reported += _step(sched).finished_request_ids
    reported += sched.schedule().finished_request_ids
    assert sorted(reported) == ["a", "b", "c"]
