"""Rotary embedding against its reference and the model's own RotaryEmbedding/apply_rotary."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.models.config import ModelConfig, RopeScaling
from gpu_worker.models.llama import RotaryEmbedding
from gpu_worker.ops.layer_ops import TorchLayerOps, apply_rotary
from kernels.rotary import rotary_embedding, rotary_embedding_ref
from tests.helpers.kernel_checks import ELEMENTWISE_TOL, random_tensor

MAX_POSITIONS = 64
# llama3 scaling with a short original context, so the blend covers several frequencies.
LLAMA3 = RopeScaling(
    factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
)


def _model_rope(num_heads: int, head_dim: int, device: torch.device) -> RotaryEmbedding:
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=16,
        hidden_size=num_heads * head_dim,
        intermediate_size=16,
        num_layers=1,
        num_heads=num_heads,
        num_kv_heads=1,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        rope_scaling=LLAMA3,
    )
    rope = RotaryEmbedding(config)
    rope.build(device)
    return rope


def _half_tables(head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain HF-shaped tables: cos/sin of each pair's angle, [positions, head_dim // 2]."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(MAX_POSITIONS).float(), inv_freq)
    return freqs.cos().to(device), freqs.sin().to(device)


def _assert_close(actual, expected, dtype):
    atol, rtol = ELEMENTWISE_TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128)])
def test_rotary_matches_model(device, dtype, num_heads, num_kv_heads, head_dim):
    """The model's llama3-scaled tables, indexed by the kernel, against the model's rotation."""
    num_tokens = 5
    rope = _model_rope(num_heads, head_dim, device)
    positions = torch.tensor([0, 1, 17, 63, 17], dtype=torch.int64, device=device)
    q = random_tensor(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
    k = random_tensor(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device, seed=2)
    q_out, k_out = rotary_embedding(q, k, positions, rope.cos_cache, rope.sin_cache)
    tables = TorchLayerOps().rotary_tables(positions, rope.cos_cache, rope.sin_cache)
    _assert_close(q_out, apply_rotary(q, tables.cos, tables.sin), dtype)
    _assert_close(k_out, apply_rotary(k, tables.cos, tables.sin), dtype)
    q_ref, k_ref = rotary_embedding_ref(q, k, positions, rope.cos_cache, rope.sin_cache)
    _assert_close(q_out, q_ref, dtype)
    _assert_close(k_out, k_ref, dtype)


def test_rotary_half_width_tables_in_place_on_fused_qkv(device, dtype):
    """HF-shaped half-width tables; in place on q/k views of one fused QKV buffer, whose v
    part must stay untouched."""
    num_heads, num_kv_heads, head_dim, num_tokens = 4, 2, 64, 3
    cos_cache, sin_cache = _half_tables(head_dim, device)
    positions = torch.tensor([5, 6, 40], dtype=torch.int32, device=device)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = random_tensor(num_tokens, width, dtype=dtype, device=device)
    before = qkv.clone()
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    q_ref, k_ref = rotary_embedding_ref(q, k, positions.long(), cos_cache, sin_cache)
    q_out, k_out = rotary_embedding(q, k, positions, cos_cache, sin_cache, inplace=True)
    assert q_out.data_ptr() == q.data_ptr()
    assert k_out.data_ptr() == k.data_ptr()
    _assert_close(q, q_ref, dtype)
    _assert_close(k, k_ref, dtype)
    assert torch.equal(qkv[:, q_size + kv_size :], before[:, q_size + kv_size :])
