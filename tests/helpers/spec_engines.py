"""Engines that speculate by each method, on a tiny target (its own draft model), for the
speculative decoding tests; the fixtures `plain` and `spec` (tests/unit/conftest.py) are
built here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpu_worker import Engine

# A fixed draft length: every draft the drafter has, so that which steps draft does not
# depend on how fast this machine runs them (the adaptive controller has its own tests,
# tests/unit/test_spec_draft_length.py).
NGRAM = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
    '"prompt_lookup_max": 4, "draft_length": "fixed"}'
)
SUFFIX = '{"method": "suffix", "num_speculative_tokens": 4, "draft_length": "fixed"}'
# The target drafting for itself: greedy drafts of the target's own, rejected where a
# request's sampling or penalties differ from greedy.
DRAFT_MODEL = (
    '{"method": "draft_model", "model": "TARGET", "num_speculative_tokens": 4, '
    '"draft_length": "fixed"}'
)
METHODS = {"ngram": NGRAM, "suffix": SUFFIX, "draft_model": DRAFT_MODEL}
"""Each method's --speculative-config, its draft model's path spelled TARGET."""


def for_target(speculative: str, tiny_llama_dir: Path) -> str:
    """`speculative` with TARGET (a draft model's path) made the target's own."""
    return speculative.replace('"TARGET"', f'"{tiny_llama_dir}"')


def spec_engine(target_dir: Path, speculative: str | None, **kwargs: Any) -> Engine:
    """A CPU engine on the model in `target_dir` with a small KV cache, speculating by
    `speculative` (a value of METHODS; None: plain decoding)."""
    args: dict[str, Any] = {"kv_cache_memory_gb": 0.01, **kwargs}
    if speculative is not None:
        args["speculative_config"] = for_target(speculative, target_dir)
    return Engine(model=str(target_dir), device="cpu", **args)
