"""Structured outputs: constraints compile or are refused with a reason (shared.constraints),
the worker holds every output to its constraint across seeds, temperatures, mixed batches
and preemption (gpu_worker.sampling.structured through the offline Engine), and the render tier
reads the request fields (render_server.generation.structured)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from gpu_worker import Engine
from gpu_worker.engine.errors import RequestRejected
from gpu_worker.sampling.structured import GrammarMasker, RequestMatcher, lltokenizer_from_source
from render_server.generation.structured import ConstraintValidator, constraint_from_request
from render_server.schemas.errors import ApiError
from render_server.schemas.generation import ChatCompletionRequest
from render_server.worker_client.routing import continuation
from shared.constraints import lltokenizer_from_hf, new_matcher, validate
from shared.model_source import ModelSource
from shared.protocol import MAX_CONSTRAINT_CHARS, Constraint, Generate
from shared.sampling import SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "address", "pets", "role"],
    "additionalProperties": False,
}
SHORT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PHONE = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["yes", "no", "maybe later"]
LARK = 'start: "(" num (" + " num)? (" + " num)? ")"\nnum: /[1-9][0-9]?/'
LARK_TEXT = re.compile(r"\([1-9][0-9]?( \+ [1-9][0-9]?){0,2}\)")


def chat(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(
        f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )


def run(
    engine: Engine, requests: list[tuple[list[int], SamplingParams, Constraint | None]]
) -> list[tuple[list[int], str]]:
    """Every request in one continuous batch; (token ids, finish reason) in order."""
    keys = [f"test-{id(requests)}-{i}" for i in range(len(requests))]
    for key, (prompt, sampling, constraint) in zip(keys, requests, strict=True):
        engine.add_request(
            Generate(
                request_id=key, prompt_token_ids=prompt, sampling=sampling, constraint=constraint
            )
        )
    tokens: dict[str, list[int]] = {key: [] for key in keys}
    finish: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
            if delta.finish_reason is not None:
                finish[delta.request_id] = delta.finish_reason
    return [(tokens[key], finish[key]) for key in keys]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(device="cpu", kv_cache_memory_gb=0.1, max_num_seqs=32)


@pytest.fixture(scope="module")
def lltokenizer(smollm2_tokenizer: Any) -> Any:
    tok = smollm2_tokenizer
    return lltokenizer_from_hf(tok.hf, vocab_size=tok.vocab_size, eos_token_ids=tok.eos_token_ids)


def json_schema(schema: dict) -> Constraint:
    return Constraint(kind="json_schema", spec=json.dumps(schema))


# ---- the worker: outputs hold to their constraints ----------------------------------


@pytest.mark.slow  # a SmolLM2 engine
def test_mixed_batch_every_constrained_output_parses_and_free_rows_are_untouched(
    engine: Engine, smollm2_tokenizer: Any
) -> None:
    tok = smollm2_tokenizer
    person = chat(tok, "Describe a person as JSON.")
    free_prompt = chat(tok, "What is the capital of France?")
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    requests: list[tuple[list[int], SamplingParams, Constraint | None]] = []
    for temperature in (0.0, 0.8, 1.3):
        for seed in (1, 2):
            sampling = SamplingParams(temperature=temperature, seed=seed, max_tokens=160)
            requests.append((person, sampling, json_schema(PERSON)))
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=40)
    requests += [
        (chat(tok, "Give me a phone number."), sampled, Constraint(kind="regex", spec=PHONE)),
        (
            chat(tok, "Should I go out?"),
            sampled,
            Constraint(kind="choice", spec=json.dumps(CHOICES)),
        ),
        (chat(tok, "Add some numbers."), sampled, Constraint(kind="grammar", spec=LARK)),
        (
            chat(tok, "What is the capital of France? Answer in JSON."),
            SamplingParams(temperature=0.0, max_tokens=80),
            Constraint(kind="json_object"),
        ),
        (free_prompt, free, None),
        (
            free_prompt,
            SamplingParams(temperature=1.0, seed=4, max_tokens=12, ignore_eos=True),
            None,
        ),
    ]
    outputs = run(engine, requests)
    texts = [tok.decode(ids) for ids, _ in outputs]
    for (ids, finish), text in zip(outputs[:6], texts[:6], strict=True):
        assert finish == "stop", (text, ids)
        jsonschema.validate(json.loads(text), PERSON)
        assert ids[-1] not in engine.eos_token_ids  # ended when the grammar did
    phone, choice, lark, obj, greedy_free, sampled_free = zip(outputs[6:], texts[6:], strict=True)
    assert phone[0][1] == "stop", phone
    assert re.fullmatch(PHONE, phone[1]), phone
    assert choice[0][1] == "stop", choice
    assert choice[1] in CHOICES, choice
    assert lark[0][1] == "stop", lark
    assert LARK_TEXT.fullmatch(lark[1]), lark
    assert obj[0][1] == "stop", obj
    assert isinstance(json.loads(obj[1]), dict), obj
    # Free rows are not masked: the greedy one matches the same request run on its own.
    [(alone, _)] = run(engine, [(free_prompt, free, None)])
    assert greedy_free[0][0] == alone
    assert len(sampled_free[0][0]) == 12


@pytest.mark.slow  # a SmolLM2 engine
def test_constraint_state_survives_preemption_with_a_tiny_cache(
    engine: Engine, smollm2_tokenizer: Any
) -> None:
    tok = smollm2_tokenizer
    questions = ["Describe a person as JSON.", "Who lives next door? JSON please."]
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    requests = [(chat(tok, questions[i % 2]), greedy, json_schema(SHORT)) for i in range(4)]
    expected = run(engine, requests)
    # 6 blocks of 16 tokens: 4 sequences of ~35 tokens cannot all fit at once, so some
    # are preempted with output (and matcher state) behind them, then recomputed.
    small = Engine(device="cpu", kv_cache_memory_gb=6 * 737_280 / (1 << 30), max_num_seqs=4)
    preempted_with_output: list[int] = []
    preempt = small.scheduler._preempt

    def counting(seq: Any) -> None:
        if seq.num_output_tokens:
            preempted_with_output.append(seq.num_output_tokens)
        preempt(seq)

    small.scheduler._preempt = counting  # type: ignore[method-assign]
    outputs = run(small, requests)
    assert preempted_with_output, "no sequence was preempted after it had output"
    assert outputs == expected
    for ids, finish in outputs:
        assert finish == "stop"
        jsonschema.validate(json.loads(tok.decode(ids)), SHORT)
    assert small.kv.num_free_blocks == small.kv.num_blocks


@pytest.mark.slow  # a SmolLM2 engine
def test_the_worker_refuses_constraints_that_do_not_compile(engine: Engine) -> None:
    sampling = SamplingParams(max_tokens=4)
    for constraint in (
        Constraint(kind="regex", spec="(unclosed"),
        Constraint(kind="json_schema", spec='{"type": "no-such-type"}'),
        Constraint(kind="json_schema", spec="not json"),
        Constraint(kind="grammar", spec="start: undefined_rule"),
        Constraint(kind="choice", spec="[]"),
    ):
        request = Generate(
            request_id="bad", prompt_token_ids=[1, 2], sampling=sampling, constraint=constraint
        )
        with pytest.raises(RequestRejected) as info:
            engine.add_request(request)
        assert info.value.code == "invalid_request"
        assert info.value.message.startswith("constraint: ")
    assert not engine.has_unfinished_requests()


@pytest.mark.slow  # a SmolLM2 engine
def test_a_resumed_request_continues_its_constraint(engine: Engine, smollm2_tokenizer: Any) -> None:
    # As after a failover: the earlier output is in the prompt and counted as resumed.
    tok = smollm2_tokenizer
    done = tok.encode("maybe", add_special_tokens=False)
    prompt = chat(tok, "Should I go out?") + done
    constraint = Constraint(kind="choice", spec=json.dumps(CHOICES), num_resumed_tokens=len(done))
    [(ids, finish)] = run(engine, [(prompt, SamplingParams(temperature=0.0), constraint)])
    assert finish == "stop"
    assert tok.decode(done + ids) == "maybe later"
    wrong = Constraint(kind="regex", spec="[0-9]+", num_resumed_tokens=len(done))
    with pytest.raises(RequestRejected):
        run(engine, [(prompt, SamplingParams(), wrong)])


def test_a_failover_continuation_counts_the_resumed_tokens() -> None:
    constraint = Constraint(kind="regex", spec="[a-z]+")
    request = Generate(
        request_id="r", prompt_token_ids=[1, 2], sampling=SamplingParams(), constraint=constraint
    )
    once = continuation(request, [5, 6])
    assert once.prompt_token_ids == [1, 2, 5, 6]
    assert once.constraint == Constraint(kind="regex", spec="[a-z]+", num_resumed_tokens=2)
    twice = continuation(once, [7])
    assert twice.constraint is not None
    assert twice.constraint.num_resumed_tokens == 3


# ---- the worker's pieces ------------------------------------------------------------


def test_the_worker_reads_the_same_vocabulary_as_the_render_tier(
    smollm2_source: ModelSource, lltokenizer: Any
) -> None:
    ours = lltokenizer_from_source(smollm2_source, lltokenizer.vocab_size, lltokenizer.eos_tokens)
    for token_id in range(lltokenizer.vocab_size):
        assert ours.decode_bytes([token_id]) == lltokenizer.decode_bytes([token_id]), token_id
        assert ours.is_special_token(token_id) == lltokenizer.is_special_token(token_id)


def test_masks_touch_only_constrained_rows(lltokenizer: Any) -> None:
    vocab = lltokenizer.vocab_size
    masker = GrammarMasker(vocab, torch.device("cpu"), lltokenizer.eos_tokens)
    matchers = [
        RequestMatcher(new_matcher(Constraint(kind="choice", spec='["yes", "no"]'), lltokenizer)),
        RequestMatcher(new_matcher(Constraint(kind="regex", spec="[0-9]+"), lltokenizer)),
    ]
    logits = torch.randn(4, vocab)
    masked = logits.clone()
    masker.apply(masked, [0, 2], matchers)
    assert torch.equal(masked[1], logits[1])
    assert torch.equal(masked[3], logits[3])
    for row, matcher in zip((0, 2), matchers, strict=True):
        allowed = torch.isfinite(masked[row]).nonzero().flatten().tolist()
        assert allowed
        for token_id in allowed:
            text = lltokenizer.decode_str([token_id])
            assert matcher.matcher.validate_tokens([token_id]) == 1, text
        assert torch.equal(masked[row, allowed], logits[row, allowed])
    # Every row constrained takes the in-place path; the result is the same.
    both = logits[[0, 2]].clone()
    masker.apply(both, [0, 1], matchers)
    assert torch.equal(both, masked[[0, 2]])


def test_sync_rolls_back_dropped_tokens_and_catches_up(lltokenizer: Any) -> None:
    constraint = Constraint(kind="regex", spec="[a-z]+ [0-9]+")
    tokens = lltokenizer.tokenize_str("abc 123")
    matcher = RequestMatcher(new_matcher(constraint, lltokenizer))
    matcher.sync(tokens)
    assert matcher.num_consumed == len(tokens)
    assert matcher.matcher.is_accepting()
    matcher.sync(tokens[:1])  # the engine dropped tokens: the matcher follows
    fresh = new_matcher(constraint, lltokenizer)
    fresh.consume_tokens(tokens[:1])
    assert matcher.matcher.compute_bitmask() == fresh.compute_bitmask()
    matcher.sync(tokens)
    assert matcher.matcher.is_accepting()
    assert matcher.error is None


# ---- compiling and validating -------------------------------------------------------


@pytest.mark.parametrize(
    "constraint",
    [
        json_schema(PERSON),
        Constraint(kind="json_object"),
        Constraint(kind="regex", spec=PHONE),
        Constraint(kind="choice", spec=json.dumps(CHOICES)),
        Constraint(kind="grammar", spec=LARK),
        Constraint(kind="grammar", spec='root ::= "a" [0-9]+'),  # GBNF
    ],
    ids=lambda c: c.kind,
)
def test_valid_constraints_validate(constraint: Constraint, lltokenizer: Any) -> None:
    assert validate(constraint, lltokenizer) is None


@pytest.mark.parametrize(
    ("constraint", "words"),
    [
        (Constraint(kind="json_schema", spec="{not json"), "not valid JSON"),
        (Constraint(kind="json_schema", spec="[1, 2]"), "must be an object"),
        (Constraint(kind="json_schema", spec='{"type": "object", "minProperties": "x"}'), ""),
        (Constraint(kind="regex", spec="(unclosed"), "unclosed group"),
        (Constraint(kind="grammar", spec="start: missing"), "missing"),
        (Constraint(kind="choice", spec='["a", 1]'), "list of strings"),
        (Constraint(kind="regex", spec="a{1000000}"), "lexer"),  # a bomb: out of fuel
        (Constraint(kind="regex", spec="(a{100}){100}{100}"), "lexer"),
        (json_schema({"properties": {f"p{i}": {} for i in range(2001)}}), "2000 properties"),
        (
            Constraint(kind="json_schema", spec='{"items": ' * 5000 + "{}" + "}" * 5000),
            "nested too deeply",
        ),
    ],
)
def test_invalid_constraints_say_why(constraint: Constraint, words: str, lltokenizer: Any) -> None:
    error = validate(constraint, lltokenizer)
    assert error is not None
    assert words in error
    assert len(error) < 1100


CHAIN_CHILD = """
import sys
from gpu_worker.sampling.structured import lltokenizer_from_source
from shared.constraints import new_matcher, validate
from shared.model_source import resolve_model
from shared.protocol import MAX_CONSTRAINT_CHARS, Constraint

