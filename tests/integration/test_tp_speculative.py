"""Speculative decoding under tensor parallelism: `Engine(tensor_parallel_size=2)` on CPU
with ngram and draft_model drafting gives TP=1's greedy tokens without speculation, and
its verify steps (laid out on rank 0, run by both ranks) accept drafts.

The draft model runs unsharded in rank 0's process beside the target's first shard
(`draft_tensor_parallel_size` 1, as vLLM's default).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpu_worker.engine.engine import Engine
from shared.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Prompts that repeat themselves: the tiny model's greedy output falls into their loops.
PROMPTS = [[1] + [10 + i % 7 for i in range(40)], [3, 4, 5, 6] * 8, [9, 8, 7] * 10 + [1, 2]]


def _greedy(model: Path, **engine_args: object) -> tuple[list[list[int]], int]:
    """The prompts' greedy tokens and the drafts accepted on the way."""
    with Engine(model=str(model), device="cpu", kv_cache_memory_gb=0.01, **engine_args) as engine:
        tokens = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
        return tokens, engine.stats().spec_num_accepted_tokens


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_tp2_speculation_gives_tp1s_plain_greedy_tokens(tiny_llama_dir: Path) -> None:
    plain, _ = _greedy(tiny_llama_dir)
    methods = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2},
        "draft_model": {
            "method": "draft_model",
            "model": str(tiny_llama_dir),
            "num_speculative_tokens": 3,
        },
    }
    for name, config in methods.items():
        speculative = json.dumps({**config, "draft_length": "fixed"})
        tokens, accepted = _greedy(
            tiny_llama_dir,
            tensor_parallel_size=2,
            dist_timeout_s=20.0,
            speculative_config=speculative,
        )
        assert tokens == plain, name
        assert accepted > 0, name
