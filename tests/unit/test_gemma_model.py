"""Our Gemma 2 and Gemma 3 (text) against transformers on tiny random checkpoints (CPU, fp32).

Four layers, so local (sliding-window, 8) and global layers both appear: Gemma 2 alternates
them, Gemma 3 here has a period of three (local, local, global, local). Gemma 2's caps are
small enough that tanh bites; Gemma 3 has q/k norms, a local rope base of its own and
linear rope scaling on its global layers. The reference runs transformers' eager attention,
its only one with soft-capping. The parity tests are test_llama_model's, run over these
pairs; `test_each_feature_is_exercised` shows they fail when one feature is turned off."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import gguf
import pytest
import torch
import transformers

from gpu_worker.attention.backend import get_attention_backend
from gpu_worker.loader import config_from_hf, load_model
from gpu_worker.models import Gemma2ForCausalLM, Gemma3ForCausalLM
from gpu_worker.models.gemma import GemmaForCausalLM
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

WINDOW = 8
_COMMON: dict[str, Any] = dict(num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24)
CONFIGS: dict[str, dict[str, Any]] = {
    "gemma2": dict(_COMMON, attn_logit_softcapping=2.0, final_logit_softcapping=5.0),
    "gemma3": dict(
        _COMMON,
        sliding_window_pattern=3,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
        },
    ),
}
LAYER_WINDOWS = {"gemma2": (WINDOW, None, WINDOW, None), "gemma3": (WINDOW, WINDOW, None, WINDOW)}


def _save(out_dir: Path, family: Family, **options: Any) -> transformers.PreTrainedModel:
    """A tiny `family` model of CONFIGS, embeddings tied; `options` go to `save_tiny_model`."""
    return save_tiny_model(
        out_dir, family, tie_word_embeddings=True, **CONFIGS[family], **options
    ).hf


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    family: Family = request.param
    out_dir = tmp_path_factory.mktemp(family)
    hf = _save(out_dir, family, tokenizer="words")
    ours, config = load_model(resolve_model(str(out_dir)), torch.device("cpu"))
    expected_cls = Gemma2ForCausalLM if family == "gemma2" else Gemma3ForCausalLM
    assert type(ours) is expected_cls
    assert config.layer_windows == LAYER_WINDOWS[family]
    assert config.query_pre_attn_scalar == 24.0
    if family == "gemma2":
        assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (2.0, 5.0)
        assert config.rope_local_theta is None
    else:
        assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (None, None)
        assert (config.rope_theta, config.rope_local_theta) == (10000.0, 500.0)
        assert config.rope_linear_factor == 2.0
    return Pair(ours, config, hf)


def _hf_greedy(hf: transformers.PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens by full recomputation: transformers' masks, no cache involved."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(_hf_logits(hf, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def _attentions(model: GemmaForCausalLM) -> list[Any]:
    return [layer.self_attn for layer in model.model.layers]


def _no_softcap(model: GemmaForCausalLM) -> None:
    for attn in _attentions(model):
        attn.softcap = None


def _no_final_softcap(model: GemmaForCausalLM) -> None:
    model.config = dataclasses.replace(model.config, final_logit_softcapping=None)


def _no_window(model: GemmaForCausalLM) -> None:
    for attn in _attentions(model):
        attn.window = None


def _head_dim_scale(model: GemmaForCausalLM) -> None:
    for attn in _attentions(model):
        attn.scale = model.config.head_dim**-0.5


def _no_embed_scale(model: GemmaForCausalLM) -> None:
    model.embed_scale = torch.ones_like(model.embed_scale)


def _global_rope_everywhere(model: GemmaForCausalLM) -> None:
    model.local_rotary = None


def _no_qk_norm(model: GemmaForCausalLM) -> None:
    for attn in _attentions(model):
        attn.q_norm.scale.fill_(1.0)
        attn.k_norm.scale.fill_(1.0)


def _silu_mlp(model: GemmaForCausalLM) -> None:
    mlps: list[Any] = [layer.mlp for layer in model.model.layers]
    for mlp in mlps:
        mlp.forward = lambda x, mlp=mlp: mlp.down_proj(model.ops.silu_and_mul(mlp.gate_up_proj(x)))


ABLATIONS: dict[str, list[Callable[[GemmaForCausalLM], None]]] = {
    "gemma2": [
        _no_softcap,
        _no_final_softcap,
        _no_window,
        _head_dim_scale,
        _no_embed_scale,
        _silu_mlp,
    ],
    "gemma3": [_no_window, _head_dim_scale, _global_rope_everywhere, _no_qk_norm],
}


def test_each_feature_is_exercised(pair: Pair) -> None:
    """Turning any one Gemma feature off moves our logits well past the parity tolerance
    (so the tests here cannot pass without it), and the untouched model stays within it."""
    tokens = _prompt(0, 24, pair.config.vocab_size)
    expected = _hf_logits(pair.hf, tokens)
    got = PagedRunner(pair.ours, pair.config).step({0: tokens})[0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    family = "gemma2" if isinstance(pair.ours, Gemma2ForCausalLM) else "gemma3"
    for ablate in ABLATIONS[family]:
        model = cast(GemmaForCausalLM, copy.deepcopy(pair.ours))
        ablate(model)
        wrong = PagedRunner(model, model.config).step({0: tokens})[0]
        assert (wrong - expected).abs().max() > 1e-2, ablate.__name__


def test_mixed_batch_first_step_logits(pair: Pair) -> None:
    vocab = pair.config.vocab_size
    prompts = {0: _prompt(1, 20, vocab), 1: _prompt(2, 5, vocab), 2: _prompt(3, 13, vocab)}
    got = PagedRunner(pair.ours, pair.config).step(prompts)
    for i, prompt in prompts.items():
        torch.testing.assert_close(got[i], _hf_logits(pair.hf, prompt), atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers(pair: Pair) -> None:
    runner = PagedRunner(pair.ours, pair.config, seed=5)
    for seq_id, length in enumerate((5, 19)):
        prompt = _prompt(10 + seq_id, length, pair.config.vocab_size)
        assert runner.greedy(seq_id, prompt, 6) == _hf_greedy(pair.hf, prompt, 6)


def test_prefix_cache_hit_reads_shared_blocks(pair: Pair) -> None:
    """A second sequence starts on the first one's full blocks (as a prefix-cache hit does)
    and computes only its own suffix, past the window."""
    vocab = pair.config.vocab_size
    shared, suffix = _prompt(20, 12, vocab), _prompt(21, 7, vocab)
    runner = PagedRunner(pair.ours, pair.config, seed=7)
    runner.step({0: shared + _prompt(22, 3, vocab)})
    hit = 12 // runner.block_size
    runner.seqs[1] = _SeqState(list(runner.seqs[0].block_table[:hit]), 12)
    got = runner.step({1: suffix})[1]
    expected = _hf_logits(pair.hf, shared + suffix)[12:]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_triton_backend_matches_transformers(family: Family, tmp_path: Path) -> None:
    """Triton attention and layer ops (interpreted on CPU): a mixed batch with a chunk over
    a cached prefix, then decodes."""
    hf = _save(tmp_path, family, seed=1)
    ours, config = load_model(
        resolve_model(str(tmp_path)),
        torch.device("cpu"),
        attn_backend=get_attention_backend("triton"),
        layer_ops=TritonLayerOps(),
    )
    seq0, seq1 = _prompt(30, 14, config.vocab_size), _prompt(31, 11, config.vocab_size)
    runner = PagedRunner(ours, config)
    steps = [{0: seq0[:10], 1: seq1}, {0: seq0[10:]}]
    got = [runner.step(batch) for batch in steps]
    nxt = {0: int(got[1][0][-1].argmax()), 1: int(got[0][1][-1].argmax())}
    last = runner.step({i: [t] for i, t in nxt.items()})
    for i, logits in ((0, [got[0][0], got[1][0], last[0]]), (1, [got[0][1], last[1]])):
        expected = _hf_logits(hf, [*(seq0 if i == 0 else seq1), nxt[i]])
        torch.testing.assert_close(torch.cat(logits), expected, atol=1e-4, rtol=0)


def test_engine_prefix_cache_hit_gives_transformers_tokens(pair: Pair, tmp_path: Path) -> None:
    """Through the engine: a repeated prompt hits the prefix cache past the window and
    both greedy continuations are transformers'."""
    from gpu_worker import Engine
    from shared.sampling import SamplingParams

    pair.hf.save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path, pair.config.vocab_size)
    engine = Engine(model=str(tmp_path), device="cpu", max_model_len=64, kv_cache_memory_gb=0.01)
    prompt = _prompt(40, 21, pair.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected = _hf_greedy(pair.hf, prompt, 4)
    first = engine.generate([prompt], params)[0]
    second = engine.generate([prompt], params)[0]
    assert second.num_cached_tokens > WINDOW
    assert first.token_ids == second.token_ids == expected


def test_gemma_fields_from_config_without_layer_types() -> None:
    """Older config.json files: Gemma 2's odd/even rule and Gemma 3's
    `sliding_window_pattern` (the last layer of each period global), 4.x rope keys."""
    base: dict[str, Any] = dict(
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=7,
        num_attention_heads=2,
        sliding_window=16,
    )
    gemma2 = config_from_hf({**base, "architectures": ["Gemma2ForCausalLM"]})
    assert gemma2.layer_windows == (16, None, 16, None, 16, None, 16)
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)
    assert gemma2.query_pre_attn_scalar == 256.0
    gemma3 = config_from_hf(
        {
            **base,
            "model_type": "gemma3_text",
            "sliding_window_pattern": 6,
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        }
    )
    assert gemma3.architecture == "Gemma3ForCausalLM"
    assert gemma3.layer_windows == (16, 16, 16, 16, 16, None, 16)
    assert (gemma3.rope_theta, gemma3.rope_local_theta, gemma3.rope_linear_factor) == (
        1e6,
        1e4,
        8.0,
    )
    assert gemma3.attn_logit_softcapping is None


