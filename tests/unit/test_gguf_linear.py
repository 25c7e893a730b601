"""The GGUF CPU kernel: bit-exact dequantization, GEMM against a float64 reference, the
model's dispatch to it, and the dense fallback."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import ModuleType

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gpu_worker.ops import gguf_linear
from gpu_worker.ops.gguf_linear import (
    MAX_QUANTIZED_ROWS,
    QuantizedWeight,
    load_extension,
    quantized_kernels_available,
)
from gpu_worker.ops.kernel_build import ENV_SWITCH
from gpu_worker.ops.linear import Linear
from tests.helpers.gemm_check import check_gemm_against_float64

# The per-32 types gguf can quantize; the K-quants (rows of 256) are in test_gguf_kquants.py.
QTYPES = [
    gguf.GGMLQuantizationType.Q4_0,
    gguf.GGMLQuantizationType.Q4_1,
    gguf.GGMLQuantizationType.Q5_0,
    gguf.GGMLQuantizationType.Q5_1,
    gguf.GGMLQuantizationType.Q8_0,
]


pytestmark = pytest.mark.usefixtures("one_thread")


def _weights(n: int, k: int, seed: int) -> np.ndarray:
    """Random rows, plus blocks that stress the formats: all zero, constant, huge, tiny."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[0, :32] = 0.0
    if n > 1:
        w[1, :32] = 0.75
    if n > 2:
        w[2, :32] *= 5e3  # near fp16 range: scales and mins up to ~2e4
    if n > 3:
        w[3, :32] *= 1e-6
    return w


def _quantize(
    w: np.ndarray, qtype: gguf.GGMLQuantizationType
) -> tuple[QuantizedWeight, np.ndarray]:
    """Our container and gguf's own fp32 dequantization of the same blocks."""
    blocks = gguf.quants.quantize(w, qtype)
    reference = gguf.quants.dequantize(blocks, qtype).reshape(w.shape)
    return QuantizedWeight.from_gguf(blocks, int(qtype), w.shape), reference


@pytest.fixture(params=[True, False], ids=["avx512", "scalar"])
def vector(request: pytest.FixtureRequest, ext: ModuleType) -> bool:
    """Each kernel path in turn; the AVX-512 one only where the build has it."""
    if request.param and not ext.has_vector_path():
        pytest.skip("built without the AVX-512 path")
    return request.param


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_dequantized_weights_are_ggufs_bit_for_bit(
    ext: ModuleType, qtype: gguf.GGMLQuantizationType, vector: bool
) -> None:
    w = _weights(45, 160, seed=int(qtype))
    quantized, reference = _quantize(w, qtype)
    ours = ext.dequantize(quantized.data, quantized.qtype, quantized.k, vector).numpy()
    assert ours.view(np.uint32).tolist() == reference.view(np.uint32).tolist()


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_gemm_matches_float64_reference(
    ext: ModuleType, qtype: gguf.GGMLQuantizationType, vector: bool
) -> None:
    gen = torch.Generator().manual_seed(0)
    # N: below one 4-row tile, not a multiple of 16, several tiles. M: the dot-product
    # path (up to 12), then the outer-product one (16 and 32 rows a pass) with up to 8
    # rows past a multiple of 16 on the dot path.
    for n, k in [(3, 32), (37, 96), (100, 576), (1000, 64)]:
        quantized, reference = _quantize(_weights(n, k, seed=n + k), qtype)
        dense = torch.from_numpy(reference).double()
        rows = (1, 2, 3, 7, 8, 9, 12, 13, 20, 24, 32, 33, 50)
        check_gemm_against_float64(ext, quantized, dense, rows, gen, vector)


def test_linear_dispatch(ext: ModuleType) -> None:
    w = _weights(24, 64, seed=1)
    quantized, reference = _quantize(w, gguf.GGMLQuantizationType.Q4_1)
    layer = Linear(64, 24, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(reference))
    layer.quantized = quantized
    small = torch.randn(MAX_QUANTIZED_ROWS, 64)
    assert torch.equal(layer(small), ext.gemm(small, quantized.data, quantized.qtype, layer.bias))
    # Past the threshold, and for other dtypes, the dense weight runs as before.
    large = torch.randn(MAX_QUANTIZED_ROWS + 1, 64)
    assert torch.equal(layer(large), F.linear(large, layer.weight, layer.bias))
    half = small.bfloat16()
    assert torch.equal(
        layer.bfloat16()(half), F.linear(half, layer.weight.bfloat16(), layer.bias.bfloat16())
    )


