"""The loader: SmolLM2's GGUF against transformers loading the same file, and config parsing."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from gpu_worker.loader import config_from_hf, gguf_to_hf_name, load_model, unpermute_qk
from gpu_worker.models import LlamaForCausalLM
from gpu_worker.models.config import ModelConfig, RopeScaling
from shared.model_source import ModelSource, resolve_model
from tests.helpers.tiny_models import PagedRunner, save_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

# Token ids from SmolLM2's tokenizer; the text is beside each.
PROMPTS: list[list[int]] = [
    # "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
    # "The quick brown fox jumps over the lazy dog. The quick brown"
    [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 378, 2365, 6354],
    # "def fibonacci(n):\n    "
    [1604, 3987, 46477, 24, 94, 727, 2367],
]


@pytest.fixture(scope="module")
def smollm2() -> ModelSource:
    return resolve_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def ours(smollm2: ModelSource) -> tuple[LlamaForCausalLM, ModelConfig, float]:
    start = time.perf_counter()
    model, config = load_model(smollm2, torch.device("cpu"))
    return model, config, time.perf_counter() - start  # type: ignore[return-value]


@pytest.fixture(scope="module")
def hf(hf_reference_model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    return hf_reference_model  # the session's one read of the GGUF into transformers


@pytest.mark.slow  # SmolLM2 in our loader and in transformers
def test_smollm2_config(ours: tuple[LlamaForCausalLM, ModelConfig, float]) -> None:
    _, config, load_s = ours
    assert config.architecture == "llama"
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings
    assert config.rope_theta == 100000.0
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    # A bound for a loaded 2-core box, far above an idle load: it catches a loader that
    # became slow by an order of magnitude, not jitter.
    assert load_s < 20


@pytest.mark.slow  # SmolLM2 in our loader and in transformers
@pytest.mark.parametrize("prompt", PROMPTS)
def test_smollm2_logits_match_transformers(
    ours: tuple[LlamaForCausalLM, ModelConfig, float],
    hf: transformers.PreTrainedModel,
    prompt: list[int],
) -> None:
    model, config, _ = ours
    got = PagedRunner(model, config, num_blocks=16, block_size=16).step({0: prompt})[0]
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()
    assert (got - expected).abs().max().item() < 1e-3


@pytest.mark.slow  # SmolLM2 in our loader and in transformers
@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_smollm2_greedy_tokens_match_transformers(
    ours: tuple[LlamaForCausalLM, ModelConfig, float],
    hf: transformers.PreTrainedModel,
    prompt: list[int],
) -> None:
    model, config, _ = ours
    # Block size 4: the decodes cross several block boundaries.
    got = PagedRunner(model, config, num_blocks=16, block_size=4).greedy(0, prompt, 16)
    # transformers recomputing the whole sequence each step: `generate` would stop at (or,
    # with min_new_tokens, forbid) EOS, while our engine decides stopping elsewhere.
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(16):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    expected = tokens[len(prompt) :]
    assert got == expected


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`, verbatim in effect."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.mark.parametrize(("n_head", "head_dim", "cols"), [(9, 64, 5), (3, 64, 1), (4, 8, 3)])
def test_unpermute_inverts_llama_cpp_permute(n_head: int, head_dim: int, cols: int) -> None:
    w = np.random.default_rng(0).standard_normal((n_head * head_dim, cols)).astype(np.float32)
    assert np.array_equal(unpermute_qk(_llama_cpp_permute(w, n_head), n_head), w)
    # 1-D (a q/k bias) goes through the same row permutation.
    b = w[:, 0].copy()
    assert np.array_equal(unpermute_qk(_llama_cpp_permute(b, n_head), n_head), b)


def test_gguf_names() -> None:
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    assert gguf_to_hf_name("blk.0.ffn_norm.weight") == (
        "model.layers.0.post_attention_layernorm.weight"
    )
    assert gguf_to_hf_name("rope_freqs.weight") is None


def test_config_from_transformers4_rope_scaling() -> None:
    config = config_from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 128256,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "max_position_embeddings": 131072,
            "tie_word_embeddings": True,
            "eos_token_id": [128001, 128008, 128009],
        }
    )
    assert config.head_dim == 64
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert not config.attention_bias


def test_unsupported_architecture_and_missing_tensor(tmp_path: Path) -> None:
    out_dir, _ = save_tiny_model(tmp_path, "llama", tie_word_embeddings=False)
    config_path = out_dir / "config.json"
    raw = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**raw, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_model(resolve_model(str(out_dir)), torch.device("cpu"))
    # An untied config over a checkpoint without lm_head must fail loudly, not run garbage.
    tied_dir, _ = save_tiny_model(tmp_path / "tied", "llama", tie_word_embeddings=True)
    raw = json.loads((tied_dir / "config.json").read_text())
    (tied_dir / "config.json").write_text(json.dumps({**raw, "tie_word_embeddings": False}))
    with pytest.raises(ValueError, match="lm_head"):
        load_model(resolve_model(str(tied_dir)), torch.device("cpu"))
