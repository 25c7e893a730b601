"""The chat workload of the engine benchmarks: made-up questions rendered by the model's chat
template into prompts of 100-150 tokens, and the number of new tokens each one asks for."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from render_server.templating.chat_template import ChatRenderer

TOPICS = [
    "astronomy", "baking bread", "bicycle repair", "chess openings", "coastal birds",
    "container shipping", "desert plants", "early printing", "glass blowing", "honey bees",
    "jazz harmony", "lighthouses", "medieval castles", "mountain weather", "origami",
    "pottery glazes", "railway signals", "river deltas", "sailing knots", "tea ceremonies",
]  # fmt: skip
WORDS = [
    "why", "how", "when", "where", "which", "would", "could", "should", "explain",
    "describe", "compare", "list", "the", "a", "an", "of", "to", "in", "on", "for", "with",
    "about", "between", "during", "after", "before", "under", "over", "small", "large",
    "old", "new", "history", "method", "tools", "process", "reason", "example",
    "difference", "effect", "cause", "season", "material", "color", "shape", "speed",
    "weight", "price", "market", "village", "city", "island", "winter", "summer",
    "morning", "night", "careful", "simple", "quick", "slow", "early", "late", "common",
    "rare", "local", "famous", "modern", "ancient", "practical", "steps", "rules",
    "mistakes", "habits", "questions", "answers", "details", "sources", "ideas",
    "problems", "results",
]  # fmt: skip


@dataclass
class Workload:
    """The prompts and the number of new tokens each one asks for."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lens)

    def head(self, n: int | None) -> Workload:
        if n is None:
            return self
        return Workload(self.prompts[:n], self.output_lens[:n])

    def describe(self) -> str:
        """Its prompt and output lengths, as the benchmarks print them."""
        lens = [len(p) for p in self.prompts]
        return (
            f"{len(self.prompts)} prompts of {min(lens)}-{max(lens)} tokens, outputs "
            f"{min(self.output_lens)}-{max(self.output_lens)} ({self.useful_tokens} tokens)"
        )


def build_workload(
    renderer: ChatRenderer, num_prompts: int, max_output: int, seed: int
) -> Workload:
    """Chat prompts of 100-150 tokens from made-up questions, and uniform output lengths."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    while len(prompts) < num_prompts:
        topic = rng.choice(TOPICS)
        target = rng.randint(100, 150)
        words: list[str] = []
        while True:
            words.append(rng.choice(WORDS))
            messages = [
                {"role": "system", "content": f"You are a patient expert on {topic}."},
                {"role": "user", "content": f"A question on {topic}: {' '.join(words)}?"},
            ]
            ids = renderer.render(messages, add_generation_prompt=True).token_ids
            if len(ids) >= target:
                break
        if len(ids) <= 150:  # the last word may overshoot; draw again then
            prompts.append(ids)
    min_output = min(16, max_output)
    return Workload(prompts, [rng.randint(min_output, max_output) for _ in prompts])
