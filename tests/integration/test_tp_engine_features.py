"""`Engine(tensor_parallel_size=2)` on CPU gives TP=1's results on each tiny model family
(the families of test_tp_model: Llama with biases untied, Qwen3, Phi-3, Gemma 2, a
SmolLM2-shaped Llama whose 9 heads over 3 KV heads split unevenly, Mixtral and Qwen3-MoE
with a dense layer) for greedy decoding (first-step top-20 logprobs within 1e-4), chunked
prefill mixed with decodes (prompt logprobs included) and structured outputs (JSON schema,
regex, choice).

Structured outputs need a vocabulary whose tokens are bytes (a word-level one has none), so
every model gets a byte-level tokenizer: ids 0-255 are the bytes, 256-258 the specials, an
odd vocabulary of 259 rows whose last rank's shard is padded. One engine per model and
TP size runs every check; each TP=2 engine spawns its second rank once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest

from gpu_worker.engine.engine import Engine
from shared.protocol import Constraint, Generate, TokenLogprobs
from shared.sampling import SamplingParams
from tests.helpers.tiny_models import save_tiny_model
from tests.integration.test_tp_model import MODELS as FAMILIES
from tests.unit.test_structured import CHOICES, PHONE, SHORT

# Every family of test_tp_model, the mixture-of-experts ones included.
NAMES = list(FAMILIES)

# A step of at most 32 tokens, and at most 16 of one prompt: LONG_PROMPT takes 8 steps.
CHUNKING = dict(max_num_batched_tokens=32, long_prefill_token_threshold=16)
LONG_PROMPT = [(37 * i + 11) % 256 for i in range(120)]
SHORT_PROMPTS = [list(b"Once upon a time"), list(b"{}[]()"), [5, 200, 17, 99]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=20)

CONSTRAINTS = [
    Constraint(kind="json_schema", spec=json.dumps(SHORT)),
    Constraint(kind="regex", spec=PHONE),
    Constraint(kind="choice", spec=json.dumps(CHOICES)),
]


@dataclass
class Features:
    """What one engine produced for every check."""

    greedy: list[list[int]]
    first_logprobs: list[TokenLogprobs]
    chunked: dict[str, list[int]]
    long_prompt_logprobs: list[float]
    steps_to_long_first_token: int
    decoded_while_long_prefilled: int
    structured: list[tuple[list[int], str]]


class _Collector:
    """Steps an engine and keeps every request's tokens, finish reason and prompt logprobs."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.prompt_logprobs: dict[str, list[float]] = {}

    def add(self, request: Generate) -> None:
        self.tokens[request.request_id] = []
        self.engine.add_request(request)

    def step(self) -> None:
        for delta in self.engine.step():
            self.tokens[delta.request_id].extend(delta.new_token_ids)
            if delta.finish_reason is not None:
                self.finish[delta.request_id] = delta.finish_reason
            if delta.prompt_logprobs is not None:
                # The first prompt token has no logprob: nothing comes before it.
                entries = [entry for entry in delta.prompt_logprobs[1:] if entry is not None]
                self.prompt_logprobs[delta.request_id] = [entry.logprob for entry in entries]

    def run_to_end(self) -> None:
        while self.engine.has_unfinished_requests():
            self.step()


def _chunked_prefill(engine: Engine) -> tuple[_Collector, int, int]:
    """Short requests start decoding, then LONG_PROMPT joins and prefills in chunks beside
    them. Returns the collector, the steps the long request took to its first token and
    the tokens the short ones decoded in those steps."""
    run = _Collector(engine)
    decode = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    decoders = [f"decode-{i}" for i in range(len(SHORT_PROMPTS))]
    for request_id, prompt in zip(decoders, SHORT_PROMPTS, strict=True):
        run.add(Generate(request_id=request_id, prompt_token_ids=prompt, sampling=decode))
    run.step()
    run.step()
    assert all(run.tokens[request_id] for request_id in decoders), "not decoding yet"
    sampling = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    run.add(Generate(request_id="long", prompt_token_ids=LONG_PROMPT, sampling=sampling))
    decoded_before = sum(len(run.tokens[request_id]) for request_id in decoders)
    steps = 0
    while not run.tokens["long"]:
        run.step()
        steps += 1
    decoded = sum(len(run.tokens[request_id]) for request_id in decoders) - decoded_before
    run.run_to_end()
    return run, steps, decoded


