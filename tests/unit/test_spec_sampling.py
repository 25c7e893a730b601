"""Speculative decoding for requests with every sampling feature (gpu_worker.sampling.target,
gpu_worker.engine.speculation): penalties, min_tokens, logit_bias, bad words, allowed ids,
logprobs and structured outputs each give, greedy and seeded, the tokens, finish reasons
and logprobs of plain decoding, while drafts are proposed and accepted for them; and the
grammar cuts a constrained request's drafts where plain decoding could not follow them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpu_worker import Engine
from gpu_worker.engine.engine import Completion
from gpu_worker.sampling.structured import RequestMatcher
from shared.constraints import new_matcher
from shared.protocol import Constraint, Generate
from shared.sampling import SamplingParams
from tests.helpers.spec_engines import METHODS, spec_engine
from tests.helpers.tiny_models import EOS, save_tiny_model

# Prompts that repeat themselves, so drafts from the prompt and output get accepted.
PROMPTS = [
    [1] + [10 + i % 7 for i in range(40)],
    [3, 4, 5, 6] * 8,
    list(range(20, 60)),
    [9, 8, 7] * 10 + [1, 2],
]
TINY_EOS = 2  # LlamaConfig's default, the tiny word-level model's EOS
MIN_TOKENS = 12
# Each case's params, with logprobs, for a greedy and a seeded sampled run. Values are
# picked so that drafts still pass: a penalty that forbids every repeat would leave the
# drafters nothing to copy.
CASES: dict[str, dict[str, Any]] = {
    "penalties": dict(repetition_penalty=1.1, frequency_penalty=-0.5, presence_penalty=0.3),
    # A strong pull to EOS: the output ends right at min_tokens, EOS masked before it.
    "min_tokens": dict(min_tokens=MIN_TOKENS, logit_bias={TINY_EOS: 6.0, 12: 1.5}),
    "logit_bias": dict(logit_bias={12: 1.5, 30: -2.0}),
    # Longer words ban what the greedy output repeats (158 158 158... under this bias):
    # a draft may be the prefix that bans the next row's token.
    "bad_words": dict(logit_bias={12: 1.5}, bad_words_token_ids=[[158, 158, 158], [57, 57], [200]]),
    "allowed_ids": dict(allowed_token_ids=list(range(3, 20))),
    "top_logprobs": dict(logprobs=5),
}


def _params(case: dict[str, Any], max_tokens: int = 30) -> list[SamplingParams]:
    args = {"logprobs": 2, "max_tokens": max_tokens, **case}
    return [
        SamplingParams(temperature=0.0, **args),
        SamplingParams(temperature=0.3, seed=5, **args),
    ]


@pytest.fixture(scope="module")
def byte_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model over byte tokens, whose vocabulary llguidance can read."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-byte-llama"), tokenizer="bytes").path


def _assert_same(got: list[Completion], want: list[Completion]) -> None:
    """Tokens, finish and logprobs as plain decoding's; logprobs to rounding, since a
    verify row's logits come from a batch laid out unlike plain decoding's."""
    for g, w in zip(got, want, strict=True):
        assert (g.token_ids, g.finish_reason, g.stop_token_id) == (
            w.token_ids,
            w.finish_reason,
            w.stop_token_id,
        )
        assert g.logprobs is not None
        assert w.logprobs is not None
        assert len(g.logprobs) == len(w.logprobs) == len(w.token_ids)
        for a, b in zip(g.logprobs, w.logprobs, strict=True):
            assert (a.rank, a.top_token_ids) == (b.rank, b.top_token_ids)
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-4)


def _accepted_while(engine: Engine, run: Any) -> tuple[Any, int]:
    """`run()`'s result and the drafts `engine` accepted meanwhile."""
    before = engine.stats().spec_num_accepted_tokens
    result = run()
    return result, engine.stats().spec_num_accepted_tokens - before


@pytest.mark.parametrize("case", sorted(CASES))
def test_drafted_requests_decode_as_plain_decoding(plain: Engine, spec: Engine, case: str) -> None:
    greedy, seeded = _params(CASES[case])
    prompts = PROMPTS * 2
    params = [greedy] * len(PROMPTS) + [seeded] * len(PROMPTS)
    want = plain.generate(prompts, params)
    got, accepted = _accepted_while(spec, lambda: spec.generate(prompts, params))
    _assert_same(got, want)
    assert accepted > 0
    if case == "min_tokens":
        assert all(c.token_ids.index(TINY_EOS) == MIN_TOKENS for c in want)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 6},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}
JSON_PROMPTS = [
    list((text * 3).encode())
    for text in (
        '{"name": "ab", "tags": ["red", "green", "blue", "red"]}',
        '{"name":"xyz","tags":["green","green"]}',
    )
]


def _constrained(engine: Engine, params: list[SamplingParams]) -> list[tuple[list[int], str]]:
    """Every request under SCHEMA, in one batch: (tokens, finish reason) in order."""
    prompts = JSON_PROMPTS * (len(params) // len(JSON_PROMPTS))
    got: dict[str, tuple[list[int], str]] = {}
    for i, (prompt, sampling) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(
            Generate(
                request_id=f"json-{i}",
                prompt_token_ids=prompt,
                sampling=sampling,
                constraint=Constraint(kind="json_schema", spec=json.dumps(SCHEMA)),
            )
        )
        got[f"json-{i}"] = ([], "")
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens, _ = got[delta.request_id]
            got[delta.request_id] = (tokens + delta.new_token_ids, delta.finish_reason or "")
    return list(got.values())


@pytest.mark.parametrize("method", sorted(METHODS))
def test_structured_outputs_decode_as_plain_decoding(byte_model_dir: Path, method: str) -> None:
    greedy, seeded = _params({}, max_tokens=80)
    params = [greedy, greedy, seeded, seeded]
    want = _constrained(spec_engine(byte_model_dir, None), params)
    engine = spec_engine(byte_model_dir, METHODS[method])
    got, accepted = _accepted_while(engine, lambda: _constrained(engine, params))
    assert got == want
    assert accepted > 0
    for tokens, finish in got:
        # The grammar completes and the request stops with it, without an EOS token.
        assert finish == "stop"
        assert EOS not in tokens


def _matcher(engine: Engine, constraint: Constraint, gate: bytes | None = None) -> RequestMatcher:
    tokenizer = engine.structured.tokenizer
    return RequestMatcher(new_matcher(constraint, tokenizer), gate, tokenizer)


def test_drafts_end_before_what_the_grammar_refuses_or_completes(byte_model_dir: Path) -> None:
    engine = spec_engine(byte_model_dir, METHODS["ngram"])
    matcher = _matcher(engine, Constraint(kind="regex", spec="ab[0-9]{2}"))
    assert matcher.num_valid_drafts(list(b"ab1x")) == 3  # 'x' refused
    assert matcher.num_valid_drafts(list(b"ab12")) == 3  # '2' completes it
    assert matcher.num_valid_drafts(list(b"ab")) == 2
    assert matcher.num_valid_drafts([]) == 0
    # The matcher did not move: it still takes the whole answer.
    matcher.sync(list(b"ab12"))
    assert matcher.is_stopped
    assert matcher.error is None

    gated = _matcher(engine, Constraint(kind="regex", spec="[0-9]+"), b"</t>")
    gated.sync(list(b"thinking </"))
    # Free text until the gate; the draft that passes it ends the drafts.
    assert gated.num_valid_drafts(list(b"t>12")) == 1
    assert gated.num_valid_drafts(list(b"x>12")) == 4
    assert not gated.is_active
