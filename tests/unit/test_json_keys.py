"""No key twice in one object (gpu_worker.sampling.json_keys): a JSON constraint's mask
refuses the tokens that would close a key the object already holds, in plain steps,
drafted rows and speculative drafts, and after a rollback; the guard reads the JSON
structure (nesting, arrays, strings holding quotes and braces, escapes) byte by byte."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import numpy as np
import pytest
import torch

from gpu_worker import Engine
from gpu_worker.sampling.json_keys import KeyGuard, QuoteTokens
from gpu_worker.sampling.structured import GrammarMasker, RequestMatcher, StructuredOutputs
from shared.model_source import ModelSource
from shared.protocol import Constraint, Generate
from shared.sampling import SamplingParams

VOCAB = 49152
OPEN = {  # unlisted keys allowed explicitly: the grammar admits "note" again
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "additionalProperties": True,
}
CONSTRAINT = Constraint(kind="json_schema", spec=json.dumps(OPEN))
PREFIX = '{"city": "Paris", "note": "x", "note'
"""Inside a key of an object that holds "note": a token starting `"` would repeat it."""


@pytest.fixture(scope="module")
def structured(smollm2_source: ModelSource) -> StructuredOutputs:
    return StructuredOutputs(smollm2_source, VOCAB, [2])


@pytest.fixture(scope="module")
def quotes(structured: StructuredOutputs) -> QuoteTokens:
    return QuoteTokens(structured.tokenizer)


def matcher_at(structured: StructuredOutputs, text: str, *, guarded: bool = True) -> RequestMatcher:
    matcher = structured.new_matcher(CONSTRAINT, [])
    if not guarded:
        matcher.keys = None
    matcher.sync(structured.tokenizer.tokenize_str(text))
    assert matcher.error is None
    return matcher


def allowed(host: torch.Tensor, row: int = 0) -> list[int]:
    bits = np.unpackbits(host[row].numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:VOCAB]).tolist()


def closes_as(tokenizer: llguidance.LLTokenizer, partial: str, token_id: int) -> str | None:
    """The key `partial` + the token spells when the token holds its closing quote."""
    text = tokenizer.decode_bytes([token_id])
    if b'"' not in text:
        return None
    return partial + text[: text.index(b'"')].decode("utf-8", "replace")


def test_the_mask_refuses_closing_a_key_the_object_holds(structured: StructuredOutputs) -> None:
    masker = GrammarMasker(VOCAB, torch.device("cpu"), [2])
    tokenizer = structured.tokenizer
    free = allowed(masker.fill([matcher_at(structured, PREFIX, guarded=False)]))
    guarded = allowed(masker.fill([matcher_at(structured, PREFIX)]))
    repeats = [t for t in free if closes_as(tokenizer, "note", t) == "note"]
    assert repeats  # the grammar alone admits the repeat: what the guard is for
    assert set(guarded) == set(free) - set(repeats)
    # A new object, or the first key, refuses nothing.
    fresh = '{"city": "Paris", "note": {"note'
    assert allowed(masker.fill([matcher_at(structured, fresh)])) == allowed(
        masker.fill([matcher_at(structured, fresh, guarded=False)])
    )


def test_drafts_stop_before_the_one_that_repeats_a_key(structured: StructuredOutputs) -> None:
    tokenizer = structured.tokenizer
    drafts = tokenizer.tokenize_str('": 1, "')
    assert matcher_at(structured, PREFIX, guarded=False).num_valid_drafts(drafts) == len(drafts)
    head = matcher_at(structured, PREFIX).num_valid_drafts(drafts)
    assert head < len(drafts)
    assert b'"' not in tokenizer.decode_bytes(drafts[:head])


def test_drafted_rows_refuse_a_repeat_after_their_drafts(structured: StructuredOutputs) -> None:
    tokenizer = structured.tokenizer
    masker = GrammarMasker(VOCAB, torch.device("cpu"), [2])
    drafts = tokenizer.tokenize_str(', "note')
    start = '{"city": "Paris", "note": "x"'
    host = masker.fill_drafted([matcher_at(structured, start)], [drafts])
    last = allowed(host, len(drafts))
    assert not [t for t in last if closes_as(tokenizer, "note", t) == "note"]
    free = masker.fill_drafted([matcher_at(structured, start, guarded=False)], [drafts])
    assert [t for t in allowed(free, len(drafts)) if closes_as(tokenizer, "note", t) == "note"]


def test_a_rollback_forgets_the_dropped_keys(structured: StructuredOutputs) -> None:
    masker = GrammarMasker(VOCAB, torch.device("cpu"), [2])
    tokenizer = structured.tokenizer
    matcher = matcher_at(structured, '{"city": "Paris", "note')
    before = allowed(masker.fill([matcher]))
    base = tokenizer.tokenize_str('{"city": "Paris", "note')
    longer = base + tokenizer.tokenize_str('": "x", "note')
    matcher.sync(longer)
    assert allowed(masker.fill([matcher])) != before
    matcher.sync(base)
    assert allowed(masker.fill([matcher])) == before


def guard_after(quotes: QuoteTokens, text: str) -> KeyGuard:
    guard = KeyGuard(quotes)
    for piece in (text[i : i + 3] for i in range(0, len(text), 3)):  # any split reads alike
        guard.feed(piece.encode())
    return guard


@pytest.mark.parametrize(
    ("text", "repeats", "fresh"),
    [
        ('{"a": 1, "', 'a"', 'b"'),
        ('{"a": {"b": 1}, "', 'a"', 'b"'),  # "b" belongs to the inner object
        ('{"a": {"b": 1, "', 'b"', 'a"'),
        ('[{"a": 1}, {"b": 2, "', 'b"', 'a"'),  # each element is its own object
        ('{"a": "x\\", \\"b\\": {", "', 'a"', 'b"'),  # quotes and braces inside a string
        ('{"q\\"x": 1, "q\\', '"x"', 'y"'),  # an escaped quote inside a key
    ],
)
def test_the_guard_reads_the_structure(
    quotes: QuoteTokens, text: str, repeats: str, fresh: str
) -> None:
    guard = guard_after(quotes, text)
    assert guard.is_writing_key
    assert guard.would_repeat(repeats.encode())
    assert not guard.would_repeat(fresh.encode())


def test_no_key_is_being_written_outside_keys(quotes: QuoteTokens) -> None:
    for text in ('{"a": "', '{"a": 1', '["a", "', '{"a": [1, "', '{"a": 1}'):
        assert not guard_after(quotes, text).is_writing_key, text


@pytest.mark.slow  # a SmolLM2 engine
def test_sampled_outputs_hold_no_key_twice(smollm2_tokenizer: Any) -> None:
    """Seed 15 wrote `"temperature"` twice in one object before the guard."""
    engine = Engine(device="cpu", kv_cache_memory_gb=0.1, max_num_seqs=8)
    properties = {"city": {"type": "string"}, "unit": {"type": "string"}}
    schema = {**OPEN, "properties": properties, "required": ["city"]}
    constraint = Constraint(kind="json_schema", spec=json.dumps(schema))
    question = "What is the weather in Paris? Answer as JSON arguments of get_weather."
    prompt = smollm2_tokenizer.encode(
        f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )
    seeds = range(14, 18)  # 15 is the one that repeated a key
    for seed in seeds:
        sampling = SamplingParams(temperature=1.0, seed=seed, max_tokens=120)
        engine.add_request(
            Generate(
                request_id=f"keys-{seed}",
                prompt_token_ids=prompt,
                sampling=sampling,
                constraint=constraint,
            )
        )
    tokens: dict[str, list[int]] = {f"keys-{seed}": [] for seed in seeds}
    finished: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
            if delta.finish_reason is not None:
                finished[delta.request_id] = delta.finish_reason
    complete = [key for key, reason in finished.items() if reason == "stop"]
    assert len(complete) >= len(seeds) // 2
    for key in complete:
        objects: list[list[str]] = []

        def pairs(items: list[tuple[str, Any]], objects: list[list[str]] = objects) -> dict:
            objects.append([name for name, _ in items])
            return dict(items)

        json.loads(smollm2_tokenizer.decode(tokens[key]), object_pairs_hook=pairs)
        assert all(len(names) == len(set(names)) for names in objects), (key, objects)