def _structured(engine: Engine) -> list[tuple[list[int], str]]:
    """Each constraint's greedy output and finish reason, in one batch."""
    run = _Collector(engine)
    sampling = SamplingParams(temperature=0, max_tokens=60)
    prompt = list(b"Describe a person: ")
    for i, constraint in enumerate(CONSTRAINTS):
        run.add(
            Generate(
                request_id=f"structured-{i}",
                prompt_token_ids=prompt,
                sampling=sampling,
                constraint=constraint,
            )
        )
    run.run_to_end()
    return [(run.tokens[f"structured-{i}"], run.finish[f"structured-{i}"]) for i in range(3)]


def _features(model_dir: Path, tensor_parallel_size: int) -> Features:
    with Engine(
        model=str(model_dir),
        device="cpu",
        tensor_parallel_size=tensor_parallel_size,
        dist_timeout_s=30.0,
        **CHUNKING,
    ) as engine:
        greedy = engine.generate(SHORT_PROMPTS, GREEDY)
        chunked, steps, decoded = _chunked_prefill(engine)
        structured = _structured(engine)
    first_logprobs = []
    for completion in greedy:
        assert completion.logprobs is not None
        first_logprobs.append(completion.logprobs[0])
    return Features(
        greedy=[completion.token_ids for completion in greedy],
        first_logprobs=first_logprobs,
        chunked=chunked.tokens,
        long_prompt_logprobs=chunked.prompt_logprobs["long"],
        steps_to_long_first_token=steps,
        decoded_while_long_prefilled=decoded,
        structured=structured,
    )


@pytest.fixture(scope="module")
def features(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Features, ...]]:
    """Per family: (TP=1's features, TP=2's), each computed once, when first asked for."""
    root = tmp_path_factory.mktemp("tp_features")
    cache: dict[str, tuple[Features, ...]] = {}

    def of(name: str) -> tuple[Features, ...]:
        if name not in cache:
            model_dir = save_tiny_model(root / name, tokenizer="bytes", **FAMILIES[name]).path
            cache[name] = tuple(_features(model_dir, size) for size in (1, 2))
        return cache[name]

    return of


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_and_first_step_logprobs_equal_tp1(
    features: Callable[[str], tuple[Features, ...]], name: str
) -> None:
    tp1, tp2 = features(name)
    assert tp2.greedy == tp1.greedy
    for full, sharded in zip(tp1.first_logprobs, tp2.first_logprobs, strict=True):
        assert sharded.top_token_ids == full.top_token_ids
        assert sharded.top_logprobs == pytest.approx(full.top_logprobs, abs=1e-4, rel=0)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
def test_chunked_prefill_beside_decodes_equals_tp1(
    features: Callable[[str], tuple[Features, ...]], name: str
) -> None:
    tp1, tp2 = features(name)
    for run in (tp1, tp2):
        # 120 prompt tokens at most 16 a step: 8 chunks, while the short requests decode.
        assert run.steps_to_long_first_token >= 8
        assert run.decoded_while_long_prefilled >= 8 * len(SHORT_PROMPTS)
    assert tp2.chunked == tp1.chunked
    assert len(tp2.long_prompt_logprobs) == len(LONG_PROMPT) - 1
    assert tp2.long_prompt_logprobs == pytest.approx(tp1.long_prompt_logprobs, abs=1e-4, rel=0)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
def test_structured_outputs_equal_tp1_and_hold(
    features: Callable[[str], tuple[Features, ...]], name: str
) -> None:
    tp1, tp2 = features(name)
    assert tp2.structured == tp1.structured
    texts = [bytes(ids).decode() for ids, _ in tp2.structured]
    assert [finish for _, finish in tp2.structured] == ["stop"] * 3, texts
    as_json, phone, choice = texts
    jsonschema.validate(json.loads(as_json), SHORT)
    assert re.fullmatch(PHONE, phone), phone
    assert choice in CHOICES