rules = "\\n".join(f'r{i}: "a" r{i + 1} | "b"' for i in range(10_000))
chain = Constraint(kind="grammar", spec=f'start: r0\\n{rules}\\nr10000: "z"')
assert len(chain.spec) <= MAX_CONSTRAINT_CHARS
tokenizer = lltokenizer_from_source(resolve_model(sys.argv[1]), 49152, [2])
assert not new_matcher(chain, tokenizer).is_error()
print(validate(chain, tokenizer))
"""


@pytest.mark.slow  # a fresh interpreter builds a 10k-rule grammar
def test_a_deeply_chained_grammar_compiles_instead_of_overflowing_the_stack(
    smollm2_source: ModelSource,
) -> None:
    # 10k rules, each referring to the next: building this matcher on an 8 MB stack
    # segfaults. In a child process, so a regression fails this test, not the session.
    child = subprocess.run(
        [sys.executable, "-c", CHAIN_CHILD, str(smollm2_source.path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip() == "None" or "too complex" in child.stdout


def test_a_slow_constraint_misses_the_render_deadline(smollm2_tokenizer: Any) -> None:
    async def check() -> tuple[str | None, str | None]:
        validator = ConstraintValidator(smollm2_tokenizer, timeout_s=1e-4)
        await validator.check(Constraint(kind="json_object"))  # builds the tokenizer view
        slow = await validator.check(Constraint(kind="regex", spec="(a{100}){100}{100}"))
        validator.timeout_s = 5.0
        fine = await validator.check(Constraint(kind="regex", spec=PHONE))
        return slow, fine

    slow, fine = asyncio.run(check())
    assert slow is not None
    assert "too complex" in slow
    assert fine is None


# ---- request fields (render tier) ---------------------------------------------------


def _request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields}
    )


@pytest.mark.parametrize(
    ("fields", "kind", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": PERSON, "strict": True},
                }
            },
            "json_schema",
            "response_format",
        ),
        ({"structured_outputs": {"json": PERSON}}, "json_schema", "structured_outputs"),
        ({"structured_outputs": {"json": json.dumps(PERSON)}}, "json_schema", "structured_outputs"),
        ({"structured_outputs": {"regex": PHONE}}, "regex", "structured_outputs"),
        ({"structured_outputs": {"choice": CHOICES}}, "choice", "structured_outputs"),
        ({"structured_outputs": {"grammar": LARK}}, "grammar", "structured_outputs"),
        ({"structured_outputs": {"json_object": True}}, "json_object", "structured_outputs"),
        ({"guided_json": PERSON}, "json_schema", "guided_json"),
        ({"guided_regex": PHONE}, "regex", "guided_regex"),
        ({"guided_choice": CHOICES}, "choice", "guided_choice"),
        ({"guided_grammar": LARK}, "grammar", "guided_grammar"),
    ],
)
def test_request_fields_become_one_constraint(fields: dict, kind: str, param: str) -> None:
    found = constraint_from_request(_request(**fields))
    assert found is not None
    constraint, named = found
    assert (constraint.kind, named) == (kind, param)
    if kind == "json_schema":
        assert json.loads(constraint.spec) == PERSON
    if kind == "choice":
        assert json.loads(constraint.spec) == CHOICES


def test_no_constraint_fields_mean_no_constraint() -> None:
    assert constraint_from_request(_request()) is None
    assert constraint_from_request(_request(response_format={"type": "text"})) is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"guided_json": [1]}, "guided_json"),
        ({"guided_regex": "a" * (MAX_CONSTRAINT_CHARS + 1)}, "guided_regex"),
        ({"structured_outputs": {"structural_tag": {}}}, "structured_outputs.structural_tag"),
        (
            {"structured_outputs": {"json": {}, "whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
        ),
        (
            {"structured_outputs": {"json": {}, "disable_fallback": True}},
            "structured_outputs.disable_fallback",
        ),
    ],
)
def test_bad_constraint_fields_are_400_naming_the_field(fields: dict, param: str) -> None:
    with pytest.raises(ApiError) as info:
        constraint_from_request(_request(**fields))
    assert info.value.status_code == 400
    assert info.value.info.param == param
