"""Our Llama-family model against transformers on tiny random HF checkpoints (CPU, fp32)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from gpu_worker.attention.backend import get_attention_backend
from gpu_worker.attention.metadata import build_attention_metadata
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from gpu_worker.loader import load_model
from gpu_worker.models import MODEL_REGISTRY, LlamaForCausalLM
from gpu_worker.models.config import ModelConfig, RopeScaling
from gpu_worker.models.llama import rope_inv_freq
from gpu_worker.runner.kv_caches import allocate_kv_caches
from shared.model_source import resolve_model
from tests.helpers.tiny_models import Family, PagedRunner, save_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Short, so the blend covers several of head_dim 16's frequencies.
    "original_max_position_embeddings": 32,
}

# (id, family, tied, extra config, max_shard_size)
CASES: list[tuple[str, Family, bool, dict[str, Any], str | None]] = [
    ("llama3-rope-tied", "llama", True, {"rope_scaling": LLAMA3_ROPE}, None),
    (
        "llama3-rope-bias-untied-sharded",
        "llama",
        False,
        {"rope_scaling": LLAMA3_ROPE, "attention_bias": True},
        "100KB",
    ),
    ("qwen2-tied", "qwen2", True, {}, None),
    ("qwen2-untied", "qwen2", False, {}, None),
    # head_dim 24 != hidden / heads, so q_size differs from hidden_size.
    ("mistral-untied-head-dim", "mistral", False, {"head_dim": 24}, None),
]


@dataclasses.dataclass
class Pair:
    ours: LlamaForCausalLM
    config: ModelConfig
    hf: transformers.PreTrainedModel


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    case_id, family, tied, extra, shard = request.param
    out_dir: Path = tmp_path_factory.mktemp(case_id)
    _, hf = save_tiny_model(
        out_dir, family, tie_word_embeddings=tied, max_shard_size=shard, **extra
    )
    if shard is not None:
        assert (out_dir / "model.safetensors.index.json").is_file()
    ours, config = load_model(resolve_model(str(out_dir)), torch.device("cpu"))
    assert config.tie_word_embeddings is tied
    return Pair(ours, config, hf)  # type: ignore[arg-type]


def _prompt(seed: int, length: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


@torch.no_grad()
def _hf_logits(hf: transformers.PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()


def test_prefill_logits_match_transformers(pair: Pair) -> None:
    tokens = _prompt(0, 40, pair.config.vocab_size)
    ours = PagedRunner(pair.ours, pair.config).step({0: tokens})[0]
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, _hf_logits(pair.hf, tokens), atol=1e-4, rtol=0)


def test_chunked_prefill_and_decode_in_mixed_batches(pair: Pair) -> None:
    """Two sequences through uneven prefill chunks, mixed with each other's decodes."""
    seq0 = _prompt(1, 40, pair.config.vocab_size)
    seq1 = _prompt(2, 30, pair.config.vocab_size)
    runner = PagedRunner(pair.ours, pair.config, seed=3)
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    schedule = [
        {0: seq0[:13]},
        {0: seq0[13:24], 1: seq1[:9]},
        {1: seq1[9:25], 0: seq0[24:25]},
    ]
    schedule += [{0: [seq0[i]], 1: [seq1[i]]} for i in range(25, 30)]
    schedule += [{0: [seq0[i]]} for i in range(30, 40)]
    for batch in schedule:
        for seq_id, logits in runner.step(batch).items():
            got[seq_id].append(logits)
    for seq_id, tokens in ((0, seq0), (1, seq1)):
        expected = _hf_logits(pair.hf, tokens)
        torch.testing.assert_close(torch.cat(got[seq_id]), expected, atol=1e-4, rtol=0)


def test_llama3_scaling_changes_frequencies() -> None:
    """Guard against the parity tests passing vacuously: the tiny llama3 setting must move
    some frequencies, and never the highest one."""
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rope_scaling=RopeScaling(4.0, 1.0, 4.0, 32),  # LLAMA3_ROPE
    )
    scaled = rope_inv_freq(config)
    unscaled = rope_inv_freq(dataclasses.replace(config, rope_scaling=None))
    assert scaled[0] == unscaled[0]
    assert (scaled != unscaled).sum() >= 3


