"""Async scheduling (`async_scheduling=True`) changes when the host learns each step's
tokens, never which tokens: every feature gives the same greedy and seeded outputs with
it on and off, through the offline `Engine`. Step N+1 is launched before step N's update
(the first step returns nothing; the second, the first token), a request that finishes or
is aborted mid-overlap gets nothing after its last delta, and every block comes back.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker import Completion, Engine
from gpu_worker.loader import load_config
from gpu_worker.runner.kv_caches import kv_cache_bytes_per_block
from shared.model_source import resolve_model
from shared.protocol import Constraint, Generate, RequestDelta
from shared.sampling import SamplingParams
from tests.helpers.lora_adapters import AdapterSpec, add_peft_adapters
from tests.helpers.preemption import count_preemptions
from tests.helpers.tiny_models import save_tiny_model

pytestmark = pytest.mark.timeout(240)

ADAPTERS = {
    "sql": AdapterSpec(rank=4, alpha=8, targets=("q_proj", "v_proj"), seed=1),
    "poem": AdapterSpec(rank=8, alpha=8, targets=("o_proj", "down_proj"), seed=2),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("async")
    model = save_tiny_model(out / "model", "llama", tokenizer="bytes")
    add_peft_adapters(model.hf, ADAPTERS, out / "loras")
    return model.path


EngineFactory = Callable[..., Engine]


@pytest.fixture(scope="module")
def engines(model_dir: Path) -> Iterator[EngineFactory]:
    """Engines by (async on or off, engine arguments), built once per module."""
    built: dict[tuple[bool, str], Engine] = {}

    def get(async_scheduling: bool, **kwargs: Any) -> Engine:
        key = (async_scheduling, json.dumps(kwargs, sort_keys=True, default=str))
        if key not in built:
            built[key] = Engine(
                model=str(model_dir),
                device="cpu",
                kv_cache_memory_gb=kwargs.pop("kv_cache_memory_gb", 0.01),
                async_scheduling=async_scheduling,
                **kwargs,
            )
        return built[key]

    yield get
    for engine in built.values():
        engine.close()


def _prompts(n: int, length: int = 9, shared: int = 0) -> list[list[int]]:
    prefix = [(5 * j + 3) % 250 + 1 for j in range(shared)]
    return [prefix + [(7 * i + 3 * j) % 250 + 1 for j in range(length + i)] for i in range(n)]


def _view(done: list[Completion]) -> list[tuple[Any, ...]]:
    return [
        (c.token_ids, c.finish_reason, c.stop_token_id, c.logprobs, c.prompt_logprobs) for c in done
    ]


def _same(
    engines: EngineFactory,
    prompts: list[list[int]],
    params: list[SamplingParams],
    lora_names: list[str | None] | None = None,
    **kwargs: Any,
) -> list[Completion]:
    """Run the prompts with async scheduling off and on; assert equal results; return them."""
    off = engines(False, **kwargs).generate(prompts, params, lora_names)
    on_engine = engines(True, **kwargs)
    on = on_engine.generate(prompts, params, lora_names)
    assert _view(on) == _view(off)
    assert on_engine.kv.num_free_blocks == on_engine.kv.num_blocks
    assert not on_engine.has_unfinished_requests()
    return off


SAMPLING = [
    SamplingParams(temperature=0, max_tokens=12),
    SamplingParams(temperature=1.0, seed=7, max_tokens=10),
    SamplingParams(temperature=0.8, seed=3, max_tokens=9, logprobs=2),
    SamplingParams(temperature=0, max_tokens=7, min_tokens=5, ignore_eos=False),
    SamplingParams(temperature=0.9, seed=5, max_tokens=15, top_k=5, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=0, max_tokens=8, logprobs=0, prompt_logprobs=1),
    SamplingParams(temperature=0.7, seed=9, max_tokens=8, logit_bias={65: 3.0}),
]


def test_sampling_options_are_unchanged(engines: EngineFactory) -> None:
    done = _same(engines, _prompts(len(SAMPLING)), SAMPLING)
    assert [len(c.token_ids) for c in done] == [p.max_tokens for p in SAMPLING]


def test_penalties_and_token_filters_are_unchanged(engines: EngineFactory) -> None:
    params = [
        SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.4),
        SamplingParams(temperature=0.8, seed=2, max_tokens=10, frequency_penalty=0.7),
        SamplingParams(temperature=0, max_tokens=10, presence_penalty=1.0),
        SamplingParams(temperature=0, max_tokens=10, bad_words_token_ids=[[66, 67], [70]]),
        SamplingParams(temperature=0, max_tokens=10, allowed_token_ids=list(range(60, 90))),
        SamplingParams(temperature=0.5, seed=4, max_tokens=10),  # a free row beside them
    ]
    _same(engines, _prompts(len(params)), params)


def test_stop_ids_end_a_request_mid_overlap(engines: EngineFactory) -> None:
    prompts = _prompts(3)
    greedy = SamplingParams(temperature=0, max_tokens=16)
    [free, *_] = engines(False).generate(prompts[:1], greedy)
    stop_at = free.token_ids[3]
    params = [
        SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_at]),
        SamplingParams(temperature=0, max_tokens=6),
        SamplingParams(temperature=1.0, seed=1, max_tokens=16),
    ]
    [stopped, *_] = _same(engines, prompts, params)
    assert stopped.finish_reason == "stop"
    assert stopped.stop_token_id == stop_at
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop_at) + 1]


def test_structured_outputs_are_unchanged(engines: EngineFactory) -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 9},
            "b": {"enum": ["x", "yz"]},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    constraint = Constraint(kind="json_schema", spec=json.dumps(schema))
    results = []
    for async_on in (False, True):
        engine = engines(async_on)
        engine.add_request(
            Generate(
                request_id="json",
                prompt_token_ids=_prompts(1)[0],
                sampling=SamplingParams(temperature=0.6, seed=8, max_tokens=48),
                constraint=constraint,
            )
        )
        engine.add_request(
            Generate(
                request_id="free",
                prompt_token_ids=_prompts(2)[1],
                sampling=SamplingParams(temperature=0, max_tokens=20),
            )
        )
        results.append(_drain(engine))
    off, on = results
    assert on == off
    text = bytes(t for t in off["json"] if t < 256).decode()
    assert set(json.loads(text)) == {"a", "b"}


def test_prefix_caching_chunked_prefill_and_preemption_are_unchanged(
    engines: EngineFactory, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 18 blocks of 8 tokens and small step budgets: the prompts prefill in chunks, share a
    # prefix, and preempt each other while they decode (five need about 40 blocks).
    config = load_config(resolve_model(str(model_dir)))
    per_block = kv_cache_bytes_per_block(
        config.num_layers, 8, config.num_kv_heads, config.head_dim, torch.float32
    )
    kwargs = dict(
        kv_cache_memory_gb=18 * per_block / (1 << 30),
        max_num_batched_tokens=24,
        long_prefill_token_threshold=16,
        block_size=8,
    )
    preemptions = count_preemptions(monkeypatch)
    prompts = _prompts(5, length=12, shared=24)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 3 + [
        SamplingParams(temperature=0.9, seed=s, max_tokens=24, ignore_eos=True) for s in (1, 2)
    ]
    done = _same(engines, prompts, params, **kwargs)
    assert engines(True, **kwargs).kv.num_blocks == 18
    assert any(c.num_cached_tokens > 0 for c in done)
    assert preemptions  # both runs preempted


def test_lora_is_unchanged(engines: EngineFactory, model_dir: Path) -> None:
    root = model_dir.parent / "loras"
    kwargs = dict(
        enable_lora=True,
        max_loras=2,
        lora_modules=[f"{name}={root / name}" for name in ADAPTERS],
        lora_root=str(root),
    )
    prompts = _prompts(4)
    params = [SamplingParams(temperature=0, max_tokens=8)] * 2 + [
        SamplingParams(temperature=0.8, seed=6, max_tokens=8)
    ] * 2
    done = _same(engines, prompts, params, ["sql", None, "poem", "sql"], **kwargs)
    base = engines(False).generate(prompts[:1], params[:1])[0]
    assert done[0].token_ids != base.token_ids  # the adapter changed the output


def test_speculative_decoding_is_unchanged(engines: EngineFactory) -> None:
    kwargs = dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    repeat = [[11, 12, 13, 14, 15, 16] * 4, [40, 41, 42] * 6]
    params = [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0.8, seed=3, max_tokens=12),
    ]
    _same(engines, repeat, params, **kwargs)


def test_the_next_step_is_launched_before_the_last_ones_tokens_are_read(
    engines: EngineFactory,
) -> None:
    engine = engines(True)
    engine.add_request(
        Generate(
            request_id="one",
            prompt_token_ids=_prompts(1)[0],
            sampling=SamplingParams(temperature=0, max_tokens=4),
        )
    )
    assert engine.step() == []  # the prefill is launched; its token is on its way
    assert engine.has_unfinished_requests()
    [first] = engine.step()  # the first decode is launched, the prefill's token read
    assert len(first.new_token_ids) == 1
    rest = _drain(engine)
    assert len(first.new_token_ids + rest["one"]) == 4


def test_aborted_and_finished_requests_get_nothing_after_their_last_delta(
    engines: EngineFactory,
) -> None:
    engine = engines(True)
    prompts = _prompts(3)
    for i, max_tokens in enumerate((3, 50, 50)):
        engine.add_request(
            Generate(
                request_id=f"r{i}",
                prompt_token_ids=prompts[i],
                sampling=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
            )
        )
    deltas: list[RequestDelta] = []
    aborted_after = None
    while engine.has_unfinished_requests():
        deltas.extend(engine.step())
        if aborted_after is None and sum(d.request_id == "r1" for d in deltas) >= 4:
            assert engine._launched is not None  # a step of r1 is in flight
            engine.abort(["r1"])
            aborted_after = len(deltas)
    assert aborted_after is not None
    assert all(d.request_id != "r1" for d in deltas[aborted_after:])
    for request_id, expected in (("r0", 3), ("r2", 50)):
        mine = [d for d in deltas if d.request_id == request_id]
        assert sum(len(d.new_token_ids) for d in mine) == expected
        assert [d.finish_reason for d in mine][-1] == "length"
        assert all(d.finish_reason is None for d in mine[:-1])
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def _drain(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return tokens