def _write_gguf(hf: transformers.PreTrainedModel, path: Path, arch: str) -> None:
    """What llama.cpp's converter writes for Gemma 2/3, in F32: norm weights with the 1
    added, no q/k row permutation, no output matrix (tied), and the per-layer sliding flags
    (Gemma 3's fixed period of 6 would make all four layers local)."""
    cfg = hf.config
    rope = cfg.rope_parameters if arch == "gemma2" else cfg.rope_parameters["full_attention"]
    with gguf_file(cfg, path, arch, rope_theta=rope["rope_theta"]) as writer:
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        if arch == "gemma2":
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        else:
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
        add_f32_tensors(writer, hf, arch, norm_offset=1.0)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gguf_file_matches_transformers(family: Family, tmp_path: Path) -> None:
    extra = copy.deepcopy(CONFIGS[family])
    if family == "gemma3":  # llama.cpp's local base is fixed: the checkpoint must have it
        extra["rope_parameters"]["sliding_attention"]["rope_theta"] = 10000.0
    extra["query_pre_attn_scalar"] = 16  # head_dim: llama.cpp's scale below 27B
    hf = save_tiny_model(tmp_path / "hf", family, tie_word_embeddings=True, seed=2, **extra)[1]
    path = tmp_path / f"tiny-{family}.gguf"
    _write_gguf(hf, path, family)
    ours, config = load_model(resolve_model(str(path)), torch.device("cpu"))
    assert isinstance(ours, Gemma2ForCausalLM if family == "gemma2" else Gemma3ForCausalLM)
    assert config.layer_windows == LAYER_WINDOWS[family]
    tokens = _prompt(40, 21, config.vocab_size)
    got = PagedRunner(ours, config).step({0: tokens})[0]
    torch.testing.assert_close(got, _hf_logits(hf, tokens), atol=1e-4, rtol=0)
