"""Sliding-window attention end to end: a tiny Mistral whose window (8) is shorter than its
prompts, and a tiny Qwen2 with global and sliding layers, against transformers on both
attention backends (Triton interpreted on CPU), through chunked prefill, mixed batches,
prefix-cache hits and the engine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import transformers

from gpu_worker.attention.backend import get_attention_backend
from gpu_worker.loader import config_from_hf, load_model
from gpu_worker.models.config import ModelConfig
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.ops.layer_ops import TritonLayerOps
from shared.model_source import resolve_model
from tests.helpers.tiny_models import PagedRunner, _SeqState, save_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 8


@dataclasses.dataclass
class Pair:
    path: Path
    ours: LlamaForCausalLM
    config: ModelConfig
    hf: transformers.PreTrainedModel


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    out_dir = tmp_path_factory.mktemp("mistral-window")
    _, hf = save_tiny_model(out_dir, "mistral", sliding_window=WINDOW, tokenizer="words")
    ours, config = load_model(resolve_model(str(out_dir)), torch.device("cpu"))
    assert [config.window_of(i) for i in range(config.num_layers)] == [WINDOW, WINDOW]
    return Pair(out_dir, ours, config, hf)  # type: ignore[arg-type]


def _prompt(seed: int, length: int, vocab: int = 256) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


@torch.no_grad()
def _hf_logits(hf: transformers.PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()


def _hf_greedy(hf: transformers.PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens by full recomputation: transformers' windowed mask, no cache involved."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(_hf_logits(hf, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def test_reference_applies_the_window(mistral: Pair) -> None:
    """transformers' logits change once a prompt outgrows the window (so the tests below
    cannot pass with attention that ignores it), and not before."""
    tokens = _prompt(0, 20)
    windowed = _hf_logits(mistral.hf, tokens)
    mistral.hf.config.sliding_window = None
    try:
        full = _hf_logits(mistral.hf, tokens)
    finally:
        mistral.hf.config.sliding_window = WINDOW
    torch.testing.assert_close(windowed[:WINDOW], full[:WINDOW], atol=1e-5, rtol=0)
    assert (windowed[WINDOW:] - full[WINDOW:]).abs().amax(-1).min() > 1e-3


def test_mixed_batch_first_step_logits(mistral: Pair) -> None:
    prompts = {0: _prompt(1, 20), 1: _prompt(2, 5), 2: _prompt(3, 13)}
    got = PagedRunner(mistral.ours, mistral.config).step(prompts)
    for i, prompt in prompts.items():
        torch.testing.assert_close(got[i], _hf_logits(mistral.hf, prompt), atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers(mistral: Pair) -> None:
    runner = PagedRunner(mistral.ours, mistral.config, seed=5)
    for seq_id, length in enumerate((11, 19, 26)):
        prompt = _prompt(10 + seq_id, length)
        assert runner.greedy(seq_id, prompt, 6) == _hf_greedy(mistral.hf, prompt, 6)


def test_chunked_prefill_and_decode_in_mixed_batches(mistral: Pair) -> None:
    """Chunks shorter and longer than the window, next to each other's decodes."""
    seq0, seq1 = _prompt(4, 30), _prompt(5, 24)
    runner = PagedRunner(mistral.ours, mistral.config, seed=3)
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    schedule = [{0: seq0[:5]}, {0: seq0[5:17], 1: seq1[:3]}, {1: seq1[3:20], 0: seq0[17:18]}]
    schedule += [{0: [seq0[18 + j]], 1: [seq1[20 + j]]} for j in range(4)]
    schedule += [{0: seq0[22:30]}]
    for batch in schedule:
        for seq_id, logits in runner.step(batch).items():
            got[seq_id].append(logits)
    for seq_id, tokens in ((0, seq0), (1, seq1)):
        expected = _hf_logits(mistral.hf, tokens)
        torch.testing.assert_close(torch.cat(got[seq_id]), expected, atol=1e-4, rtol=0)


