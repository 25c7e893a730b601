"""Our Mixtral and Qwen3-MoE against transformers on tiny random checkpoints (CPU, fp32).

The parity tests are test_llama_model's, run here over MoE `pair`s: Mixtral (4 experts, top-2,
always renormalised), Qwen3-MoE with `norm_topk_prob` and a dense layer by `mlp_only_layers`,
and Qwen3-MoE without renormalisation and a dense layer by `decoder_sparse_step`."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers

from gpu_worker.attention.backend import get_attention_backend
from gpu_worker.loader import config_from_hf, load_model
from gpu_worker.models import MODEL_REGISTRY, MixtralForCausalLM, Qwen3MoeForCausalLM
from gpu_worker.models.llama import MLP
from gpu_worker.models.moe import SparseMoeBlock, stack_expert_weights
from gpu_worker.ops.layer_ops import TritonLayerOps
from shared.model_source import resolve_model
from tests.helpers.gguf_files import gguf_file
from tests.helpers.tiny_models import Family, PagedRunner, save_tiny_model
from tests.unit.test_llama_model import (
    Pair,
    _hf_logits,
    _prompt,
    test_chunked_prefill_and_decode_in_mixed_batches,
    test_prefill_logits_match_transformers,
)
from tests.unit.test_loader import _llama_cpp_permute
from tests.unit.test_qwen3_model import (
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

QWEN3_MOE: dict[str, Any] = {"head_dim": 32, "num_hidden_layers": 3}

# (id, family, tied, extra config, which layers must be dense)
CASES: list[tuple[str, Family, bool, dict[str, Any], tuple[int, ...]]] = [
    ("mixtral-untied", "mixtral", False, {}, ()),
    (
        "qwen3moe-renorm-mlp-only",
        "qwen3_moe",
        False,
        {**QWEN3_MOE, "norm_topk_prob": True, "mlp_only_layers": [1]},
        (1,),
    ),
    (
        "qwen3moe-sparse-step-tied",
        "qwen3_moe",
        True,
        {**QWEN3_MOE, "norm_topk_prob": False, "decoder_sparse_step": 2},
        (0, 2),
    ),
]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    case_id, family, tied, extra, dense = request.param
    out_dir = tmp_path_factory.mktemp(case_id)
    _, hf = save_tiny_model(out_dir, family, tie_word_embeddings=tied, **extra)
    ours, config = load_model(resolve_model(str(out_dir)), torch.device("cpu"))
    assert isinstance(ours, MixtralForCausalLM if family == "mixtral" else Qwen3MoeForCausalLM)
    for i, layer in enumerate(ours.model.layers):
        assert isinstance(layer.mlp, MLP if i in dense else SparseMoeBlock), i
    return Pair(ours, config, hf)


@torch.no_grad()
def _hf_greedy(hf: transformers.PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    generate: Any = hf.generate
    out = generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return list(out[0, len(prompt) :].tolist())


def test_greedy_tokens_match_transformers(pair: Pair) -> None:
    runner = PagedRunner(pair.ours, pair.config, seed=5)
    for seq_id, length in enumerate((3, 21)):
        prompt = _prompt(10 + seq_id, length, pair.config.vocab_size)
        assert runner.greedy(seq_id, prompt, 6) == _hf_greedy(pair.hf, prompt, 6)


def test_mixed_length_batch_matches_transformers(pair: Pair) -> None:
    """Three prompts of different lengths in one step: routing is per token, whatever else
    shares the batch."""
    prompts = {i: _prompt(60 + i, n, pair.config.vocab_size) for i, n in enumerate((9, 1, 26))}
    got = PagedRunner(pair.ours, pair.config).step(prompts)
    for i, prompt in prompts.items():
        torch.testing.assert_close(got[i], _hf_logits(pair.hf, prompt), atol=1e-4, rtol=0)


def test_bf16_model_matches_transformers_in_bf16(pair: Pair, tmp_path: Path) -> None:
    """In bf16 a near tie between two experts can route differently from the fp32 model, so
    the reference is transformers' model in bf16 too: the router rounds as ours does."""
    pair.hf.save_pretrained(tmp_path)
    model, config = load_model(resolve_model(str(tmp_path)), torch.device("cpu"), torch.bfloat16)
    tokens = _prompt(4, 12, config.vocab_size)
    logits = PagedRunner(model, config).step({0: tokens})[0]
    assert logits.dtype == torch.float32
    hf_bf16: Any = copy.deepcopy(pair.hf)
    reference = _hf_logits(hf_bf16.to(torch.bfloat16), tokens)
    # bf16 keeps ~3 significant digits (a different expert would be off by ~15% of scale).
    torch.testing.assert_close(logits, reference, atol=0.03 * float(reference.abs().max()), rtol=0)


