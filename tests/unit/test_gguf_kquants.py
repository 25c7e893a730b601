"""K-quant (Q4_K, Q5_K, Q6_K) and 5-bit (Q5_0, Q5_1) GGUF weights in the CPU kernel: the
test quantizer's accuracy, bit-exact dequantization against gguf on every type and both
kernel paths, GEMM against a float64 reference, the loader keeping the blocks, and greedy
parity of an engine on tiny K-quant GGUF files with the kernel on and off."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from gpu_worker.ops.gguf_linear import SUPPORTED_TYPES, QuantizedWeight
from gpu_worker.ops.linear import Linear
from tests.helpers.gemm_check import check_gemm_against_float64
from tests.helpers.kquants import K_QUANTS, one_type, q4_k_m_type, quantize, write_llama_gguf
from tests.helpers.tiny_models import tiny_hf_model

Q = gguf.GGMLQuantizationType
ALL_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(params=[True, False], ids=["avx512", "scalar"])
def vector(request: pytest.FixtureRequest, ext: ModuleType) -> bool:
    """Each kernel path in turn; the AVX-512 one only where the build has it."""
    if request.param and not ext.has_vector_path():
        pytest.skip("built without the AVX-512 path")
    return request.param


def _weights(n: int, k: int, seed: int) -> np.ndarray:
    """Random rows, plus superblocks that stress the formats: zero, constant, huge, tiny,
    all positive (a K-quant min of 0)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    special = [0.0, 0.75, 5e3, 1e-6, None]
    for row, value in enumerate(special[:n]):
        if value is None:
            w[row, :256] = np.abs(w[row, :256]) + 3.0
        elif value in (5e3, 1e-6):
            w[row, :256] *= value
        else:
            w[row, :256] = value
    return w


