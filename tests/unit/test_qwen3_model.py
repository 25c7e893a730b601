"""Our Qwen3 (dense) against transformers on tiny random checkpoints (CPU, fp32).

The parity tests are test_llama_model's, run here over a Qwen3 `pair`; the rest covers what
those do not: greedy tokens, prefix-cache hits, the Triton backend and a GGUF file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from gpu_worker.attention.backend import get_attention_backend
from gpu_worker.loader import config_from_hf, load_model
from gpu_worker.models import MODEL_REGISTRY, Qwen3ForCausalLM
from gpu_worker.ops.layer_ops import TritonLayerOps
from shared.model_source import resolve_model
from tests.helpers.gguf_files import add_f32_tensors, gguf_file
from tests.helpers.tiny_models import (
    Family,
    PagedRunner,
    _SeqState,
    save_tiny_model,
    save_tiny_tokenizer,
)
from tests.unit.test_llama_model import (
    Pair,
    _hf_logits,
    _prompt,
    test_chunked_prefill_and_decode_in_mixed_batches,
    test_prefill_logits_match_transformers,
)

pytestmark = pytest.mark.usefixtures("one_thread")

__all__ = [
    "test_chunked_prefill_and_decode_in_mixed_batches",
    "test_prefill_logits_match_transformers",
]

# head_dim 32 != hidden 64 / heads 4: q_size (128) differs from hidden_size.
QWEN3: dict[str, Any] = {"head_dim": 32}


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    tied: bool = request.param
    out_dir = tmp_path_factory.mktemp(f"qwen3-{'tied' if tied else 'untied'}")
    _, hf = save_tiny_model(out_dir, "qwen3", tie_word_embeddings=tied, **QWEN3)
    ours, config = load_model(resolve_model(str(out_dir)), torch.device("cpu"))
    assert isinstance(ours, Qwen3ForCausalLM)
    assert config.tie_word_embeddings is tied
    assert (config.head_dim, config.attention_bias, config.sliding_window) == (32, False, None)
    return Pair(ours, config, hf)


@torch.no_grad()
def _hf_greedy(hf: transformers.PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    generate: Any = hf.generate
    out = generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return list(out[0, len(prompt) :].tolist())


def test_greedy_tokens_match_transformers(pair: Pair) -> None:
    runner = PagedRunner(pair.ours, pair.config, seed=5)
    for seq_id, length in enumerate((3, 17, 33)):
        prompt = _prompt(10 + seq_id, length, pair.config.vocab_size)
        assert runner.greedy(seq_id, prompt, 8) == _hf_greedy(pair.hf, prompt, 8)


def test_prefix_cache_hit_reads_shared_blocks(pair: Pair) -> None:
    """A second sequence starts on the first one's full blocks (as a prefix-cache hit does)
    and computes only its own suffix; its logits are transformers' over the whole prompt."""
    vocab = pair.config.vocab_size
    shared, suffix = _prompt(20, 12, vocab), _prompt(21, 7, vocab)
    runner = PagedRunner(pair.ours, pair.config, seed=7)
    runner.step({0: shared + _prompt(22, 3, vocab)})
    hit = 12 // runner.block_size
    runner.seqs[1] = _SeqState(list(runner.seqs[0].block_table[:hit]), 12)
    got = runner.step({1: suffix})[1]
    expected = _hf_logits(pair.hf, shared + suffix)[12:]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_engine_prefix_cache_hit_gives_transformers_tokens(pair: Pair, tmp_path: Path) -> None:
    """Through the engine: the second prompt's first 32 tokens hit the first one's cached
    blocks, and both greedy continuations are transformers'."""
    from gpu_worker import Engine
    from shared.sampling import SamplingParams

    pair.hf.save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path, pair.config.vocab_size)
    engine = Engine(model=str(tmp_path), device="cpu", max_model_len=96, kv_cache_memory_gb=0.01)
    vocab = pair.config.vocab_size
    shared = _prompt(50, 32, vocab)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for prompt in (shared + _prompt(51, 5, vocab), shared + _prompt(52, 9, vocab)):
        (done,) = engine.generate([prompt], params)
        assert done.token_ids == _hf_greedy(pair.hf, prompt, 5)
    assert done.num_cached_tokens == 32


def check_triton_backend(
    tmp_path: Path, family: Family, lengths: tuple[int, int], **overrides: Any
) -> None:
    """Triton attention and layer ops (interpreted on CPU) on a tiny `family` model: one
    mixed-length batch of prompts of `lengths`, then a decode step, against transformers."""
    _, hf = save_tiny_model(tmp_path, family, tie_word_embeddings=False, seed=1, **overrides)
    ours, config = load_model(
        resolve_model(str(tmp_path)),
        torch.device("cpu"),
        attn_backend=get_attention_backend("triton"),
        layer_ops=TritonLayerOps(),
    )
    prompts = {i: _prompt(30 + i, n, config.vocab_size) for i, n in enumerate(lengths)}
    runner = PagedRunner(ours, config)
    first = runner.step(prompts)
    nxt = {i: [int(first[i][-1].argmax())] for i in prompts}
    second = runner.step(nxt)
    for i, prompt in prompts.items():
        expected = _hf_logits(hf, prompt + nxt[i])
        got = torch.cat((first[i], second[i]))
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_triton_backend_matches_transformers(tmp_path: Path) -> None:
    check_triton_backend(tmp_path, "qwen3", (9, 3), **QWEN3)


def _write_gguf(hf: transformers.PreTrainedModel, path: Path) -> None:
    """What llama.cpp's converter writes for Qwen3, in F32: no q/k row permutation (that
    is its llama arch only), q/k norms as `blk.N.attn_{q,k}_norm`."""
    cfg = hf.config
    with gguf_file(cfg, path, "qwen3") as writer:
        add_f32_tensors(writer, hf, "qwen3")


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gguf_file_matches_transformers(tmp_path: Path, tied: bool) -> None:
    hf = save_tiny_model(tmp_path / "hf", "qwen3", tie_word_embeddings=tied, seed=2, **QWEN3)[1]
    path = tmp_path / "tiny-qwen3.gguf"
    _write_gguf(hf, path)
    ours, config = load_model(resolve_model(str(path)), torch.device("cpu"))
    assert isinstance(ours, Qwen3ForCausalLM)
    assert (config.architecture, config.head_dim, config.tie_word_embeddings) == ("qwen3", 32, tied)
    tokens = _prompt(40, 21, config.vocab_size)
    got = PagedRunner(ours, config).step({0: tokens})[0]
    torch.testing.assert_close(got, _hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_registry_and_config() -> None:
    assert MODEL_REGISTRY["Qwen3ForCausalLM"] is MODEL_REGISTRY["qwen3"] is Qwen3ForCausalLM
    base = {
        "vocab_size": 8,
        "hidden_size": 64,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "head_dim": 32,
        "sliding_window": 4096,
        "use_sliding_window": False,
    }
    config = config_from_hf({"model_type": "qwen3", **base})
    assert (config.architecture, config.head_dim, config.sliding_window) == (
        "Qwen3ForCausalLM",
        32,
        None,
    )