def test_engine_gives_transformers_tokens(tmp_path: Path) -> None:
    """Through the engine (scheduler, paged cache, sampler): a tiny Qwen3-MoE with a dense
    layer, two prompts batched, greedy tokens equal to transformers'."""
    from gpu_worker import Engine
    from shared.sampling import SamplingParams

    extra = {**QWEN3_MOE, "mlp_only_layers": [0]}
    _, hf = save_tiny_model(tmp_path, "qwen3_moe", tokenizer="words", seed=3, **extra)
    engine = Engine(model=str(tmp_path), device="cpu", max_model_len=64, kv_cache_memory_gb=0.01)
    prompts = [_prompt(70, 11, hf.config.vocab_size), _prompt(71, 4, hf.config.vocab_size)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    done = engine.generate(prompts, params)
    assert [d.token_ids for d in done] == [_hf_greedy(hf, p, 5) for p in prompts]


def test_triton_path_matches_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton attention, layer ops and fused MoE kernel (interpreted on CPU): one mixed
    batch, then a decode step, of a one-layer Qwen3-MoE."""
    extra = {**QWEN3_MOE, "num_hidden_layers": 1, "norm_topk_prob": True}
    _, hf = save_tiny_model(tmp_path, "qwen3_moe", tie_word_embeddings=False, seed=1, **extra)
    ops = TritonLayerOps()
    calls: list[int] = []
    kernel = ops._fused_moe

    def counted(*args: torch.Tensor) -> torch.Tensor:
        calls.append(len(args))
        return kernel(*args)

    monkeypatch.setattr(ops, "_fused_moe", counted)
    ours, config = load_model(
        resolve_model(str(tmp_path)),
        torch.device("cpu"),
        attn_backend=get_attention_backend("triton"),
        layer_ops=ops,
    )
    prompts = {0: _prompt(30, 7, config.vocab_size), 1: _prompt(31, 2, config.vocab_size)}
    runner = PagedRunner(ours, config)
    first = runner.step(prompts)
    nxt = {i: [int(first[i][-1].argmax())] for i in prompts}
    second = runner.step(nxt)
    assert len(calls) == 2
    for i, prompt in prompts.items():
        expected = _hf_logits(hf, prompt + nxt[i])
        torch.testing.assert_close(torch.cat((first[i], second[i])), expected, atol=1e-4, rtol=0)


def test_registry_and_config() -> None:
    assert MODEL_REGISTRY["MixtralForCausalLM"] is MixtralForCausalLM
    assert MODEL_REGISTRY["Qwen3MoeForCausalLM"] is MODEL_REGISTRY["qwen3moe"]
    base = {
        "vocab_size": 8,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "head_dim": 32,
        "sliding_window": 4096,
        "use_sliding_window": False,
    }
    # A Qwen3-30B-A3B style config.json: `num_experts`, every second layer sparse but 3.
    qwen = config_from_hf(
        {
            "model_type": "qwen3_moe",
            **base,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 16,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3],
            "norm_topk_prob": True,
        }
    )
    assert qwen.architecture == "Qwen3MoeForCausalLM"
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (128, 8, 16)
    assert qwen.norm_topk_prob
    assert qwen.sliding_window is None
    assert [qwen.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    mixtral = config_from_hf(
        {"model_type": "mixtral", **base, "num_local_experts": 8, "norm_topk_prob": False}
    )
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.norm_topk_prob) == (
        8,
        2,
        True,
    )
    assert mixtral.moe_intermediate_size == 96
    assert mixtral.sliding_window == 4096  # Mixtral slides every layer when it has a window
    assert all(mixtral.is_moe_layer(i) for i in range(6))


def test_expert_stacking_takes_either_layout() -> None:
    """Per-expert matrices (HF) and all-expert ones (GGUF) stack alike; a missing expert
    is an error, not a silently empty slice."""
    gate, up, down = torch.randn(3, 4, 5), torch.randn(3, 4, 5), torch.randn(3, 5, 4)
    p = "model.layers.0.mlp.experts"
    per_expert = [
        (f"{p}.{e}.{n}.weight", w[e])
        for e in (2, 0, 1)
        for n, w in (("down_proj", down), ("gate_proj", gate), ("up_proj", up))
    ]
    stacked = [
        (f"{p}.{n}.weight", w)
        for n, w in (("up_proj", up), ("gate_proj", gate), ("down_proj", down))
    ]
    other = ("model.norm.weight", torch.ones(5))
    for weights in (per_expert, stacked):
        out = dict(stack_expert_weights([other, *weights], 3))
        assert list(out) == ["model.norm.weight", f"{p}.gate_up_proj", f"{p}.down_proj"]
        torch.testing.assert_close(out[f"{p}.gate_up_proj"], torch.cat((gate, up), dim=1))
        torch.testing.assert_close(out[f"{p}.down_proj"], down)
    with pytest.raises(ValueError, match="lacks 3 expert tensors"):
        list(stack_expert_weights(per_expert[3:], 3))


def _write_gguf(hf: transformers.PreTrainedModel, path: Path, arch: str) -> None:
    """What llama.cpp's converter writes, in F32: Mixtral as `llama` with experts (q/k rows
    permuted), Qwen3-MoE as `qwen3moe`; each expert projection as one [experts, ...] tensor."""
    cfg = hf.config
    with gguf_file(cfg, path, arch, head_dims=arch == "qwen3moe") as writer:
        writer.add_expert_count(cfg.num_local_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        model_arch = gguf.MODEL_ARCH.LLAMA if arch == "llama" else gguf.MODEL_ARCH.QWEN3MOE
        names = gguf.get_tensor_name_map(model_arch, cfg.num_hidden_layers)
        for name, tensor in hf.state_dict().items():
            array = tensor.numpy()
            layer = name.split(".")[2] if name.startswith("model.layers.") else ""
            if name.endswith("experts.gate_up_proj"):  # transformers 5 keeps gate/up fused
                gate, up = np.split(array, 2, axis=1)
                tensors = {
                    f"blk.{layer}.ffn_gate_exps.weight": gate,
                    f"blk.{layer}.ffn_up_exps.weight": up,
                }
            elif name.endswith("experts.down_proj"):
                tensors = {f"blk.{layer}.ffn_down_exps.weight": array}
            elif name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            else:
                gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
                assert gguf_name is not None, name
                if arch == "llama" and ".q_proj." in name:
                    array = _llama_cpp_permute(array, cfg.num_attention_heads)
                elif arch == "llama" and ".k_proj." in name:
                    array = _llama_cpp_permute(array, cfg.num_key_value_heads)
                tensors = {gguf_name: array}
            for gguf_name, value in tensors.items():
                writer.add_tensor(gguf_name, np.ascontiguousarray(value, dtype=np.float32))


@pytest.mark.parametrize(
    ("family", "arch", "extra"),
    [
        ("mixtral", "llama", {}),
        # llama.cpp's qwen3moe has experts in every layer, and renormalises.
        ("qwen3_moe", "qwen3moe", {**QWEN3_MOE, "norm_topk_prob": True}),
    ],
    ids=["mixtral", "qwen3moe"],
)
def test_gguf_file_matches_transformers(
    tmp_path: Path, family: Family, arch: str, extra: dict[str, Any]
) -> None:
    hf = save_tiny_model(tmp_path / "hf", family, tie_word_embeddings=False, seed=2, **extra)[1]
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(hf, path, arch)
    ours, config = load_model(resolve_model(str(path)), torch.device("cpu"))
    assert isinstance(ours, MixtralForCausalLM if family == "mixtral" else Qwen3MoeForCausalLM)
    assert config.dense_layers == ()
    assert (config.num_experts, config.num_experts_per_tok) == (hf.config.num_local_experts, 2)
    tokens = _prompt(40, 21, config.vocab_size)
    got = PagedRunner(ours, config).step({0: tokens})[0]
    torch.testing.assert_close(got, _hf_logits(hf, tokens), atol=1e-4, rtol=0)