def test_bf16_model_gives_fp32_logits(pair: Pair, tmp_path: Path) -> None:
    pair.hf.save_pretrained(tmp_path)
    model, config = load_model(resolve_model(str(tmp_path)), torch.device("cpu"), torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    tokens = _prompt(4, 12, config.vocab_size)
    logits = PagedRunner(model, config).step({0: tokens})[0]
    assert logits.dtype == torch.float32
    reference = _hf_logits(pair.hf, tokens)
    # bf16 keeps ~3 significant digits; compare against the logits' own scale.
    assert (logits - reference).abs().max() < 0.1 * reference.abs().max()


def test_registry_covers_the_family() -> None:
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "llama", "qwen2"):
        assert MODEL_REGISTRY[name] is LlamaForCausalLM


# --- attention backend --------------------------------------------------------------------


def _dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, scale: float
) -> torch.Tensor:
    """Plain softmax attention for one sequence: q [new, H, D] at positions context_len..,
    k/v [all, Hkv, D]; written out by hand so it shares no code with the backend."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(context_len, context_len + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (4, 4)])
@pytest.mark.parametrize("pad", [0, -1])
@pytest.mark.parametrize(
    "seqs",
    [
        # (context_len, query_len): a chunk over a cached prefix, decodes, a fresh prefill.
        [(10, 7), (5, 1), (17, 1), (0, 6)],
        # all decodes: the batched fast path; last blocks partially filled.
        [(5, 1), (17, 1), (8, 1), (0, 1)],
    ],
    ids=["mixed", "decode-only"],
)
def test_torch_backend_matches_dense_attention(
    seqs: list[tuple[int, int]], pad: int, num_heads: int, num_kv_heads: int
) -> None:
    block_size, head_dim, scale = 4, 8, 8**-0.5
    backend = get_attention_backend("torch")
    torch.manual_seed(0)
    (kv_cache,) = allocate_kv_caches(
        1, 32, block_size, num_kv_heads, head_dim, torch.float32, "cpu"
    )
    free = torch.randperm(31).add(1).tolist()  # shuffled, never block 0
    tables, full_kv = [], []
    for ctx, q_len in seqs:
        total = ctx + q_len
        tables.append([free.pop() for _ in range(-(-total // block_size))])
        full_kv.append(torch.randn(2, total, num_kv_heads, head_dim))
    # Fill each sequence's cached prefix as earlier steps would have.
    prefix = build_attention_metadata([c for c, _ in seqs], [0] * len(seqs), tables, block_size)
    backend.write_kv(
        torch.cat([kv[0, :c] for kv, (c, _) in zip(full_kv, seqs, strict=True)]),
        torch.cat([kv[1, :c] for kv, (c, _) in zip(full_kv, seqs, strict=True)]),
        kv_cache,
        prefix.slot_mapping,
    )
    meta = build_attention_metadata([n for _, n in seqs], [c for c, _ in seqs], tables, block_size)
    width = meta.block_tables.shape[1]
    meta.block_tables = torch.tensor(
        [t + [pad] * (width - len(t)) for t in tables], dtype=torch.int32
    )
    assert meta.is_pure_decode == all(n == 1 for _, n in seqs)
    qs = [torch.randn(n, num_heads, head_dim) for _, n in seqs]
    new_k = torch.cat([kv[0, c:] for kv, (c, _) in zip(full_kv, seqs, strict=True)])
    new_v = torch.cat([kv[1, c:] for kv, (c, _) in zip(full_kv, seqs, strict=True)])
    backend.plan(meta, kv_cache)
    out = backend.forward(torch.cat(qs), new_k, new_v, kv_cache, meta, scale)
    expected = torch.cat(
        [
            _dense_reference(q, kv[0], kv[1], ctx, scale)
            for q, kv, (ctx, _) in zip(qs, full_kv, seqs, strict=True)
        ]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # Every token's K/V sits at slot block_table[pos // block_size] * block_size + offset.
    for table, kv in zip(tables, full_kv, strict=True):
        for pos in range(kv.shape[1]):
            block, offset = table[pos // block_size], pos % block_size
            assert torch.equal(kv_cache[:, block, offset], kv[:, pos])


def test_attention_backend_registry() -> None:
    assert isinstance(get_attention_backend("torch"), TorchAttentionBackend)
    from gpu_worker.attention.triton_backend import TritonAttentionBackend

    assert isinstance(get_attention_backend("triton"), TritonAttentionBackend)
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash")
