"""Request fields the engine honours, on a tiny random Llama (fast): priority scheduling,
prompt logprobs against transformers, allowed_token_ids and bad_words end to end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker import Engine
from gpu_worker.engine.errors import RequestRejected
from shared.protocol import Generate, TokenLogprobs
from shared.sampling import SamplingParams
from tests.helpers.tiny_models import TinyModel

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = [(7 * i + 3) % 250 + 3 for i in range(41)]  # 41 tokens: 2 full blocks and a tail


def _engine(model_dir: Path, **kwargs: Any) -> Engine:
    return Engine(model=str(model_dir), device="cpu", **{"kv_cache_memory_gb": 0.01, **kwargs})


@pytest.fixture(scope="module")
def engine(tiny_llama: TinyModel) -> Engine:
    # A small step budget, so a prompt is prefilled in chunks of 16.
    return _engine(tiny_llama.path, max_num_batched_tokens=16)


def _run(engine: Engine, request: Generate) -> list[Any]:
    engine.add_request(request)
    deltas = []
    while engine.has_unfinished_requests():
        deltas.extend(d for d in engine.step() if d.request_id == request.request_id)
    return deltas


# ---- priority ---------------------------------------------------------------------


def test_priority_orders_a_full_batch(tiny_llama: TinyModel) -> None:
    engine = _engine(tiny_llama.path, max_num_seqs=1, scheduling_policy="priority")
    assert engine.model_card.scheduling_policy == "priority"
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    def add(request_id: str, priority: int) -> None:
        engine.add_request(
            Generate(
                request_id=request_id,
                prompt_token_ids=PROMPT[:8],
                sampling=params,
                priority=priority,
            )
        )

    add("running", 9)
    engine.step()  # it holds the only slot now
    for request_id, priority in [("p5", 5), ("p1", 1), ("p3", 3), ("p-2", -2), ("p1-later", 1)]:
        add(request_id, priority)
    finished = []
    while engine.has_unfinished_requests():
        finished.extend(d.request_id for d in engine.step() if d.finish_reason is not None)
    assert finished == ["running", "p-2", "p1", "p1-later", "p3", "p5"]


def test_fcfs_worker_refuses_a_priority(engine: Engine) -> None:
    assert engine.model_card.scheduling_policy == "fcfs"
    request = Generate(request_id="prio", prompt_token_ids=[1, 2], sampling=GREEDY, priority=1)
    with pytest.raises(RequestRejected, match="priority") as rejected:
        engine.add_request(request)
    assert rejected.value.code == "invalid_request"
    assert not engine.has_unfinished_requests()


# ---- prompt logprobs --------------------------------------------------------------


def _reference(hf: Any, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


def _assert_matches(
    entries: list[TokenLogprobs | None], reference: torch.Tensor, prompt: list[int], k: int
) -> None:
    assert len(entries) == len(prompt)
    assert entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        assert entry is not None
        row = reference[position - 1]
        token = prompt[position]
        assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry.rank == int((row > row[token]).sum()) + 1
        top = torch.topk(row, k)
        assert entry.top_token_ids == top.indices.tolist()
        assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)


def test_prompt_logprobs_match_transformers_across_chunks(
    engine: Engine, tiny_llama: TinyModel
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=4)
    deltas = _run(engine, Generate(request_id="pl", prompt_token_ids=PROMPT, sampling=params))
    first, *rest = deltas
    assert first.prompt_logprobs is not None
    assert all(d.prompt_logprobs is None for d in rest)
    _assert_matches(first.prompt_logprobs, _reference(tiny_llama.hf, PROMPT), PROMPT, k=4)


def test_prompt_logprobs_skip_the_prefix_cache_and_leave_it_filled(
    engine: Engine, tiny_llama: TinyModel
) -> None:
    prompt = [t + 1 for t in PROMPT]
    plain = _run(engine, Generate(request_id="warm", prompt_token_ids=prompt, sampling=GREEDY))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    asked = _run(engine, Generate(request_id="pl0", prompt_token_ids=prompt, sampling=params))
    assert asked[0].num_cached_tokens == 0  # the cached blocks were not read
    assert asked[0].prompt_logprobs is not None
    _assert_matches(asked[0].prompt_logprobs, _reference(tiny_llama.hf, prompt), prompt, k=0)
    assert [d.new_token_ids for d in asked] == [d.new_token_ids for d in plain]
    again = _run(engine, Generate(request_id="hit", prompt_token_ids=prompt, sampling=GREEDY))
    assert again[0].num_cached_tokens == 32
    assert again[0].prompt_logprobs is None


def test_prompt_logprobs_in_a_mixed_batch(engine: Engine, tiny_llama: TinyModel) -> None:
    short = PROMPT[:5]
    one = PROMPT[:1]
    completions = engine.generate(
        [PROMPT, short, one, PROMPT[::-1]],
        [
            SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2),
            SamplingParams(temperature=0.0, max_tokens=2),
            SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1),
            SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3),
        ],
    )
    long, plain, single, reversed_ = completions
    assert long.prompt_logprobs is not None
    _assert_matches(long.prompt_logprobs, _reference(tiny_llama.hf, PROMPT), PROMPT, k=2)
    assert plain.prompt_logprobs is None
    assert single.prompt_logprobs == [None]
    assert reversed_.prompt_logprobs is not None
    _assert_matches(
        reversed_.prompt_logprobs, _reference(tiny_llama.hf, PROMPT[::-1]), PROMPT[::-1], k=3
    )


# ---- allowed_token_ids and bad_words ----------------------------------------------


def test_allowed_token_ids_and_bad_words_end_to_end(engine: Engine) -> None:
    prompt = PROMPT[:12]
    free = engine.generate([prompt], GREEDY)[0].token_ids
    allowed = [5, 17, 99]
    [restricted] = engine.generate(
        [prompt], SamplingParams(temperature=0.8, seed=3, max_tokens=6, allowed_token_ids=allowed)
    )
    assert set(restricted.token_ids) <= set(allowed)

    # A one-token word bans that token everywhere; a two-token word only after its prefix.
    [single] = engine.generate(
        [prompt],
        SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True, bad_words_token_ids=[[free[0]]]
        ),
    )
    assert free[0] not in single.token_ids
    [double] = engine.generate(
        [prompt],
        SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True, bad_words_token_ids=[free[:2]]
        ),
    )
    assert double.token_ids[0] == free[0]
    assert double.token_ids[1] != free[1]
    outputs = double.token_ids
    assert all(outputs[i : i + 2] != free[:2] for i in range(len(outputs) - 1))


def test_filters_are_validated_against_the_vocabulary(engine: Engine) -> None:
    for sampling, param in [
        (SamplingParams(allowed_token_ids=[engine.vocab_size]), "allowed_token_ids"),
        (SamplingParams(bad_words_token_ids=[[1, engine.vocab_size]]), "bad_words"),
    ]:
        with pytest.raises(RequestRejected, match=param) as rejected:
            engine.add_request(Generate(request_id="bad", prompt_token_ids=[1], sampling=sampling))
        assert rejected.value.code == "invalid_request"


def test_prompt_logprobs_survive_preemption_mid_prefill(tiny_llama: TinyModel) -> None:
    # 10 blocks of 16 tokens. A decodes into its third block while B's 120-token prompt is
    # prefilled 15 tokens a step: B runs out of blocks mid-prefill, is preempted, and
    # recomputes from its first token once A is done.
    small = _engine(
        tiny_llama.path,
        kv_cache_memory_gb=10 * 8192 / (1 << 30),
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    assert small.kv.num_blocks == 10
    prompts = {"a": PROMPT[:30], "b": [(5 * i + 1) % 250 + 3 for i in range(120)]}
    firsts: dict[str, list[TokenLogprobs | None]] = {}
    preempted_before_first_token = False
    for request_id, max_tokens in [("a", 40), ("b", 4)]:
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=1
        )
        small.add_request(
            Generate(request_id=request_id, prompt_token_ids=prompts[request_id], sampling=params)
        )
        while small.has_unfinished_requests():
            for delta in small.step():
                if delta.prompt_logprobs is not None:
                    firsts[delta.request_id] = delta.prompt_logprobs
            preempted_before_first_token |= any(
                seq.num_preemptions and not seq.output_token_ids
                for seq in small.scheduler.requests.values()
            )
            if request_id == "a" and firsts:
                break  # a is decoding: b arrives
    assert preempted_before_first_token
    for request_id, prompt in prompts.items():
        _assert_matches(firsts[request_id], _reference(tiny_llama.hf, prompt), prompt, k=1)
