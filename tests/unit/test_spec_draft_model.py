"""The draft_model drafter (gpu_worker.engine.draft_model) on tiny random Llamas: the target
as its own draft accepts nearly every draft, a different draft model (padded vocabulary)
fewer, and greedy output is token for token as without speculation either way; drafting
is batched into one round per step, its state is freed at finish and abort, seeded
sampling is reproducible, and a draft model with another tokenizer is refused at start.
The config's draft-model fields are checked here too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpu_worker import Engine
from gpu_worker.core.config import EngineConfig
from gpu_worker.engine.draft_model import DraftModelDrafter, DraftTarget, build_draft_drafter
from gpu_worker.spec_decode.config import SpeculativeConfig, parse_speculative_config
from shared.model_source import resolve_model
from shared.protocol import Generate
from shared.sampling import SamplingParams
from tests.helpers.tiny_models import save_byte_tokenizer, save_tiny_model, save_tiny_tokenizer

K = 4
PROMPTS = [
    [1] + [10 + i % 7 for i in range(40)],
    [3, 4, 5, 6] * 8,
    [9, 8, 7] * 10 + [1, 2],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
VOCAB = 256


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("target"), "llama", tokenizer="words").path


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another random Llama, one layer, its vocabulary padded past the tokenizer's."""
    out_dir, _ = save_tiny_model(
        tmp_path_factory.mktemp("draft"),
        "llama",
        tie_word_embeddings=True,
        seed=1,
        num_hidden_layers=1,
        vocab_size=VOCAB + 16,
    )
    save_tiny_tokenizer(out_dir, VOCAB)
    return out_dir


def _draft_config(draft: Path | str) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=str(draft), num_speculative_tokens=K)


def _with_draft_model(target_dir: Path, draft: Path) -> tuple[Engine, DraftModelDrafter]:
    """The target engine as `--speculative-config` builds it, with a fixed draft length (so
    which steps draft does not depend on the machine's speed)."""
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}
    engine = Engine(
        model=str(target_dir),
        device="cpu",
        kv_cache_memory_gb=0.01,
        speculative_config=json.dumps({**config, "draft_length": "fixed"}),
    )
    assert engine.speculator is not None
    drafter = engine.speculator.drafter
    assert isinstance(drafter, DraftModelDrafter)
    return engine, drafter


@pytest.fixture(scope="module")
def plain(target_dir: Path) -> Engine:
    return Engine(model=str(target_dir), device="cpu", kv_cache_memory_gb=0.01)


@pytest.fixture(scope="module")
def self_drafted(target_dir: Path) -> tuple[Engine, DraftModelDrafter]:
    return _with_draft_model(target_dir, target_dir)


@pytest.fixture(scope="module")
def other_drafted(target_dir: Path, other_draft_dir: Path) -> tuple[Engine, DraftModelDrafter]:
    return _with_draft_model(target_dir, other_draft_dir)


def _tokens(engine: Engine, params: SamplingParams) -> list[list[int]]:
    return [c.token_ids for c in engine.generate(PROMPTS, params)]


def _acceptance(engine: Engine, params: SamplingParams) -> tuple[list[list[int]], float]:
    """The tokens of PROMPTS and the share of this run's drafts that were accepted."""
    before = engine.stats()
    tokens = _tokens(engine, params)
    after = engine.stats()
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert drafted > 0
    return tokens, accepted / drafted


def _all_freed(drafter: DraftModelDrafter) -> bool:
    inner = drafter.engine
    return (
        drafter.num_requests == 0
        and not inner.has_unfinished_requests()
        and inner.kv.num_free_blocks == inner.kv.num_blocks
    )


def test_the_target_as_its_own_draft_is_accepted_and_changes_no_token(
    plain: Engine, self_drafted: tuple[Engine, DraftModelDrafter]
) -> None:
    engine, drafter = self_drafted
    steps, rounds = engine.stats().steps, drafter.num_rounds
    tokens, acceptance = _acceptance(engine, GREEDY)
    assert tokens == _tokens(plain, GREEDY)
    assert acceptance > 0.9
    # One batched round per target step at most, however many requests drafted in it.
    assert 0 < drafter.num_rounds - rounds <= engine.stats().steps - steps
    assert _all_freed(drafter)


def test_another_draft_model_is_accepted_less_and_changes_no_token(
    plain: Engine, other_drafted: tuple[Engine, DraftModelDrafter]
) -> None:
    engine, drafter = other_drafted
    tokens, acceptance = _acceptance(engine, GREEDY)
    assert tokens == _tokens(plain, GREEDY)
    assert acceptance < 0.5  # unrelated random weights: the target's own draft gets > 0.9
    assert _all_freed(drafter)


def test_seeded_sampling_is_reproducible(
    other_drafted: tuple[Engine, DraftModelDrafter],
) -> None:
    engine, drafter = other_drafted
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16)
    first, _ = _acceptance(engine, seeded)
    again, _ = _acceptance(engine, seeded)
    assert again == first
    assert _all_freed(drafter)


