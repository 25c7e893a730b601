"""The model runner's batch preparation against a plain reference, step after step.

A real scheduler drives it through what changes block tables: shared prefixes from the
prefix cache, chunked prefill, preemption (a small cache), finishing and reuse of rows,
prompt-logprob rows. Every step the uploaded tensors must equal what the list-based builder
(`build_attention_metadata`) and the sequences themselves say.
"""

from __future__ import annotations

import random
from typing import Any, cast

import torch

from gpu_worker.attention.metadata import build_attention_metadata
from gpu_worker.core.config import CacheConfig, SchedulerConfig
from gpu_worker.core.kv_cache import KVCacheManager
from gpu_worker.core.scheduler import ScheduledSequence, Scheduler
from gpu_worker.core.sequence import Sequence
from gpu_worker.runner.model_runner import ModelRunner
from shared.sampling import SamplingParams
from tests.helpers.runner_output import runner_output

BS = 4
NUM_BLOCKS = 20


def _check_step(runner: ModelRunner, scheduled: list[ScheduledSequence]) -> None:
    ids, positions, meta, sample_rows, prompt_rows = runner.upload(runner.prepare(scheduled))
    tables = [item.seq.block_table for item in scheduled]
    expected = build_attention_metadata(
        [item.num_new_tokens for item in scheduled],
        [item.num_computed_tokens for item in scheduled],
        tables,
        BS,
    )
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "context_lens"):
        assert torch.equal(getattr(meta, name), getattr(expected, name)), name
    assert meta.block_tables.shape == expected.block_tables.shape
    assert meta.block_tables.dtype == torch.int32
    assert meta.block_tables.is_contiguous()
    for row, table in zip(meta.block_tables.tolist(), tables, strict=True):
        assert row[: len(table)] == table
        assert all(0 <= block < NUM_BLOCKS for block in row)  # stale padding: real blocks
    assert (meta.max_query_len, meta.max_seq_len) == (expected.max_query_len, expected.max_seq_len)
    assert meta.query_start_loc_host == expected.query_start_loc.tolist()
    assert meta.context_lens_host == expected.context_lens.tolist()

    want_ids: list[int] = []
    want_sample: list[int] = []
    want_prompt: list[int] = []
    for item in scheduled:
        start = len(want_ids)
        want_ids += item.seq.all_token_ids[
            item.num_computed_tokens : item.num_computed_tokens + item.num_new_tokens
        ]
        if item.will_sample:
            want_sample.append(len(want_ids) - 1)
        want_prompt += range(start, start + len(item.prompt_logprob_positions))
    assert ids.tolist() == want_ids
    assert torch.equal(positions, expected_positions(scheduled))
    if len(want_sample) == len(want_ids):
        assert sample_rows is None
    else:
        assert sample_rows is not None
        assert sample_rows.tolist() == want_sample
    assert (prompt_rows.tolist() if prompt_rows is not None else []) == want_prompt


def expected_positions(scheduled: list[ScheduledSequence]) -> torch.Tensor:
    return torch.tensor(
        [
            p
            for item in scheduled
            for p in range(item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens)
        ],
        dtype=torch.int64,
    )