def test_cat_stacks_types_in_runs_and_refuses_mixed_widths(ext: ModuleType) -> None:
    """A fused layer of Q4_1, Q4_1, Q8_0 parts: one block per run of a type, the rows in
    order through both `linear` (bias split alike) and `dequantize`."""
    w = _weights(8, 64, seed=2)
    a, ref_a = _quantize(w, gguf.GGMLQuantizationType.Q4_1)
    b, ref_b = _quantize(w * 2, gguf.GGMLQuantizationType.Q8_0)
    same = QuantizedWeight.cat([a, a])
    assert same is not None
    assert same.n == 16
    assert not same.more
    mixed = QuantizedWeight.cat([a, a, b])
    assert mixed is not None
    assert (mixed.n, mixed.k) == (24, 64)
    assert [(blk.qtype, blk.data.shape[0]) for blk in mixed.blocks()] == [
        (a.qtype, 16),
        (b.qtype, 8),
    ]
    dense = torch.from_numpy(np.concatenate([ref_a, ref_a, ref_b]))
    assert torch.equal(mixed.dequantize(), dense)
    x, bias = torch.randn(3, 64), torch.randn(24)
    expected = torch.cat(
        [
            ext.gemm(x, a.data, a.qtype, bias[:8]),
            ext.gemm(x, a.data, a.qtype, bias[8:16]),
            ext.gemm(x, b.data, b.qtype, bias[16:]),
        ],
        dim=1,
    )
    assert torch.equal(mixed.linear(x, bias), expected)
    # Stacking a stack keeps one block per run.
    again = QuantizedWeight.cat([mixed, b])
    assert again is not None
    assert [blk.data.shape[0] for blk in again.blocks()] == [16, 16]
    wide, _ = _quantize(_weights(8, 96, seed=3), gguf.GGMLQuantizationType.Q4_1)
    assert QuantizedWeight.cat([a, wide]) is None


@pytest.fixture
def fresh_extension_cache() -> Iterator[None]:
    load_extension.cache_clear()
    yield
    load_extension.cache_clear()


@pytest.mark.usefixtures("fresh_extension_cache")
def test_switched_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert load_extension() is None
    assert not quantized_kernels_available(torch.device("cpu"), torch.float32)


@pytest.mark.usefixtures("fresh_extension_cache")
def test_failed_build_warns_once_and_goes_dense(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_compiler(*args: object, **kwargs: object) -> ModuleType:
        raise RuntimeError("no C++ compiler")

    monkeypatch.delenv(ENV_SWITCH, raising=False)
    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compiler)
    with caplog.at_level(logging.WARNING, logger=gguf_linear.__name__):
        assert not quantized_kernels_available(torch.device("cpu"), torch.float32)
        assert not quantized_kernels_available(torch.device("cpu"), torch.float32)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_only_cpu_fp32_gets_quantized_copies(ext: ModuleType) -> None:
    assert quantized_kernels_available(torch.device("cpu"), torch.float32)
    assert not quantized_kernels_available(torch.device("cpu"), torch.bfloat16)
    assert not quantized_kernels_available(torch.device("cuda"), torch.float32)


@pytest.mark.slow  # loads SmolLM2 twice
def test_smollm2_quantized_copies_match_dense_weights(ext: ModuleType) -> None:
    """The loader's blocks, Q/K rows unpermuted and fused, are the dense weights exactly."""
    from gpu_worker.loader import load_model
    from shared.model_source import ModelNotFoundError, resolve_model

    try:
        source = resolve_model("SmolLM2-135M-Instruct")
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    model, config = load_model(source, torch.device("cpu"))
    layers = model.model.layers
    for layer in (layers[0], layers[config.num_layers - 1]):
        for linear in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        ):
            assert linear.quantized is not None
            assert torch.equal(linear.quantized.dequantize(), linear.weight)
    head = model.logits_head.quantized
    assert head is not None
    assert head.qtype == int(gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(head.dequantize(), model.model.embed_tokens.weight)
    hidden = torch.randn(3, config.hidden_size)
    torch.testing.assert_close(
        model.compute_logits(hidden),
        F.linear(hidden, model.model.embed_tokens.weight),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.slow  # two SmolLM2 engines
def test_engine_flag_keeps_dense_weights_with_the_same_tokens(ext: ModuleType) -> None:
    """`gpu-worker --no-cpu-gguf-kernels` (cpu_gguf_kernels=False) attaches no blocks; the
    greedy tokens are the kernel path's."""
    from gpu_worker import Engine
    from shared.sampling import SamplingParams

    prompts = [[1, 9690, 198, 2683, 314, 260, 3575, 282, 4649, 47, 2, 198], [1, 520, 9531, 198]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for enabled in (True, False):
        engine = Engine(device="cpu", cpu_gguf_kernels=enabled, kv_cache_memory_gb=0.05)
        linears = [m for m in engine.model.modules() if isinstance(m, Linear)]
        assert all((m.quantized is not None) is enabled for m in linears)
        tokens[enabled] = [c.token_ids for c in engine.generate(prompts, params)]
    assert tokens[True] == tokens[False]