def _random_blocks(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    """[n, bytes] of random blocks: every quant and scale bit pattern, fp16 scales set to
    finite values (d and dmin may be negative: the formats allow it)."""
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n, k // block_size, type_size), dtype=np.uint8)
    scales = {Q.Q6_K: slice(208, 210), Q.Q4_1: slice(0, 4), Q.Q5_1: slice(0, 4)}
    where = scales.get(qtype, slice(0, 4 if qtype in (Q.Q4_K, Q.Q5_K) else 2))
    count = (where.stop - where.start) // 2
    values = rng.uniform(-0.05, 0.05, (n, k // block_size, count)).astype(np.float16)
    blocks[:, :, where] = values.view(np.uint8)
    return blocks.reshape(n, -1)


def _container(blocks: np.ndarray, qtype: Q, n: int, k: int) -> tuple[QuantizedWeight, np.ndarray]:
    """Our container of `blocks` and gguf's fp32 dequantization of them."""
    reference = gguf.quants.dequantize(blocks, qtype).reshape(n, k)
    return QuantizedWeight.from_gguf(blocks, int(qtype), (n, k)), reference


def test_every_type_is_supported_with_its_block() -> None:
    assert {Q(t) for t in SUPPORTED_TYPES} == set(ALL_TYPES)
    for qtype in ALL_TYPES:
        assert SUPPORTED_TYPES[int(qtype)] == gguf.GGML_QUANT_SIZES[qtype][0]


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda q: q.name)
def test_test_quantizer_is_close_to_its_input(qtype: Q) -> None:
    """gguf reads back what tests/helpers/kquants.py writes: within a quant step of each
    sub-block's range (0 included), a small error overall."""
    x = _weights(16, 1024, seed=3)
    x[3, :256] = 1e-2 * np.random.default_rng(1).standard_normal(256)  # not fp16-tiny
    stored = quantize(x, qtype)
    assert stored.shape == (16, 4 * gguf.GGML_QUANT_SIZES[qtype][1])
    back = gguf.quants.dequantize(stored, qtype).reshape(x.shape)
    levels, sub = {Q.Q4_K: (15, 32), Q.Q5_K: (31, 32), Q.Q6_K: (31, 16)}[qtype]
    xs, err = x.reshape(-1, sub), np.abs(back - x).reshape(-1, sub)
    spread = np.maximum(xs.max(axis=1), 0) - np.minimum(xs.min(axis=1), 0)
    assert bool((err.max(axis=1) <= spread / levels).all())
    rms = np.sqrt(np.mean((back - x) ** 2) / np.mean(x**2))
    assert rms < {Q.Q4_K: 0.09, Q.Q5_K: 0.045, Q.Q6_K: 0.025}[qtype]
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(x[:, :160], qtype)


def _blocks_of(qtype: Q, w: np.ndarray) -> np.ndarray:
    return quantize(w, qtype)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("source", ["quantized", "random_bytes"])
def test_dequantized_weights_are_ggufs_bit_for_bit(
    ext: ModuleType, qtype: Q, vector: bool, source: str
) -> None:
    n, k = 21, 768
    if source == "quantized":
        blocks = _blocks_of(qtype, _weights(n, k, seed=int(qtype)))
    else:
        blocks = _random_blocks(qtype, n, k, seed=int(qtype))
    quantized, reference = _container(blocks, qtype, n, k)
    ours = ext.dequantize(quantized.data, quantized.qtype, quantized.k, vector).numpy()
    assert np.isfinite(reference).all()
    assert ours.view(np.uint32).tolist() == reference.view(np.uint32).tolist()


def test_k_quant_rows_stay_near_the_files_size() -> None:
    """The repacked rows: 148/180/210 bytes per 256 weights against the file's 144/176/210."""
    for qtype, per_256 in [(Q.Q4_K, 148), (Q.Q5_K, 180), (Q.Q6_K, 210)]:
        quantized, _ = _container(_random_blocks(qtype, 3, 512, seed=0), qtype, 3, 512)
        assert quantized.data.shape == (3, 2 * per_256)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_gemm_matches_float64_reference(ext: ModuleType, qtype: Q, vector: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    # N: below one 4-row tile, not a multiple of 16, several tiles. M: the dot-product
    # path (up to 12), then the outer-product one (16 and 32 rows a pass) with up to 8
    # rows past a multiple of 16 on the dot path.
    for n, k in [(3, 256), (37, 512), (100, 768), (301, 256)]:
        quantized, reference = _container(
            _blocks_of(qtype, _weights(n, k, seed=n + k)), qtype, n, k
        )
        dense = torch.from_numpy(reference).double()
        rows = (1, 2, 7, 8, 9, 12, 13, 16, 17, 33, 50, 96)
        check_gemm_against_float64(ext, quantized, dense, rows, gen, vector)


def test_kernel_refuses_k_quant_rows_not_of_whole_superblocks(ext: ModuleType) -> None:
    quantized, _ = _container(_random_blocks(Q.Q4_K, 2, 256, seed=0), Q.Q4_K, 2, 256)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ext.dequantize(quantized.data[:, :100].contiguous(), int(Q.Q4_K), 128)
    with pytest.raises(RuntimeError, match="expected 148"):
        ext.gemm(torch.randn(1, 256), quantized.data[:, :140].contiguous(), int(Q.Q4_K))


# ---- tiny Llama GGUF files in K-quant types, through the loader and the engine.

HF_SIZES = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    num_hidden_layers=3,
)
FILE_TYPES: dict[str, Callable[[str], Q]] = {
    "Q4_K": one_type(Q.Q4_K),
    "Q5_K": one_type(Q.Q5_K),
    "Q6_K": one_type(Q.Q6_K),
    "Q4_K_M": q4_k_m_type,
}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny Llama (untied head) written once per file type."""
    hf = tiny_hf_model("llama", tie_word_embeddings=False, **HF_SIZES)
    out = tmp_path_factory.mktemp("kquant_gguf")
    paths = {}
    for label, qtype_of in FILE_TYPES.items():
        paths[label] = out / f"tiny-llama.{label}.gguf"
        write_llama_gguf(hf, paths[label], qtype_of)
    return paths


@pytest.mark.parametrize("label", FILE_TYPES)
def test_loader_keeps_k_quant_blocks_equal_to_the_dense_weights(
    ext: ModuleType, gguf_files: dict[str, Path], label: str
) -> None:
    """Every projection and the head read the file's blocks (Q/K rows unpermuted, fused
    parts stacked) and dequantize to the dense weights exactly; Q4_K_M's fused qkv is a
    Q4_K block (Q, K) followed by a Q6_K one (V)."""
    from gpu_worker.loader import load_model
    from shared.model_source import resolve_model

    loaded, config = load_model(resolve_model(str(gguf_files[label])), torch.device("cpu"))
    model: Any = loaded  # a LlamaForCausalLM
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    for layer in model.model.layers:
        projections = {
            "q_proj": layer.self_attn.qkv_proj,
            "o_proj": layer.self_attn.o_proj,
            "gate_proj": layer.mlp.gate_up_proj,
            "down_proj": layer.mlp.down_proj,
        }
        for name, linear in projections.items():
            assert isinstance(linear, Linear)
            assert linear.quantized is not None, (label, name)
            types = [Q(block.qtype) for block in linear.quantized.blocks()]
            if label == "Q4_K_M" and name == "q_proj":
                assert types == [Q.Q4_K, Q.Q6_K]
                assert linear.quantized.data.shape[0] == q_rows + kv_rows
            else:
                assert types == [FILE_TYPES[label](name)], name
            assert torch.equal(linear.quantized.dequantize(), linear.weight)
    head = model.logits_head.quantized
    assert head is not None
    assert head.qtype == int(FILE_TYPES[label]("lm_head.weight"))
    assert torch.equal(head.dequantize(), model.lm_head.weight)


def test_engine_greedy_tokens_equal_with_the_kernel_on_and_off(
    ext: ModuleType, gguf_files: dict[str, Path]
) -> None:
    """The dense path multiplies gguf's dequantized weights, the kernel the same values
    in another order: the greedy tokens agree (prompts and lengths where no step is a
    near-tie), prefill and decode both on the kernel (no batch here exceeds its rows)."""
    from gpu_worker import Engine
    from shared.sampling import SamplingParams

    prompts = [[1, 37, 250, 4, 99, 318, 12], [1, 200, 7], [5] * 20]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for label, path in gguf_files.items():
        tokens = {}
        for enabled in (True, False):
            engine = Engine(
                model=str(path),
                device="cpu",
                cpu_gguf_kernels=enabled,
                max_model_len=64,
                kv_cache_memory_gb=0.01,
            )
            linears = [m for m in engine.model.modules() if isinstance(m, Linear)]
            assert any(m.quantized is not None for m in linears) is enabled
            tokens[enabled] = [c.token_ids for c in engine.generate(prompts, params)]
        assert tokens[True] == tokens[False], label
        assert len({tuple(t) for t in tokens[True]}) == len(prompts), label
