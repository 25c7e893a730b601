"""duet's CPU kernels (gpu_worker/ops/csrc/cpu_ops.cpp): paged decode attention against a
float64 reference, the KV write against index_copy_, RMSNorm against F.rms_norm, and the
torch attention backend with and without them. The cache is fp32, bf16 or fp16
(--kv-cache-dtype): the reference reads the same stored 16-bit values, so the kernel must
match it as closely as for an fp32 cache."""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.attention import torch_backend as attention
from gpu_worker.attention.metadata import AttentionMetadata, build_attention_metadata
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from gpu_worker.ops import cpu_ops
from gpu_worker.ops.layer_ops import apply_rotary

BLOCK = 16
CACHE_DTYPES = [
    pytest.param(torch.float32, id="cache-fp32"),
    pytest.param(torch.bfloat16, id="cache-bf16"),
    pytest.param(torch.float16, id="cache-fp16"),
]


pytestmark = pytest.mark.usefixtures("one_thread")


def _paged_case(
    seq_lens: list[int],
    heads: int,
    kv_heads: int,
    dim: int,
    seed: int,
    cache_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, a cache (of `cache_dtype`) whose unused blocks are NaN (a read of one poisons the
    output), block tables in shuffled order padded with -1 past each sequence's last
    block, seq_lens."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = sum(needed) + 5  # spare blocks nobody owns
    cache = torch.full((2, num_blocks, BLOCK, kv_heads, dim), float("nan"))
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(needed, default=0) + 2
    tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    for i, n in enumerate(needed):
        ids = [order.pop() for _ in range(n)]
        tables[i, :n] = torch.tensor(ids, dtype=torch.int32)
        for b in ids:
            cache[:, b] = torch.randn((2, BLOCK, kv_heads, dim), generator=gen)
    q = torch.randn((len(seq_lens), heads, dim), generator=gen)
    return q, cache.to(cache_dtype), tables, torch.tensor(seq_lens, dtype=torch.int32)


def _reference(
    q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Gather each sequence's keys/values (as stored, in any dtype), softmax in float64."""
    heads, dim = q.shape[1:]
    kv_heads = cache.shape[3]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        ids = tables[i, : -(-n // BLOCK)].long()
        k, v = (cache[j, ids].reshape(-1, kv_heads, dim)[:n].double() for j in (0, 1))
        kv_of = torch.arange(heads) // (heads // kv_heads)
        scores = torch.einsum("hd,thd->ht", q[i].double(), k[:, kv_of]) * scale
        out[i] = torch.einsum("ht,thd->hd", scores.softmax(-1), v[:, kv_of])
    return out


LENGTHS = [1, 15, 16, 17, 100]


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("vector", [True, False], ids=["avx512", "portable"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (16, 2)])  # GQA ratio 1, 3, 8
@pytest.mark.parametrize("n", [1, 3, 17])
def test_paged_decode_attention_matches_reference(
    ext: ModuleType,
    vector: bool,
    dim: int,
    heads: int,
    kv_heads: int,
    n: int,
    cache_dtype: torch.dtype,
) -> None:
    seq_lens = [LENGTHS[(i + n) % len(LENGTHS)] for i in range(n)]
    if n > 1:
        seq_lens[1] = 0  # an empty row gives zeros
    q, cache, tables, lens = _paged_case(
        seq_lens, heads, kv_heads, dim, seed=n * dim + heads, cache_dtype=cache_dtype
    )
    scale = dim**-0.5
    out = cpu_ops.paged_decode_attention(q, cache, tables, lens, scale, vector=vector)
    assert out.shape == q.shape
    assert out.dtype == torch.float32
    torch.testing.assert_close(
        out.double(), _reference(q, cache, tables, lens, scale), atol=2e-6, rtol=1e-5
    )
    if n > 1:
        assert torch.all(out[1] == 0)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("dim", [40, 80])
def test_paged_decode_attention_other_head_dims(
    ext: ModuleType, dim: int, cache_dtype: torch.dtype
) -> None:
    """Head dims the vector path does not specialize go to the portable one."""
    q, cache, tables, lens = _paged_case([5, 33, 16], 6, 2, dim, seed=dim, cache_dtype=cache_dtype)
    out = cpu_ops.paged_decode_attention(q, cache, tables, lens, 0.3)
    torch.testing.assert_close(
        out.double(), _reference(q, cache, tables, lens, 0.3), atol=2e-6, rtol=1e-5
    )


def test_paged_decode_attention_large_scores(ext: ModuleType) -> None:
    """Scores in the hundreds: the max-subtracted softmax neither overflows nor loses the
    winner."""
    q, cache, tables, lens = _paged_case([100, 37], 4, 2, 64, seed=7)
    q = q * 40
    out = cpu_ops.paged_decode_attention(q, cache, tables, lens, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(
        out.double(), _reference(q, cache, tables, lens, 1.0), atol=1e-5, rtol=1e-5
    )


def test_paged_decode_attention_strided_rows_and_threads(ext: ModuleType) -> None:
    """q may be a row-strided view (of the fused QKV output); more threads split the
    (sequence, kv head) items differently and each item still computes alone, so the result
    is the same to the bit."""
    seq_lens = [200 + 37 * i for i in range(24)]
    q, cache, tables, lens = _paged_case(seq_lens, 9, 3, 64, seed=3)
    wide = torch.randn(q.shape[0], q.shape[1] + 6, q.shape[2])
    wide[:, :9] = q
    view = wide[:, :9]
    assert not view.is_contiguous()
    one = cpu_ops.paged_decode_attention(view, cache, tables, lens, 0.125)
    torch.testing.assert_close(
        one, cpu_ops.paged_decode_attention(q, cache, tables, lens, 0.125), atol=0, rtol=0
    )
    torch.set_num_threads(2)
    try:
        two = cpu_ops.paged_decode_attention(q, cache, tables, lens, 0.125)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(one, two)


def test_paged_decode_attention_rejects_bad_input(ext: ModuleType) -> None:
    q, cache, tables, lens = _paged_case([20, 3], 4, 2, 64, seed=1)
    bad = tables.clone()
    bad[0, 1] = -1
    with pytest.raises(RuntimeError, match="not a block of the cache"):
        cpu_ops.paged_decode_attention(q, cache, bad, lens, 1.0)
    with pytest.raises(RuntimeError, match="does not fit"):
        cpu_ops.paged_decode_attention(
            q, cache, tables, torch.tensor([20, 999], dtype=torch.int32), 1.0
        )
    with pytest.raises(RuntimeError, match="int32"):
        cpu_ops.paged_decode_attention(q, cache, tables.long(), lens, 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ops.paged_decode_attention(q.double(), cache, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        cpu_ops.paged_decode_attention(q, cache.double(), tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="multiple"):
        cpu_ops.paged_decode_attention(q[:, :3], cache, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_ops.paged_decode_attention(
            q.transpose(1, 2).contiguous().transpose(1, 2), cache, tables, lens, 1.0
        )


def test_write_kv_matches_index_copy(ext: ModuleType) -> None:
    """Strided k/v views (as the model passes them), slots in any order."""
    qkv = torch.randn(37, 4 + 2 * 2, 64)
    k, v = qkv[:, 4:6], qkv[:, 6:]
    slots = torch.randperm(20 * BLOCK)[:37]
    want = torch.randn(2, 20, BLOCK, 2, 64)
    got = want.clone()
    for i in (0, 1):
        want[i].view(-1, 2, 64).index_copy_(0, slots, (k, v)[i])
    cpu_ops.write_kv(k, v, got, slots)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="outside"):
        cpu_ops.write_kv(k[:1], v[:1], got, torch.tensor([20 * BLOCK]))


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_write_kv_rounds_as_torch_does(ext: ModuleType, cache_dtype: torch.dtype) -> None:
    """Into a 16-bit cache each value is what `.to(cache_dtype)` gives, bit for bit: ties,
    values past fp16's range, denormals, infinities and NaN included."""
    qkv = torch.randn(37, 4 + 2 * 2, 64) * 4
    special = torch.tensor(
        [0.0, -0.0, 1e-40, -3e-39, 1e-8, 65504.0, 65520.0, 1e6, -3.0e38, float("inf"),
         float("-inf"), float("nan"), 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-11]
    )  # fmt: skip
    qkv.view(-1)[: special.numel()] = special
    qkv[5, 4, :8] = special[:8]  # in k
    qkv[9, 7, :8] = special[7:]  # in v
    k, v = qkv[:, 4:6], qkv[:, 6:]
    slots = torch.randperm(20 * BLOCK)[:37]
    want = torch.randn(2, 20, BLOCK, 2, 64).to(cache_dtype)
    got = want.clone()
    for i in (0, 1):
        want[i].view(-1, 2, 64).index_copy_(0, slots, (k, v)[i].to(cache_dtype))
    cpu_ops.write_kv(k, v, got, slots)
    # Bits, not values: -0.0 must stay -0.0; a NaN need only stay a NaN.
    same_bits = got.view(torch.int16) == want.view(torch.int16)
    assert bool((same_bits | (got.isnan() & want.isnan())).all())


@pytest.mark.parametrize("shape", [(1, 576), (7, 576), (3, 5, 64), (2, 100)])
def test_rms_norm_matches_torch(ext: ModuleType, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen) * 3
    residual = torch.randn(shape, generator=gen)
    weight = torch.randn(shape[-1], generator=gen)
    eps = 1e-5
    want = F.rms_norm(x, weight.shape, weight, eps)
    torch.testing.assert_close(cpu_ops.rms_norm(x, weight, eps), want, rtol=1e-6, atol=1e-7)

    out, new_residual = cpu_ops.add_rms_norm(x, residual, weight, eps)
    assert torch.equal(new_residual, residual + x)  # one fp32 add, as torch's
    want = F.rms_norm(residual + x, weight.shape, weight, eps)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)


def test_rms_norm_matches_hf_formula(ext: ModuleType) -> None:
    """`weight * (x * rsqrt(mean(x^2) + eps))` computed in float64 (HF's order)."""
    x = torch.randn(5, 576) * 10
    weight = torch.randn(576)
    xd = x.double()
    want = weight.double() * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6))
    got = cpu_ops.rms_norm(x, weight, 1e-6).double()
    assert ((got - want).abs() / want.abs().clamp_min(1e-30)).max() < 1e-6


def test_rms_norm_rejects_bad_input(ext: ModuleType) -> None:
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="weight"):
        cpu_ops.rms_norm(x, torch.randn(63), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_ops.rms_norm(x.t(), torch.randn(4), 1e-5)
    with pytest.raises(RuntimeError, match="residual"):
        cpu_ops.add_rms_norm(x, torch.randn(4, 32), torch.randn(64), 1e-5)


@pytest.mark.parametrize(("tokens", "heads", "dim"), [(1, 12, 64), (37, 6, 128), (3000, 4, 32)])
def test_rotate_qk_is_apply_rotary_to_the_bit(
    ext: ModuleType, tokens: int, heads: int, dim: int
) -> None:
    """On q and k as the attention layer takes them (a view into the fused qkv rows), with
    tables gathered as `rotary_tables` gathers them; 3000 tokens split over threads."""
    generator = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2) * dim, generator=generator) * 4
    qk = qkv[:, : heads * dim].view(tokens, heads, dim)
    positions = torch.randint(0, 4096, (tokens,), generator=generator)
    angles = torch.rand(4096, dim, generator=generator) * 100
    cos = angles.cos().index_select(0, positions)[:, None, :]
    sin = angles.sin().index_select(0, positions)[:, None, :]
    assert cpu_ops.rotatable(qk, cos)
    want = apply_rotary(qk, cos, sin)
    assert torch.equal(cpu_ops.rotate_qk(qk, cos, sin), want)
    torch.set_num_threads(2)
    try:
        assert torch.equal(cpu_ops.rotate_qk(qk, cos, sin), want)
    finally:
        torch.set_num_threads(1)


def test_rotate_qk_takes_whole_heads_only(ext: ModuleType) -> None:
    qkv = torch.randn(5, 4 * 64)
    partial = qkv[:, : 3 * 64].view(5, 3, 64)[..., :32]  # Phi-3's partial rotary
    cos = torch.randn(5, 1, 32)
    assert not cpu_ops.rotatable(partial, cos)
    assert not cpu_ops.rotatable(qkv[:, : 3 * 64].view(5, 3, 64), torch.randn(5, 1, 32))
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_ops.rotate_qk(partial, cos, cos)


def test_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the extension: `available` says so and the entry points raise."""
    monkeypatch.setattr(cpu_ops, "load_extension", lambda: None)
    x = torch.randn(2, 8)
    assert not cpu_ops.available(x)
    with pytest.raises(RuntimeError, match="not available"):
        cpu_ops.rms_norm(x, torch.ones(8), 1e-5)


def test_available_needs_cpu_fp32(ext: ModuleType) -> None:
    assert cpu_ops.available(torch.zeros(2))
    assert not cpu_ops.available(torch.zeros(2, dtype=torch.float64))
    assert not cpu_ops.available(torch.zeros(2, dtype=torch.bfloat16))


def test_kv_cache_available_takes_16_bit_caches(
    ext: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert cpu_ops.kv_cache_available(torch.zeros(2, dtype=dtype))
    assert not cpu_ops.kv_cache_available(torch.zeros(2, dtype=torch.float64))
    monkeypatch.setattr(cpu_ops, "load_extension", lambda: None)
    assert not cpu_ops.kv_cache_available(torch.zeros(2, dtype=torch.bfloat16))


def _kernels_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch backend without duet's kernels: as where the extension cannot be built."""
    monkeypatch.setattr(attention.cpu_ops, "load_extension", lambda: None)


def _mixed_step(
    heads: int, kv_heads: int, dim: int, cache_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A cache holding each sequence's context, and a step mixing a fresh prompt, a prefill
    chunk over a cached prefix and decodes (non-contiguous rows among them)."""
    gen = torch.Generator().manual_seed(11)
    query_lens = [1, 9, 1, 1, 20, 1]
    context_lens = [40, 16, 15, 0, 0, 100]
    num_blocks = 48
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for q_len, ctx in zip(query_lens, context_lens, strict=True):
        tables.append([order.pop() for _ in range(-(-(q_len + ctx) // BLOCK))])
    cache = torch.randn((2, num_blocks, BLOCK, kv_heads, dim), generator=gen).to(cache_dtype)
    meta = build_attention_metadata(query_lens, context_lens, tables, BLOCK)
    tokens = sum(query_lens)
    q = torch.randn((tokens, heads, dim), generator=gen)
    k = torch.randn((tokens, kv_heads, dim), generator=gen)
    v = torch.randn((tokens, kv_heads, dim), generator=gen)
    return q, k, v, cache, meta


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4)])
def test_backend_with_kernel_equals_without(
    ext: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    heads: int,
    kv_heads: int,
    cache_dtype: torch.dtype,
) -> None:
    q, k, v, cache, meta = _mixed_step(heads, kv_heads, 64, cache_dtype)
    backend = TorchAttentionBackend(torch.float32)
    scale = 64**-0.5

    fast_cache = cache.clone()
    backend.plan(meta, fast_cache)
    fast = backend.forward(q, k, v, fast_cache, meta, scale)
    assert backend.step_plan is not None
    assert backend.step_plan.kernel_decodes is not None
    assert backend.step_plan.decode == []

    _kernels_off(monkeypatch)
    slow_cache = cache.clone()
    backend.plan(meta, slow_cache)
    slow = backend.forward(q, k, v, slow_cache, meta, scale)
    assert backend.step_plan is not None
    assert backend.step_plan.kernel_decodes is None

    assert torch.equal(fast_cache, slow_cache)
    # Prefill rows take the same torch path; decode rows differ by summation order only.
    torch.testing.assert_close(fast, slow, atol=2e-6, rtol=1e-5)
    decode_rows = [0, 10, 11, 32]
    prefill_rows = [i for i in range(q.shape[0]) if i not in decode_rows]
    assert torch.equal(fast[prefill_rows], slow[prefill_rows])


def test_backend_pure_decode_uses_kernel_without_plan(
    ext: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(5)
    context_lens = [15, 16, 47, 0, 3]
    tables = [[4 * i + j for j in range(4)] for i in range(5)]
    meta = build_attention_metadata([1] * 5, context_lens, tables, BLOCK)
    cache = torch.randn((2, 20, BLOCK, 3, 64), generator=gen)
    q = torch.randn((5, 9, 64), generator=gen)
    k, v = torch.randn((2, 5, 3, 64), generator=gen).unbind(0)
    backend = TorchAttentionBackend()
    fast_cache = cache.clone()
    backend.plan(meta, fast_cache)
    fast = backend.forward(q, k, v, fast_cache, meta, 0.125)
    assert backend.step_plan is None

    _kernels_off(monkeypatch)
    slow_cache = cache.clone()
    backend.plan(meta, slow_cache)
    slow = backend.forward(q, k, v, slow_cache, meta, 0.125)
    assert torch.equal(fast_cache, slow_cache)
    torch.testing.assert_close(fast, slow, atol=2e-6, rtol=1e-5)
    assert math.isfinite(float(fast.abs().sum()))
