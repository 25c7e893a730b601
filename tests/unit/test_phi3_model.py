"""Our Phi-3 against transformers on tiny random checkpoints (CPU, fp32).

The tiny model has every Phi-3/4 trait at once: fused `qkv_proj` / `gate_up_proj`,
partial rotary (half of head_dim 16 rotates) and LongRoPE with an original context of 16
in a 256-position model. Such a model takes the long factors (`rope_inv_freq`'s rule), which
is what transformers uses for any sequence longer than 16: the parity tests run there, on
prompts of 17+ tokens. A copy capped at the original context takes the short factors, which
transformers uses for sequences of up to 16 tokens: `test_short_regime_...` runs there.

The generic parity tests are test_llama_model's (and test_qwen3_model's prefix-cache ones),
run here over a Phi-3 `pair`."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from gpu_worker.loader import config_from_hf, load_model
from gpu_worker.models import MODEL_REGISTRY, Phi3ForCausalLM
from gpu_worker.models.llama import rope_inv_freq
from shared.model_source import resolve_model
from tests.helpers.gguf_files import add_f32_tensors, gguf_file
from tests.helpers.tiny_models import PagedRunner, save_tiny_model
from tests.unit.test_llama_model import (
    Pair,
    _hf_logits,
    _prompt,
    test_chunked_prefill_and_decode_in_mixed_batches,
    test_prefill_logits_match_transformers,
)
from tests.unit.test_qwen3_model import (
    _hf_greedy,
    check_triton_backend,
    test_engine_prefix_cache_hit_gives_transformers_tokens,
    test_prefix_cache_hit_reads_shared_blocks,
)

pytestmark = pytest.mark.usefixtures("one_thread")

__all__ = [
    "test_chunked_prefill_and_decode_in_mixed_batches",
    "test_engine_prefix_cache_hit_gives_transformers_tokens",
    "test_prefill_logits_match_transformers",
    "test_prefix_cache_hit_reads_shared_blocks",
]

ORIGINAL = 16
SHORT = [1.0, 1.25, 1.5, 2.0]  # rotary_dim 8 / 2 pairs
LONG = [2.0, 3.5, 6.0, 12.0]


def phi3_overrides() -> dict[str, Any]:
    """A fresh dict each time: transformers writes into the rope dict it is given."""
    return {
        "partial_rotary_factor": 0.5,
        "original_max_position_embeddings": ORIGINAL,
        "rope_scaling": {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG},
    }


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> PhiPair:
    tied: bool = request.param
    out_dir = tmp_path_factory.mktemp(f"phi3-{'tied' if tied else 'untied'}")
    _, hf = save_tiny_model(out_dir, "phi3", tie_word_embeddings=tied, **phi3_overrides())
    # The reference must take the long factors past the original context, and scale cos/sin.
    assert hf.model.rotary_emb.rope_type == "longrope"
    assert hf.model.rotary_emb.attention_scaling == pytest.approx(math.sqrt(2))
    ours, config = load_model(resolve_model(str(out_dir)), torch.device("cpu"))
    assert isinstance(ours, Phi3ForCausalLM)
    assert config.tie_word_embeddings is tied
    assert (config.head_dim, config.rotary_dim, config.num_kv_heads) == (16, 8, 2)
    return PhiPair(ours, config, hf, out_dir)


@dataclasses.dataclass
class PhiPair(Pair):
    directory: Path


def test_greedy_tokens_match_transformers(pair: Pair) -> None:
    runner = PagedRunner(pair.ours, pair.config, seed=5)
    for seq_id, length in enumerate((17, 33)):
        prompt = _prompt(10 + seq_id, length, pair.config.vocab_size)
        assert runner.greedy(seq_id, prompt, 6) == _hf_greedy(pair.hf, prompt, 6)


def _capped(pair: PhiPair) -> Phi3ForCausalLM:
    """The pair's model served up to the original context (--max-model-len): the short
    factors."""
    source = resolve_model(str(pair.directory))
    model, config = load_model(source, torch.device("cpu"), max_model_len=ORIGINAL)
    assert isinstance(model, Phi3ForCausalLM)
    assert config.max_position_embeddings == ORIGINAL
    return model


def test_short_regime_matches_transformers_up_to_the_original_context(pair: PhiPair) -> None:
    """Sequences of at most 16 tokens, where transformers takes the short factors: a mixed
    batch's logits, then greedy tokens up to the 16th position."""
    model = _capped(pair)
    config = model.config
    vocab = config.vocab_size
    prompts = {0: _prompt(60, 16, vocab), 1: _prompt(61, 7, vocab)}
    got = PagedRunner(model, config).step(prompts)
    for i, prompt in prompts.items():
        torch.testing.assert_close(got[i], _hf_logits(pair.hf, prompt), atol=1e-4, rtol=0)
    prompt = _prompt(62, 10, vocab)
    assert PagedRunner(model, config).greedy(0, prompt, 6) == _hf_greedy(pair.hf, prompt, 6)