def test_prefix_cache_hit_reads_shared_blocks(mistral: Pair) -> None:
    """A second sequence starts on the first one's full blocks (as a prefix-cache hit does):
    its suffix attends to the window over the shared blocks."""
    shared, suffix = _prompt(20, 12), _prompt(21, 7)
    runner = PagedRunner(mistral.ours, mistral.config, seed=7)
    runner.step({0: shared + _prompt(22, 3)})
    hit = 12 // runner.block_size
    runner.seqs[1] = _SeqState(list(runner.seqs[0].block_table[:hit]), 12)
    got = runner.step({1: suffix})[1]
    expected = _hf_logits(mistral.hf, shared + suffix)[12:]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_triton_backend_matches_transformers(mistral: Pair) -> None:
    """Triton attention and layer ops (interpreted on CPU): a mixed batch with a chunk over
    a cached prefix, then decodes."""
    ours, config = load_model(
        resolve_model(str(mistral.path)),
        torch.device("cpu"),
        attn_backend=get_attention_backend("triton"),
        layer_ops=TritonLayerOps(),
    )
    seq0, seq1 = _prompt(30, 14), _prompt(31, 11)
    runner = PagedRunner(ours, config)
    steps = [{0: seq0[:10], 1: seq1}, {0: seq0[10:]}]
    got = [runner.step(batch) for batch in steps]
    nxt = {0: int(got[1][0][-1].argmax()), 1: int(got[0][1][-1].argmax())}
    last = runner.step({i: [t] for i, t in nxt.items()})
    for i, logits in ((0, [got[0][0], got[1][0], last[0]]), (1, [got[0][1], last[1]])):
        expected = _hf_logits(mistral.hf, [*(seq0 if i == 0 else seq1), nxt[i]])
        torch.testing.assert_close(torch.cat(logits), expected, atol=1e-4, rtol=0)


def test_engine_serves_past_the_window_with_prefix_caching(mistral: Pair) -> None:
    """max_model_len is the model's context, not the window; a repeated prompt hits the
    prefix cache and still decodes transformers' greedy tokens."""
    from gpu_worker import Engine
    from shared.sampling import SamplingParams

    engine = Engine(model=str(mistral.path), device="cpu", kv_cache_memory_gb=0.01)
    assert engine.max_model_len == mistral.config.max_position_embeddings
    prompt = _prompt(40, 37)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    expected = _hf_greedy(mistral.hf, prompt, 5)
    first = engine.generate([prompt], params)[0]
    second = engine.generate([prompt], params)[0]
    assert second.num_cached_tokens > WINDOW
    assert first.token_ids == second.token_ids == expected


def test_qwen2_slides_layers_from_max_window_layers(tmp_path: Path) -> None:
    """Qwen2 with use_sliding_window: layer 0 is global, layer 1 slides (transformers'
    max_window_layers), in one step of the torch backend."""
    _, hf = save_tiny_model(
        tmp_path,
        "qwen2",
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
    )
    ours, config = load_model(resolve_model(str(tmp_path)), torch.device("cpu"))
    assert config.layer_windows == (None, 6)
    prompts = {0: _prompt(50, 17), 1: _prompt(51, 9)}
    got = PagedRunner(ours, config).step(prompts)
    for i, prompt in prompts.items():
        torch.testing.assert_close(got[i], _hf_logits(hf, prompt), atol=1e-4, rtol=0)


def test_qwen_layer_windows_from_config() -> None:
    base = dict(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=3,
        num_attention_heads=2,
        sliding_window=16,
    )
    assert config_from_hf({**base, "use_sliding_window": False}).layer_windows is None
    config = config_from_hf({**base, "use_sliding_window": True, "max_window_layers": 1})
    assert config.layer_windows == (None, 16, 16)
    assert [config.window_of(i) for i in range(3)] == [None, 16, 16]
    mistral = config_from_hf({**base, "architectures": ["MistralForCausalLM"]})
    assert mistral.layer_windows is None
    assert mistral.window_of(2) == 16
