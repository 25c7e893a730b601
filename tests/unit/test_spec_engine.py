"""Speculative decoding through the engine, on a tiny random Llama (fast), for each method
(the draft model is the target itself): greedy output token for token as without
speculation (with non-speculating requests in the batch, the prefix cache, preemption,
chunked prefill, max_tokens and stop tokens), seeded sampling reproducible, the start-time
checks of --speculative-config and the verify target of sampled rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker import Engine
from gpu_worker.core.config import EngineConfig
from gpu_worker.sampling.target import target_probs
from shared.protocol import Generate, RequestDelta
from shared.sampling import SamplingParams
from tests.helpers.spec_engines import METHODS, spec_engine

# Chat-like prompts that repeat themselves, so drafts from the prompt and output get accepted.
PROMPTS = [
    [1] + [10 + i % 7 for i in range(40)],
    [3, 4, 5, 6] * 8,
    list(range(20, 60)),
    [9, 8, 7] * 10 + [1, 2],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)
PENALIZED = SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.3)


def _tokens(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[Any]:
    return [(c.token_ids, c.finish_reason) for c in engine.generate(prompts, params)]


def _all_blocks_back(engine: Engine) -> bool:
    return engine.kv.num_free_blocks == engine.kv.num_blocks


def test_greedy_equals_plain_decoding_batched_with_penalized_requests(
    plain: Engine, spec: Engine
) -> None:
    prompts = PROMPTS + PROMPTS[:2]
    params = [GREEDY] * len(PROMPTS) + [PENALIZED] * 2
    before = spec.stats()
    assert _tokens(spec, prompts, params) == _tokens(plain, prompts, params)
    after = spec.stats()
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    assert 0 < accepted <= drafted
    assert _all_blocks_back(spec)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_prefix_cache_hits_on_a_second_run(
    plain: Engine, tiny_llama_dir: Path, method: str
) -> None:
    engine = spec_engine(tiny_llama_dir, METHODS[method])
    want = _tokens(plain, PROMPTS, [GREEDY] * 4)
    assert _tokens(engine, PROMPTS, [GREEDY] * 4) == want
    hits = engine.stats().prefix_cache_hits
    assert _tokens(engine, PROMPTS, [GREEDY] * 4) == want
    assert engine.stats().prefix_cache_hits > hits
    assert _all_blocks_back(engine)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_greedy_equals_plain_decoding_under_preemption(
    plain: Engine, tiny_llama_dir: Path, method: str
) -> None:
    # 13 blocks of 16 tokens (512 bytes a token) for four sequences of 72-81 tokens.
    engine = spec_engine(tiny_llama_dir, METHODS[method], kv_cache_memory_gb=100_000 / 2**30)
    assert engine.kv.num_blocks < 16
    keys = [f"r{i}" for i in range(len(PROMPTS))]
    for key, prompt in zip(keys, PROMPTS, strict=True):
        engine.add_request(Generate(request_id=key, prompt_token_ids=prompt, sampling=GREEDY))
    got: dict[str, list[int]] = {key: [] for key in keys}
    preempted = False
    while engine.has_unfinished_requests():
        for delta in engine.step():
            got[delta.request_id] += delta.new_token_ids
        preempted |= any(s.num_preemptions for s in engine.scheduler.requests.values())
    assert preempted
    assert [got[key] for key in keys] == [t for t, _ in _tokens(plain, PROMPTS, [GREEDY] * 4)]
    assert engine.stats().spec_num_accepted_tokens > 0
    assert _all_blocks_back(engine)


def _deltas(engine: Engine, prompt: list[int], params: SamplingParams) -> list[RequestDelta]:
    engine.add_request(Generate(request_id="one", prompt_token_ids=prompt, sampling=params))
    deltas: list[RequestDelta] = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    return deltas


def test_max_tokens_and_stop_tokens_end_where_plain_decoding_does(
    plain: Engine, spec: Engine
) -> None:
    prompt = PROMPTS[0]
    [(reference, _)] = _tokens(plain, [prompt], [GREEDY])
    cut_in_a_multi_token_step = 0
    for end in range(2, len(reference)):
        for params in (
            SamplingParams(temperature=0.0, max_tokens=end),
            SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[reference[end - 1]]),
        ):
            if params.stop_token_ids and reference[end - 1] in reference[: end - 1]:
                continue  # it would stop at its first occurrence
            deltas = _deltas(spec, prompt, params)
            assert [t for d in deltas for t in d.new_token_ids] == reference[:end]
            assert deltas[-1].finish_reason == ("stop" if params.stop_token_ids else "length")
            cut_in_a_multi_token_step += len(deltas[-1].new_token_ids) > 1
    assert cut_in_a_multi_token_step > 0


SEEDED = [
    # Cool enough that the samples repeat themselves and drafts come.
    SamplingParams(temperature=0.3, seed=7, max_tokens=30),
    SamplingParams(temperature=0.5, top_k=20, top_p=0.9, seed=11, max_tokens=30),
    SamplingParams(temperature=0.4, min_p=0.05, seed=3, max_tokens=30),
]


@pytest.mark.parametrize("method", sorted(METHODS))
def test_seeded_sampling_is_reproducible_with_speculation(
    tiny_llama_dir: Path, method: str
) -> None:
    runs = []
    for _ in range(2):
        engine = spec_engine(tiny_llama_dir, METHODS[method])
        runs.append(_tokens(engine, PROMPTS[:3], SEEDED))
        assert engine.stats().spec_num_draft_tokens > 0
    assert runs[0] == runs[1]


@pytest.mark.parametrize("method", sorted(METHODS))
def test_seeded_sampling_with_drafts_ignores_the_batch(tiny_llama_dir: Path, method: str) -> None:
    # Suffix drafts also come from other requests' outputs, but a seeded row emits the
    # tokens of its own draws whatever it was shown (spec_decode.verify).
    engine = spec_engine(tiny_llama_dir, METHODS[method])
    alone = _tokens(engine, PROMPTS[:3], SEEDED)
    batched = _tokens(engine, [PROMPTS[3], *PROMPTS[:3]], [GREEDY, *SEEDED])
    assert batched[1:] == alone


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {
                "speculative_config": '{"method": "ngram", "num_speculative_tokens": 2, '
                '"draft_length": "short"}'
            },
            "draft_length",
        ),
        ({"speculative_config": '{"method": "ngram"}'}, "num_speculative_tokens"),
        (
            {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}'},
            "bogus",
        ),
    ],
)
def test_unservable_speculative_config_fails_at_start(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_speculation_is_off_by_default(plain: Engine) -> None:
    assert EngineConfig().speculative() is None
    assert plain.speculator is None
    [done] = plain.generate([[1, 2, 3, 1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))
    assert len(done.token_ids) == 4
    assert plain.stats().spec_num_drafts == 0


def test_target_probs_apply_temperature_top_k_with_ties_top_p_and_min_p() -> None:
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0, -1.0], [3.0, 2.0, 1.0, 0.0, -9.0]])
    params = [
        SamplingParams(temperature=0.5, top_k=2),
        SamplingParams(temperature=1.0, top_p=0.8, min_p=0.01),
    ]
    probs = target_probs(logits, params)
    # Row 0: top-2 keeps both tokens tied with the 2nd value.
    kept = torch.tensor([4.0, 2.0, 2.0])
    assert torch.allclose(probs[0, :3], kept.softmax(0))
    assert probs[0, 3:].sum() == 0
    # Row 1: min-p drops -9; of e^[3,2,1,0] normalized (.64 .24 .09 .03), the head 0.64
    # is short of 0.8, 0.88 reaches it: two tokens stay.
    assert torch.allclose(probs[1, :2], torch.tensor([3.0, 2.0]).softmax(0))
    assert probs[1, 2:].sum() == 0
    assert torch.equal(
        logits, torch.tensor([[2.0, 1.0, 1.0, 0.0, -1.0], [3.0, 2.0, 1.0, 0.0, -9.0]])
    )


# Chunked prefill, 24 tokens a step: the 40-token prompts are prefilled in chunks beside
# the decoding (and drafting) requests, whose 1 + k rows count against the same budget.
# Blocks of 2 tokens: rejected drafts often leave whole blocks, which are freed and taken
# by the next sequence to grow, so a stale block-table row would show.
LAYOUTS = {"chunked_prefill": {"max_num_batched_tokens": 24}, "small_blocks": {"block_size": 2}}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("method", sorted(METHODS))
def test_greedy_equals_plain_decoding_in_other_layouts(
    plain: Engine, tiny_llama_dir: Path, method: str, layout: str
) -> None:
    engine = spec_engine(tiny_llama_dir, METHODS[method], **LAYOUTS[layout])
    prompts = PROMPTS + PROMPTS[:2]
    params = [GREEDY] * len(PROMPTS) + [PENALIZED] * 2
    assert _tokens(engine, prompts, params) == _tokens(plain, prompts, params)
    assert engine.stats().spec_num_accepted_tokens > 0
    assert _all_blocks_back(engine)