def test_regimes_differ(pair: PhiPair) -> None:
    """Guard against the regime tests passing vacuously: the two factor sets give other
    frequencies, and the long model's logits on a short prompt are not transformers'."""
    capped = _capped(pair)
    assert not torch.equal(rope_inv_freq(pair.config), rope_inv_freq(capped.config))
    prompt = _prompt(63, 12, pair.config.vocab_size)
    long_logits = PagedRunner(pair.ours, pair.config).step({0: prompt})[0]
    assert (long_logits - _hf_logits(pair.hf, prompt)).abs().max() > 1e-2


def test_triton_backend_matches_transformers(tmp_path: Path) -> None:
    """One mixed-length batch past the original context, then a decode step."""
    check_triton_backend(tmp_path, "phi3", (21, 17), **phi3_overrides())


def _write_gguf(hf: transformers.PreTrainedModel, path: Path) -> None:
    """What llama.cpp's converter writes for Phi-3, in F32: fused `attn_qkv` and `ffn_up`
    (gate then up) as in the HF checkpoint, no q/k row permutation, the rotary dims, and
    LongRoPE as two factor tensors, the original context and the attention factor."""
    cfg = hf.config
    with gguf_file(cfg, path, "phi3", head_dims=False) as writer:
        writer.add_rope_dimension_count(8)
        writer.add_sliding_window(0)  # the converter's "no window" (Phi-4)
        writer.add_rope_scaling_orig_ctx_len(ORIGINAL)
        writer.add_rope_scaling_attn_factors(hf.model.rotary_emb.attention_scaling)
        writer.add_tensor("rope_factors_long.weight", np.array(LONG, dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(SHORT, dtype=np.float32))
        add_f32_tensors(writer, hf, "phi3")


def test_gguf_file_matches_transformers(tmp_path: Path) -> None:
    hf = save_tiny_model(
        tmp_path / "hf", "phi3", tie_word_embeddings=False, seed=2, **phi3_overrides()
    )[1]
    path = tmp_path / "tiny-phi3.gguf"
    _write_gguf(hf, path)
    ours, config = load_model(resolve_model(str(path)), torch.device("cpu"))
    assert isinstance(ours, Phi3ForCausalLM)
    assert (config.architecture, config.rotary_dim, config.sliding_window) == ("phi3", 8, None)
    assert config.longrope is not None
    assert config.longrope.long_factor == tuple(LONG)
    assert config.longrope.original_max_position_embeddings == ORIGINAL
    tokens = _prompt(40, 21, config.vocab_size)
    got = PagedRunner(ours, config).step({0: tokens})[0]
    torch.testing.assert_close(got, _hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_registry_and_config() -> None:
    assert MODEL_REGISTRY["Phi3ForCausalLM"] is MODEL_REGISTRY["phi3"] is Phi3ForCausalLM
    base = {
        "vocab_size": 8,
        "hidden_size": 96,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "sliding_window": 262144,
    }
    # Phi-3-mini-128k as first published: rope type "su", full rotary, no explicit factor.
    factors = [1.0] * 12
    rope = {"type": "su", "short_factor": factors, "long_factor": factors}
    config = config_from_hf({"model_type": "phi3", **base, "rope_scaling": rope})
    assert config.architecture == "Phi3ForCausalLM"
    assert (config.head_dim, config.rotary_dim, config.sliding_window) == (24, None, 262144)
    assert config.longrope is not None
    assert config.longrope.attention_factor == pytest.approx(
        math.sqrt(1 + math.log(32) / math.log(4096))
    )
    # Phi-4-mini style: a partial rotary factor; a plain rope keeps no LongRoPE.
    config = config_from_hf({"model_type": "phi3", **base, "partial_rotary_factor": 0.75})
    assert (config.rotary_dim, config.longrope) == (18, None)