def test_aborted_requests_leave_nothing_in_the_draft_engine(
    self_drafted: tuple[Engine, DraftModelDrafter],
) -> None:
    engine, drafter = self_drafted
    endless = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    keys = [f"abort-{i}" for i in range(len(PROMPTS))]
    for key, prompt in zip(keys, PROMPTS, strict=True):
        engine.add_request(Generate(request_id=key, prompt_token_ids=prompt, sampling=endless))
    rounds = drafter.num_rounds
    for _ in range(10):  # the first decode steps draft (the second step at the latest)
        engine.step()
        if drafter.num_rounds > rounds:
            break
    assert drafter.num_rounds > rounds
    assert drafter.num_requests == len(keys)
    engine.abort(keys)
    assert _all_freed(drafter)


def _unloaded_target(model_dir: Path) -> DraftTarget:
    """A target described without loading it: the tokenizer check reads files only."""
    return DraftTarget(
        config=EngineConfig(model=str(model_dir), device="cpu"),
        source=resolve_model(str(model_dir)),
        device=torch.device("cpu"),
        dtype=torch.float32,
        vocab_size=VOCAB,
        num_kv_tokens=64,
    )


def test_a_planned_round_drafts_only_what_the_step_may_ask(target_dir: Path) -> None:
    # With the adaptive draft length the engine tells the drafter each request's limit
    # before the step: the round drafts those requests, no further than their limits.
    config = {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": K}
    engine = Engine(
        model=str(target_dir),
        device="cpu",
        kv_cache_memory_gb=0.01,
        speculative_config=json.dumps(config),
    )
    assert engine.speculator is not None
    drafter = engine.speculator.drafter
    assert isinstance(drafter, DraftModelDrafter)
    for request_id, prompt in (("x", PROMPTS[0]), ("y", PROMPTS[1])):
        drafter.start_request(request_id, prompt)
        drafter.add_tokens(request_id, [5])
    drafter.expect({"x": 2, "y": 0})
    block_size = engine.config.block_size
    # Before its first round the whole prompt is to compute; the plan counts a steady
    # round's share of it (a block and K more).
    assert drafter.catch_up_tokens("x") == block_size + K + 1
    assert len(drafter.propose("x", K)) == 2
    assert drafter.num_rounds == 1
    # The round's steps, timed by what they computed: the 42 tokens, then the 2nd draft.
    assert [step.num_tokens for step in drafter.take_steps()] == [42, 1]
    assert drafter.take_steps() == []
    assert drafter.catch_up_tokens("x") == 42 - 42 // block_size * block_size
    # "y" was left out of that round: asked anyway, it is drafted in one of its own.
    assert len(drafter.propose("y", 1)) == 1
    assert drafter.num_rounds == 2
    for request_id in ("x", "y"):
        drafter.finish_request(request_id)
    assert _all_freed(drafter)
    # Greedy output stays the plain one whatever the controller plans.
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == _tokens(
        Engine(model=str(target_dir), device="cpu", kv_cache_memory_gb=0.01), GREEDY
    )


def test_a_draft_model_with_another_tokenizer_is_refused(tmp_path: Path, target_dir: Path) -> None:
    draft_dir, _ = save_tiny_model(tmp_path, "llama", tie_word_embeddings=False)
    save_byte_tokenizer(draft_dir)
    with pytest.raises(ValueError, match="does not share the tokenizer") as refused:
        build_draft_drafter(_draft_config(draft_dir), _unloaded_target(target_dir), Engine)
    assert repr(str(draft_dir)) in str(refused.value)
    assert repr(target_dir.name) in str(refused.value)


def test_a_missing_draft_model_is_refused_naming_it(target_dir: Path) -> None:
    with pytest.raises(ValueError, match="model 'no-such-draft'"):
        build_draft_drafter(_draft_config("no-such-draft"), _unloaded_target(target_dir), Engine)


def test_draft_model_fields_parse() -> None:
    config = parse_speculative_config(
        '{"method": "draft_model", "model": "m", "num_speculative_tokens": 3, '
        '"draft_tensor_parallel_size": 1, "max_model_len": 512, "enforce_eager": true}'
    )
    assert (config.model, config.num_speculative_tokens) == ("m", 3)
    assert (config.draft_tensor_parallel_size, config.max_model_len) == (1, 512)
    assert config.enforce_eager is True


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ('"draft_tensor_parallel_size": 2', "draft_tensor_parallel_size"),
        ('"max_model_len": 0', "max_model_len"),
        ('"quantization": "fp8"', "quantization"),
        ('"revision": "main"', "revision"),
        ('"code_revision": "main"', "code_revision"),
    ],
)
def test_unserved_draft_model_fields_are_refused_by_name(fields: str, named: str) -> None:
    text = '{"method": "draft_model", "model": "m", "num_speculative_tokens": 3, ' + fields + "}"
    with pytest.raises(ValueError, match=named):
        parse_speculative_config(text)


def test_draft_model_fields_belong_to_draft_model() -> None:
    with pytest.raises(ValueError, match="max_model_len belongs to method 'draft_model'"):
        parse_speculative_config(
            '{"method": "ngram", "num_speculative_tokens": 2, "max_model_len": 64}'
        )
