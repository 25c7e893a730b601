"""bf16 checkpoints of the dense families (Llama, Qwen3, Phi-3, Gemma 2 and 3): saved by
transformers in bf16, loaded and run by us in bf16 on CPU, greedy tokens equal to
transformers' own bf16 model.

The reference is transformers in bf16 (as in test_moe_model's bf16 test), not the fp32
model: bf16 rounding moves logits by ~1% of their scale, enough to flip a near tie between
the top two tokens, and then the two runs continue from different tokens. Each case's prompt
is one whose every greedy step has a clear winner (`MIN_MARGIN`, checked on transformers'
logits so a new transformers that makes a case fragile says so), and its tokens must not be
one token repeated, so that a missing piece (a skipped q/k norm, unscaled LongRoPE, a
dropped bias) changes them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from gpu_worker.loader import load_model
from shared.model_source import resolve_model
from tests.helpers.tiny_models import Family, PagedRunner, save_tiny_model
from tests.unit.test_gemma_model import CONFIGS as GEMMA
from tests.unit.test_llama_model import LLAMA3_ROPE, _prompt
from tests.unit.test_phi3_model import LONG, SHORT
from tests.unit.test_qwen3_model import _hf_greedy

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 8
# The smallest gap between transformers' best and second-best bf16 logit at any greedy
# step, as a share of the logits' scale. Runs differing only in bf16 rounding were seen to
# pick different tokens at margins up to 0.011; ties (0.0) are common, bf16 logits being
# coarse. The cases' prompts were picked, among seeds 0-7 and lengths 13 and 21, for a
# margin above this and at least five distinct tokens.
MIN_MARGIN = 0.02

# (id, family, tied, extra config, prompt seed, prompt length)
CASES: list[tuple[str, Family, bool, dict[str, Any], int, int]] = [
    (
        "llama3-rope-bias",
        "llama",
        False,
        {"rope_scaling": LLAMA3_ROPE, "attention_bias": True},
        3,
        13,
    ),
    ("qwen3-head-dim", "qwen3", False, {"head_dim": 32}, 1, 21),
    # LongRoPE with its original context the model's whole one: both systems take the
    # short factors at every length (transformers by sequence length, we by context).
    (
        "phi3-longrope-partial",
        "phi3",
        False,
        {
            "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 256,
            "rope_scaling": {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG},
        },
        3,
        21,
    ),
    # Gemma's features as its parity tests set them, untied (tied tiny Gemmas echo the
    # input token); Gemma 2's final cap at its real 30 (a cap of 5 makes bf16 logits tie).
    (
        "gemma2-softcap-window",
        "gemma2",
        False,
        {**GEMMA["gemma2"], "final_logit_softcapping": 30.0},
        7,
        21,
    ),
    ("gemma3-qk-norm-local-rope", "gemma3", False, GEMMA["gemma3"], 3, 13),
]


@torch.no_grad()
def _margins(hf: transformers.PreTrainedModel, tokens: list[int]) -> list[float]:
    """Top-1 minus top-2 logit over the logits' scale, at each of the last NEW_TOKENS
    positions of prompt + greedy tokens (the positions that chose a greedy token)."""
    logits = hf(torch.tensor([tokens])).logits[0, -NEW_TOKENS - 1 : -1].float()
    top = logits.topk(2, dim=-1).values
    return ((top[:, 0] - top[:, 1]) / logits.abs().max()).tolist()


@pytest.mark.parametrize(
    ("family", "tied", "extra", "seed", "length"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_bf16_checkpoint_gives_transformers_bf16_tokens(
    tmp_path: Path, family: Family, tied: bool, extra: dict[str, Any], seed: int, length: int
) -> None:
    _, hf = save_tiny_model(
        tmp_path, family, tie_word_embeddings=tied, dtype=torch.bfloat16, **extra
    )
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    model, config = load_model(resolve_model(str(tmp_path)), torch.device("cpu"), torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}

    prompt = _prompt(seed, length, config.vocab_size)
    expected = _hf_greedy(hf, prompt, NEW_TOKENS)
    assert len(set(expected)) >= 5, f"degenerate reference {expected}"
    assert min(_margins(hf, prompt + expected)) > MIN_MARGIN, "a near tie: pick another prompt"
    assert PagedRunner(model, config, seed=3).greedy(0, prompt, NEW_TOKENS) == expected