def test_prepare_matches_the_list_builder_through_prefixes_chunks_and_preemption() -> None:
    rng = random.Random(0)
    kv = KVCacheManager(CacheConfig(block_size=BS, num_blocks=NUM_BLOCKS))
    config = SchedulerConfig(
        max_num_seqs=6, max_num_batched_tokens=24, max_model_len=128, long_prefill_token_threshold=9
    )
    scheduler = Scheduler(config, kv, eos_token_ids=[])
    # The runner's host side needs no model: only the block table, block size and device.
    none = cast(Any, None)
    runner = ModelRunner(none, none, [], BS, torch.device("cpu"))
    shared_prefix = [rng.randrange(100) for _ in range(10)]
    num_steps = num_preempted = num_shared = 0
    for i in range(14):
        prompt = [rng.randrange(100) for _ in range(rng.randrange(2, 20))]
        if i % 2:
            prompt = shared_prefix + prompt
        params = SamplingParams(
            max_tokens=rng.randrange(5, 30),
            ignore_eos=True,
            prompt_logprobs=i % 2 if i % 5 == 0 else None,  # 0 asks too
        )
        scheduler.add(Sequence(f"r{i % 9}", prompt, params, block_size=BS))
        for _ in range(rng.randrange(0, 4)):
            out = scheduler.schedule()
            runner.release(out.finished_request_ids)
            if out.scheduled:
                _check_step(runner, out.scheduled)
                tables = [tuple(item.seq.block_table[:2]) for item in out.scheduled]
                num_shared += len(tables) - len(set(tables))
            num_steps += 1
            num_preempted += len(out.preempted)
            scheduler.update(
                out, runner_output({s.seq.request_id: 7 for s in out.scheduled if s.will_sample})
            )
        if i == 8:  # later requests reuse ids 0.. once those finished
            while scheduler.has_unfinished():
                out = scheduler.schedule()
                runner.release(out.finished_request_ids)
                _check_step(runner, out.scheduled)
                scheduler.update(
                    out,
                    runner_output({s.seq.request_id: 7 for s in out.scheduled if s.will_sample}),
                )
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        runner.release(out.finished_request_ids)
        _check_step(runner, out.scheduled)
        num_preempted += len(out.preempted)
        scheduler.update(
            out, runner_output({s.seq.request_id: 7 for s in out.scheduled if s.will_sample})
        )
    runner.release(scheduler.schedule().finished_request_ids)
    assert runner.block_table.num_live_rows == 0
    assert num_preempted > 0
    assert num_shared > 0


def test_a_verify_step_is_laid_out_as_one_token_decodes_of_each_drafted_sequence() -> None:
    kv = KVCacheManager(CacheConfig(block_size=BS, num_blocks=NUM_BLOCKS))
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    drafts = {"a": [5, 6, 7], "c": [9]}  # "b" drafts nothing
    scheduler = Scheduler(config, kv, eos_token_ids=[])
    none = cast(Any, None)
    runner = ModelRunner(none, none, [], BS, torch.device("cpu"))
    for request_id, length in (("a", 6), ("b", 3), ("c", 9)):
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        scheduler.add(Sequence(request_id, list(range(1, length + 1)), params, block_size=BS))
    out = scheduler.schedule()  # the prompts
    scheduler.update(
        out, runner_output({s.seq.request_id: 7 for s in out.scheduled if s.will_sample})
    )
    for seq in scheduler.running:  # as the speculator proposes before scheduling
        seq.draft_token_ids = drafts.get(seq.request_id, [])
    out = scheduler.schedule()
    assert [len(item.draft_token_ids) for item in out.scheduled] == [3, 0, 1]

    ids, positions, meta, sample_rows, _ = runner.upload(runner.prepare(out.scheduled))
    # a: its last token and 3 drafts; b: its last token; c: its last token and 1 draft.
    assert ids.tolist() == [7, 5, 6, 7, 7, 7, 9]
    assert positions.tolist() == [6, 7, 8, 9, 3, 9, 10]
    # Seven one-token decodes, each seeing its context and the drafts before it.
    assert (meta.max_query_len, meta.num_seqs) == (1, 7)
    assert meta.query_start_loc.tolist() == list(range(8))
    assert meta.seq_lens.tolist() == [7, 8, 9, 10, 4, 10, 11]
    assert meta.context_lens.tolist() == [6, 7, 8, 9, 3, 9, 10]
    tables = meta.block_tables.tolist()
    for rows, item in ((range(0, 4), out.scheduled[0]), (range(5, 7), out.scheduled[2])):
        for row in rows:
            table = item.seq.block_table
            assert tables[row][: len(table)] == table
    slots = [
        item.seq.block_table[p // BS] * BS + p % BS
        for item in out.scheduled
        for p in range(item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens)
    ]
    assert meta.slot_mapping.tolist() == slots
    assert sample_rows is None  # every row is verified
