"""Synthetic request sets for bench/serving/serve.py, built locally from a seed (no downloads).

- `random_requests`: prompts of random token ids of a set length, sent as token ids to
  /v1/completions (as `vllm bench serve --dataset-name random`).
- `chat_requests`: conversations of made-up messages with varied turns and lengths, sent
  to /v1/chat/completions.

Lengths are drawn uniformly from `[n * (1 - range_ratio), n * (1 + range_ratio)]`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Ids below this are special or single-byte tokens in the SmolLM2 / GPT-2 style
# vocabularies; random prompts stay clear of them so they read as ordinary text.
FIRST_ORDINARY_ID = 300

_SUBJECTS = [
    "the old lighthouse", "my neighbour's garden", "a small bakery", "the night train",
    "our football club", "the city library", "a mountain village", "the harbour market",
    "my grandmother's recipe", "the new bicycle lane", "a rainy weekend", "the school choir",
]  # fmt: skip
_VERBS = [
    "needs", "reminds me of", "was built around", "depends on", "changed", "is famous for",
    "competes with", "smells like", "was painted with", "keeps",
]  # fmt: skip
_OBJECTS = [
    "fresh bread every morning", "a long history of storms", "too many tourists in summer",
    "a quiet corner for reading", "twelve kinds of apples", "an unusual clock tower",
    "the sound of the sea", "volunteers on Saturdays", "a recipe nobody wrote down",
    "a map from the last century", "cheap coffee and good music", "a stubborn old cat",
]  # fmt: skip
_ASKS = [
    "Can you explain why?", "What would you suggest?", "Summarize this in a few lines.",
    "Write a short story about it.", "List three questions I should ask.",
    "How would you plan a visit?", "Is that unusual?", "Describe it for a child.",
]  # fmt: skip
_SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a friendly local guide who answers briefly.",
    "You are a careful writer. Keep answers short and concrete.",
]


@dataclass(frozen=True)
class BenchRequest:
    """One request of a dataset: token ids for /v1/completions, or chat messages."""

    output_len: int
    """max_tokens, sent with ignore_eos so the server generates exactly this many."""
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    generate_token_ids: list[int] | None = None
    """The rendered prompt, sent as token ids to /inference/v1/generate (the token path)."""

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def _lengths(rng: random.Random, count: int, mean: int, range_ratio: float) -> list[int]:
    low = max(1, round(mean * (1 - range_ratio)))
    high = max(low, round(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(count)]


def random_requests(
    num_requests: int,
    input_len: int,
    output_len: int,
    *,
    range_ratio: float = 0.0,
    vocab_size: int = 49152,
    seed: int = 0,
) -> list[BenchRequest]:
    """Prompts of random ordinary token ids; every prompt is distinct (no prefix hits)."""
    rng = random.Random(seed)
    inputs = _lengths(rng, num_requests, input_len, range_ratio)
    outputs = _lengths(rng, num_requests, output_len, range_ratio)
    return [
        BenchRequest(
            output_len=out,
            prompt_token_ids=[rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(n)],
        )
        for n, out in zip(inputs, outputs, strict=True)
    ]


def _sentence(rng: random.Random) -> str:
    return f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}."


def _message(rng: random.Random, max_sentences: int) -> str:
    sentences = [_sentence(rng) for _ in range(rng.randint(1, max_sentences))]
    return " ".join(sentences)


def chat_requests(
    num_requests: int,
    output_len: int,
    *,
    range_ratio: float = 0.0,
    max_turns: int = 4,
    max_sentences: int = 8,
    seed: int = 0,
) -> list[BenchRequest]:
    """Conversations of 1..max_turns user turns, each of 1..max_sentences made-up
    sentences (about 10 tokens each), with an optional system prompt."""
    rng = random.Random(seed)
    outputs = _lengths(rng, num_requests, output_len, range_ratio)
    requests = []
    for out in outputs:
        messages: list[dict[str, str]] = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)})
        turns = rng.randint(1, max_turns)
        for turn in range(turns):
            user = f"{_message(rng, max_sentences)} {rng.choice(_ASKS)}"
            messages.append({"role": "user", "content": user})
            if turn < turns - 1:
                messages.append({"role": "assistant", "content": _message(rng, 3)})
        requests.append(BenchRequest(output_len=out, messages=messages))
    return requests
