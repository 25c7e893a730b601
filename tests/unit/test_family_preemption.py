"""Every model family through the engine under preemption: a KV cache far too small for the
batch makes the scheduler evict and recompute sequences, and each one's greedy tokens are
still transformers'. The families' own features are on (sliding windows shorter than the
prompts, soft-caps, LongRoPE, experts), with the configurations their parity tests use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from gpu_worker import Engine
from gpu_worker.loader import load_config
from gpu_worker.runner.kv_caches import kv_cache_bytes_per_block
from shared.model_source import resolve_model
from shared.sampling import SamplingParams
from tests.helpers.preemption import count_preemptions
from tests.helpers.tiny_models import Family, save_tiny_model
from tests.unit.test_gemma_model import CONFIGS as GEMMA
from tests.unit.test_llama_model import _prompt
from tests.unit.test_moe_model import QWEN3_MOE
from tests.unit.test_phi3_model import phi3_overrides
from tests.unit.test_qwen3_model import QWEN3

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK_SIZE = 4
NUM_BLOCKS = 12
"""Six sequences of 18-24 tokens need about 36 blocks of 4 at once: most wait or are
evicted."""
NEW_TOKENS = 6

FAMILIES: dict[str, tuple[Family, dict[str, Any]]] = {
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "qwen3": ("qwen3", QWEN3),
    "phi3-longrope": ("phi3", phi3_overrides()),
    "mixtral": ("mixtral", {}),
    "qwen3-moe": ("qwen3_moe", {**QWEN3_MOE, "norm_topk_prob": True}),
    "gemma2": ("gemma2", GEMMA["gemma2"]),
    "gemma3": ("gemma3", GEMMA["gemma3"]),
}


def _hf_greedy(hf: transformers.PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens by full recomputation: transformers' own masks, no cache involved."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_preempted_sequences_keep_transformers_tokens(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    family, extra = FAMILIES[name]
    _, hf = save_tiny_model(tmp_path, family, tokenizer="words", **extra)
    config = load_config(resolve_model(str(tmp_path)))
    per_block = kv_cache_bytes_per_block(
        config.num_layers, BLOCK_SIZE, config.num_kv_heads, config.head_dim, torch.float32
    )
    preemptions = count_preemptions(monkeypatch)
    engine = Engine(
        model=str(tmp_path),
        device="cpu",
        block_size=BLOCK_SIZE,
        kv_cache_memory_gb=NUM_BLOCKS * per_block / (1 << 30),
        enable_prefix_caching=False,
    )
    assert engine.kv.num_blocks == NUM_BLOCKS
    vocab = config.vocab_size
    prompts = [_prompt(70 + i, 18 + i, vocab) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    assert preemptions, "the cache was large enough: nothing was preempted"
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.token_ids == _hf_greedy(hf, prompt, NEW_TOKENS)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
