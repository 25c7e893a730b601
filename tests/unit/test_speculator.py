"""The speculation component without the engine: a real scheduler and KV manager, the
ngram drafter, a sampler over a small vocabulary, and logits written by hand.

`propose` fills each decoding request's `draft_token_ids` before scheduling, within its
max_tokens and the context, and clears every other running request's; the scheduler
trims them to its budget; `verify` keeps the accepted head plus the target's token; and
`step_done` shows the drafter what was kept.
"""

from __future__ import annotations

import torch

from gpu_worker.core.config import CacheConfig, SchedulerConfig
from gpu_worker.core.kv_cache import KVCacheManager
from gpu_worker.core.outputs import ModelRunnerOutput
from gpu_worker.core.scheduler import Scheduler, SchedulerOutput
from gpu_worker.core.sequence import Sequence
from gpu_worker.engine.speculation import Speculator
from gpu_worker.sampling.sampler import Sampler
from gpu_worker.spec_decode.config import parse_speculative_config
from shared.sampling import SamplingParams
from tests.helpers.runner_output import runner_output

VOCAB = 32
BS = 4
K = 3


def _setup(
    max_num_batched_tokens: int = 64, long_prefill_token_threshold: int | None = None
) -> tuple[Scheduler, Speculator]:
    kv = KVCacheManager(CacheConfig(block_size=BS, num_blocks=64))
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=64,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )
    scheduler = Scheduler(config, kv, eos_token_ids=[0])
    spec_config = parse_speculative_config(
        f'{{"method": "ngram", "num_speculative_tokens": {K}, "prompt_lookup_min": 2,'
        ' "prompt_lookup_max": 2}'
    )
    speculator = Speculator(spec_config, Sampler(VOCAB, torch.device("cpu"), [0]))
    return scheduler, speculator


def _add(
    scheduler: Scheduler, speculator: Speculator, rid: str, prompt: list[int], max_tokens: int
) -> None:
    seq = Sequence(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), block_size=BS)
    scheduler.add(seq)
    speculator.start(seq)


def _prefill(
    scheduler: Scheduler, speculator: Speculator, first_tokens: dict[str, int]
) -> SchedulerOutput:
    out = scheduler.schedule()
    changed = scheduler.update(out, runner_output(first_tokens))
    speculator.step_done(out, changed, {seq.request_id: 1 for seq in changed}, started=0.0)
    return out


def _one_hot_rows(tokens: list[int]) -> torch.Tensor:
    logits = torch.full((len(tokens), VOCAB), -10.0)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 10.0
    return logits


def test_drafts_are_proposed_before_scheduling_within_each_requests_room() -> None:
    scheduler, speculator = _setup(long_prefill_token_threshold=9)
    # After its first token (5), "a" ends with [4, 5]: the prompt continues it with 6 7 8.
    _add(scheduler, speculator, "a", [1, 4, 5, 6, 7, 8, 9, 2, 4], max_tokens=20)
    _add(scheduler, speculator, "short", [1, 4, 5, 6, 7, 8, 9, 2, 4], max_tokens=3)
    _add(scheduler, speculator, "late", list(range(10, 30)), max_tokens=20)
    # "late" prefills 9 tokens a step: three steps for its 20
    _prefill(scheduler, speculator, {"a": 5, "short": 5})
    speculator.propose(scheduler)
    drafts = {seq.request_id: seq.draft_token_ids for seq in scheduler.running}
    assert drafts["a"] == [6, 7, 8]
    assert drafts["short"] == [6]  # 3 tokens: one kept, one drafted, the target's own
    assert drafts["late"] == []  # still prefilling
    out = scheduler.schedule()
    scheduled = {item.seq.request_id: item for item in out.scheduled}
    assert scheduled["a"].draft_token_ids == [6, 7, 8]
    assert scheduled["a"].num_new_tokens == 1 + K


def test_the_scheduler_trims_drafts_to_its_budget() -> None:
    scheduler, speculator = _setup(max_num_batched_tokens=6)
    _add(scheduler, speculator, "a", [1, 2, 3], max_tokens=20)
    _add(scheduler, speculator, "b", [4, 5, 6], max_tokens=20)
    _prefill(scheduler, speculator, {"a": 7, "b": 8})
    a, b = scheduler.running
    # Drafts are data on the requests: whoever proposed them, the budget decides.
    a.draft_token_ids, b.draft_token_ids = [1, 2, 3], [4, 5, 6]
    out = scheduler.schedule()
    assert [(i.seq.request_id, i.draft_token_ids) for i in out.scheduled] == [
        ("a", [1, 2, 3]),
        ("b", [4]),  # 2 tokens of budget left: its last token and one draft
    ]
    assert out.num_batched_tokens == 6


def test_verify_keeps_the_accepted_head_and_the_drafter_learns_it() -> None:
    scheduler, speculator = _setup()
    _add(scheduler, speculator, "a", [1, 4, 5, 6, 7, 8, 9, 2, 4], max_tokens=20)
    _prefill(scheduler, speculator, {"a": 5})
    speculator.propose(scheduler)
    out = scheduler.schedule()
    [item] = out.scheduled
    # The target agrees with 6 and 7, then says 3 where the draft says 8.
    logits = _one_hot_rows([6, 7, 3, 11])
    kept = speculator.verify(logits, list(range(4)), [item])
    assert kept == {"a": [6, 7, 3]}
    assert (speculator.num_draft_tokens, speculator.num_accepted_tokens) == (3, 2)
    assert speculator.accepted_per_position == [1, 1, 0]
    [seq] = scheduler.update(out, ModelRunnerOutput(sampled_token_ids=kept))
    assert seq.output_token_ids == [5, 6, 7, 3]
    assert seq.num_computed_tokens == seq.num_tokens - 1
    speculator.step_done(out, [seq], {"a": 3}, started=0.0)
    # The drafter saw 6 7 3: after [7, 3] nothing in the tokens continues, so no drafts.
    speculator.propose(scheduler)
    assert seq.draft_token_ids == []
