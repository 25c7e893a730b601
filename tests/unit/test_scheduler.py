"""Scheduler: token budget, chunked prefill, preemption, aborts and stop conditions.

The model is faked: the "sampled" token is a function of the sequence, so runs are exact.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Callable

from gpu_worker.core.config import CacheConfig, SchedulerConfig
from gpu_worker.core.kv_cache import KVCacheManager
from gpu_worker.core.scheduler import Scheduler, SchedulerOutput
from gpu_worker.core.sequence import FinishReason, Sequence, SequenceStatus
from shared.model_card import SchedulingPolicy
from shared.sampling import SamplingParams
from tests.helpers.runner_output import runner_output

BS = 16
EOS = 2
TokenFn = Callable[[Sequence], int]


def next_token(seq: Sequence) -> int:
    """A deterministic fake model: count up from the last token, never hitting EOS."""
    return 1000 + seq.num_tokens


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    max_model_len: int = 4096,
    long_prefill_token_threshold: int | None = None,
    scheduling_policy: SchedulingPolicy = "fcfs",
) -> Scheduler:
    kv = KVCacheManager(CacheConfig(block_size=BS, num_blocks=num_blocks))
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
        scheduling_policy=scheduling_policy,
    )
    return Scheduler(config, kv, eos_token_ids=[EOS])


def make_seq(
    request_id: str, prompt_len: int, max_tokens: int = 4, priority: int = 0, **sampling: object
) -> Sequence:
    prompt = [10 + (i % 50) for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, **sampling)  # type: ignore[arg-type]
    return Sequence(request_id, prompt, params, priority=priority, block_size=BS)


def step(
    sched: Scheduler, token_fn: TokenFn = next_token
) -> tuple[SchedulerOutput, list[Sequence]]:
    out = sched.schedule()
    sampled = {s.seq.request_id: token_fn(s.seq) for s in out.scheduled if s.will_sample}
    return out, sched.update(out, runner_output(sampled))


def run_all(sched: Scheduler, token_fn: TokenFn = next_token, max_steps: int = 500) -> int:
    for num_steps in range(1, max_steps + 1):
        step(sched, token_fn)
        if not sched.has_unfinished():
            return num_steps
    raise AssertionError("did not finish")


def test_prefill_then_decode_until_max_tokens() -> None:
    sched = make_scheduler()
    seq = make_seq("a", 20, max_tokens=3)
    sched.add(seq)
    assert (sched.num_waiting, sched.num_running) == (1, 0)

    out, changed = step(sched)
    [item] = out.scheduled
    assert (item.num_computed_tokens, item.num_new_tokens, item.will_sample) == (0, 20, True)
    assert changed == [seq]
    assert seq.num_computed_tokens == 20
    assert seq.output_token_ids == [1020]

    out, _ = step(sched)
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled] == [(20, 1)]
    out, changed = step(sched)
    assert changed == [seq]
    assert seq.is_finished
    assert seq.finish_reason == FinishReason.LENGTH
    assert seq.status == SequenceStatus.FINISHED_LENGTH
    assert seq.output_token_ids == [1020, 1021, 1022]
    assert sched.num_running == 0
    assert sched.kv.num_free_blocks == 64
    assert seq.block_table == []


def test_chunked_prefill_respects_the_token_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=32)
    long, short = make_seq("long", 80, max_tokens=2), make_seq("short", 10, max_tokens=2)
    sched.add(long)
    sched.add(short)
    chunks = []
    for _ in range(4):
        out, _ = step(sched)
        assert out.num_batched_tokens <= 32
        chunks.append([(s.seq.request_id, s.num_new_tokens, s.will_sample) for s in out.scheduled])
    assert chunks == [
        [("long", 32, False)],
        [("long", 32, False)],
        [("long", 16, True), ("short", 10, True)],
        [("long", 1, True), ("short", 1, True)],
    ]
    assert long.output_token_ids == [1080, 1081]


def test_decodes_go_first_and_a_new_prefill_gets_the_rest() -> None:
    sched = make_scheduler(max_num_batched_tokens=32)
    sched.add(make_seq("a", 8, max_tokens=10))
    step(sched)
    sched.add(make_seq("b", 50, max_tokens=10))
    out, _ = step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 31)]


def test_long_prefill_threshold_caps_each_chunk() -> None:
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=20)
    sched.add(make_seq("a", 50))
    sched.add(make_seq("b", 50))
    out, _ = step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 20), ("b", 20)]


def test_max_num_seqs_limits_running() -> None:
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(f"r{i}", 5, max_tokens=2) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    out, _ = step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["r0", "r1"]
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    out, _ = step(sched)  # r0 and r1 finish this step
    assert [s.seq.request_id for s in out.scheduled] == ["r0", "r1"]
    out, _ = step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["r2"]
    run_all(sched)
    assert all(seq.finish_reason == FinishReason.LENGTH for seq in seqs)


def test_preemption_picks_the_newest_and_it_completes_later() -> None:
    # 6 blocks; three sequences of 30 prompt tokens take two blocks each.
    sched = make_scheduler(num_blocks=6)
    a, b, c = (make_seq(r, 30, max_tokens=6) for r in "abc")
    for seq in (a, b, c):
        sched.add(seq)
    for _ in range(3):  # prefill, then decodes up to 32 tokens each: still two blocks each
        out, _ = step(sched)
        assert out.preempted == []
    assert sched.kv.num_free_blocks == 0
    assert a.num_tokens == 33

    out, _ = step(sched)  # a needs a third block: c (newest) goes, b is untouched
    assert out.preempted == [c]
    assert [s.seq.request_id for s in out.scheduled] == ["a", "b"]
    assert c.status == SequenceStatus.PREEMPTED
    assert (c.num_computed_tokens, c.block_table) == (0, [])
    assert list(sched.waiting) == [c]
    assert c.output_token_ids == [1030, 1031, 1032]  # outputs survive preemption

    run_all(sched)
    for seq in (a, b, c):
        assert seq.finish_reason == FinishReason.LENGTH
        assert seq.output_token_ids == [1030 + i for i in range(6)]
    assert c.num_preemptions == 1
    assert sched.kv.num_free_blocks == 6


def test_preempted_sequence_recomputes_from_the_prefix_cache() -> None:
    sched = make_scheduler(num_blocks=4)
    a = make_seq("a", 30, max_tokens=4)
    b = Sequence("b", list(range(500, 530)), SamplingParams(max_tokens=8), block_size=BS)
    sched.add(a)
    sched.add(b)
    for _ in range(3):
        step(sched)
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    out = sched.schedule()
    # b is freed tail first, so a's new block is b's tail (block 3) and block 2 stays cached.
    assert out.preempted == [b]
    assert a.block_table == [0, 1, 3]
    sched.update(out, runner_output({"a": next_token(a)}))
    assert a.finish_reason == FinishReason.LENGTH  # 4th output this step

    out, _ = step(sched)
    [item] = out.scheduled
    assert item.seq is b
    assert (item.num_computed_tokens, item.num_new_tokens, item.will_sample) == (16, 17, True)
    assert b.block_table[0] == 2
    assert b.num_cached_tokens == 0  # counted on first schedule only
    run_all(sched)
    assert b.output_token_ids == [1030 + i for i in range(8)]
    assert sched.kv.num_free_blocks == 4


def test_prefix_hit_reported_on_first_schedule() -> None:
    sched = make_scheduler()
    shared = list(range(100, 148))
    first = Sequence("first", shared + [1, 2, 3], SamplingParams(max_tokens=1), block_size=BS)
    sched.add(first)
    run_all(sched)
    second = Sequence("second", shared + [7, 8], SamplingParams(max_tokens=1), block_size=BS)
    sched.add(second)
    out, _ = step(sched)
    assert second.num_cached_tokens >= 48
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled] == [(48, 2)]
    assert sched.kv.num_free_blocks == 64


def test_abort_waiting_and_running_frees_every_block() -> None:
    sched = make_scheduler(num_blocks=8, max_num_seqs=1)
    a, b = make_seq("a", 40, max_tokens=50), make_seq("b", 10)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.kv.num_free_blocks == 5
    aborted = sched.finish_requests(["b", "a", "unknown"], FinishReason.ABORT)
    assert aborted == [b, a]
    for seq in (a, b):
        assert seq.finish_reason == FinishReason.ABORT
        assert seq.status == SequenceStatus.FINISHED_ABORTED
    assert (sched.num_running, sched.num_waiting) == (0, 0)
    assert sched.kv.num_free_blocks == 8
    assert not sched.has_unfinished()


def test_abort_between_schedule_and_update() -> None:
    sched = make_scheduler()
    seq = make_seq("a", 20)
    sched.add(seq)
    out = sched.schedule()
    sched.finish_requests(["a"], FinishReason.ABORT)
    assert sched.update(out, {"a": 5}) == []
    assert seq.output_token_ids == []
    assert sched.kv.num_free_blocks == 64


def test_priority_policy_admits_lower_values_first_ties_in_arrival_order() -> None:
    sched = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    sched.add(make_seq("running", 5, max_tokens=2, priority=9))
    step(sched)
    for request_id, priority in [("p5", 5), ("p1", 1), ("p-2", -2), ("p1-later", 1)]:
        sched.add(make_seq(request_id, 5, max_tokens=2, priority=priority))
    assert [s.request_id for s in sched.waiting] == ["p-2", "p1", "p1-later", "p5"]
    order: list[str] = []
    while sched.has_unfinished():
        _, changed = step(sched)
        order.extend(s.request_id for s in changed if s.is_finished)
    assert order == ["running", "p-2", "p1", "p1-later", "p5"]


def test_fcfs_policy_ignores_priority() -> None:
    sched = make_scheduler(max_num_seqs=1)
    for request_id, priority in [("a", 5), ("b", -5), ("c", 0)]:
        sched.add(make_seq(request_id, 5, max_tokens=1, priority=priority))
    order: list[str] = []
    while sched.has_unfinished():
        _, changed = step(sched)
        order.extend(s.request_id for s in changed)
    assert order == ["a", "b", "c"]


def test_priority_policy_runs_in_priority_order_and_preempts_the_last() -> None:
    # 6 blocks; three sequences of 30 prompt tokens take two blocks each.
    sched = make_scheduler(num_blocks=6, scheduling_policy="priority")
    low, mid, high = (
        make_seq(r, 30, max_tokens=6, priority=p) for r, p in [("low", 3), ("mid", 2), ("high", 1)]
    )
    for seq in (low, mid, high):  # the least urgent arrives first
        sched.add(seq)
    out, _ = step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["high", "mid", "low"]
    for _ in range(2):
        step(sched)
    out, _ = step(sched)  # high needs a third block: low goes although it is the oldest
    assert out.preempted == [low]
    assert [s.seq.request_id for s in out.scheduled] == ["high", "mid"]
    assert list(sched.waiting) == [low]
    run_all(sched)
    assert all(seq.finish_reason == FinishReason.LENGTH for seq in (low, mid, high))
    assert sched.kv.num_free_blocks == 6


def test_a_more_urgent_arrival_runs_before_earlier_ones_but_preempts_nobody() -> None:
    sched = make_scheduler(max_num_batched_tokens=32, scheduling_policy="priority")
    sched.add(make_seq("early", 8, max_tokens=10, priority=5))
    step(sched)
    sched.add(make_seq("urgent", 8, max_tokens=10, priority=0))
    step(sched)
    assert [s.request_id for s in sched.running] == ["urgent", "early"]
    out, _ = step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["urgent", "early"]


def test_prompt_logprobs_skip_cached_blocks_and_cover_every_prompt_position() -> None:
    sched = make_scheduler(max_num_batched_tokens=20)
    sched.add(make_seq("warm", 40, max_tokens=1))
    run_all(sched)
    seq = make_seq("pl", 40, max_tokens=2, prompt_logprobs=1)
    sched.add(seq)
    positions: list[int] = []
    while not seq.output_token_ids:
        out = sched.schedule()
        [item] = out.scheduled
        positions.extend(item.prompt_logprob_positions)  # read before update(), as the engine
        sched.update(out, runner_output({"pl": next_token(seq)} if item.will_sample else {}))
    assert seq.num_cached_tokens == 0
    assert positions == list(range(39))  # position p scores prompt token p + 1
    assert list(sched.schedule().scheduled[0].prompt_logprob_positions) == []


def finish_with(tokens: list[int], max_model_len: int = 4096, **sampling: object) -> Sequence:
    sched = make_scheduler(max_model_len=max_model_len)
    seq = make_seq("s", 4, max_tokens=sampling.pop("max_tokens", 10), **sampling)  # type: ignore[arg-type]
    sched.add(seq)
    stream = iter(tokens)
    run_all(sched, lambda _: next(stream))
    assert sched.kv.num_free_blocks == 64
    return seq


def test_eos_stops() -> None:
    seq = finish_with([5, EOS, 6])
    assert (seq.finish_reason, seq.stop_token_id) == (FinishReason.STOP, None)
    assert seq.output_token_ids == [5, EOS]


def test_ignore_eos_runs_to_max_tokens() -> None:
    seq = finish_with([EOS] * 3, max_tokens=3, ignore_eos=True)
    assert seq.finish_reason == FinishReason.LENGTH
    assert seq.output_token_ids == [EOS] * 3


def test_stop_token_ids_record_which_matched() -> None:
    seq = finish_with([5, 77, 6], stop_token_ids=[76, 77], ignore_eos=True)
    assert (seq.finish_reason, seq.stop_token_id) == (FinishReason.STOP, 77)
    assert seq.output_token_ids == [5, 77]


def test_min_tokens_defers_stop_tokens() -> None:
    seq = finish_with([EOS, 77, EOS], min_tokens=2, stop_token_ids=[77])
    assert seq.finish_reason == FinishReason.STOP
    assert seq.output_token_ids == [EOS, 77, EOS]


def test_max_model_len_finishes_with_length() -> None:
    seq = finish_with([5] * 10, max_model_len=7)
    assert seq.finish_reason == FinishReason.LENGTH
    assert seq.num_tokens == 7


def test_sequence_never_outgrows_the_cache() -> None:
    sched = make_scheduler(num_blocks=2)
    seq = make_seq("a", 30, max_tokens=100)
    sched.add(seq)
    run_all(sched)
    assert seq.finish_reason == FinishReason.LENGTH
    assert seq.num_tokens == 33  # 32 tokens of KV fill the cache; the 33rd is never computed
    assert seq.num_preemptions == 0


def test_admission_reasons() -> None:
    sched = make_scheduler(num_blocks=4, max_model_len=100)
    assert sched.check_admissible(10, 16) is None
    assert sched.check_admissible(0, 16) == "prompt is empty"
    assert "max_model_len" in (sched.check_admissible(100, 16) or "")
    assert sched.check_admissible(64, 16) is None
    assert "KV cache" in (sched.check_admissible(65, 16) or "")
    # Empty prompts and duplicate ids are refused once, by Engine.add_request
    # (tests/unit/test_engine.py::test_add_request_rejects_empty_prompts_and_duplicates).


def test_random_workload_keeps_invariants() -> None:
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=24, max_num_seqs=6, max_num_batched_tokens=48)
    seqs = [make_seq(f"r{i}", rng.randint(1, 90), max_tokens=rng.randint(1, 40)) for i in range(30)]
    pending = list(seqs)
    for _ in range(2000):
        if pending and rng.random() < 0.3:
            sched.add(pending.pop(0))
        if rng.random() < 0.02 and sched.running:
            sched.finish_requests([rng.choice(sched.running).request_id], FinishReason.ABORT)
        out, _ = step(sched, lambda s: rng.choice([EOS, 5, 6, 7, 8, 9]))
        assert out.num_batched_tokens <= 48
        assert sched.num_running <= 6
        held = sum(len(seq.block_table) for seq in sched.running)
        in_use = sum(1 for block in sched.kv.pool.blocks if block.ref_count > 0)
        assert in_use <= held
        assert sum(block.ref_count for block in sched.kv.pool.blocks) == held
        if not pending and not sched.has_unfinished():
            break
    assert all(seq.is_finished for seq in seqs)
    assert sched.kv.num_free_blocks == 24


def test_engine_modules_do_not_import_torch() -> None:
    code = (
        "import sys, gpu_worker, gpu_worker.core.config, gpu_worker.core.sequence, "
        "gpu_worker.core.kv_cache, gpu_worker.core.scheduler; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
