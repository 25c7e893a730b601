"""TritonLayerOps equals TorchLayerOps, op for op, on the shapes the model hands them."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.ops.layer_ops import TorchLayerOps, TritonLayerOps, get_layer_ops
from tests.helpers.kernel_checks import ELEMENTWISE_TOL, interpreter_only, random_tensor

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 96, 6, 2, 16


@pytest.fixture(scope="module")
def ops() -> tuple[TorchLayerOps, TritonLayerOps]:
    return TorchLayerOps(), TritonLayerOps()


@pytest.mark.parametrize("tokens", [1, 7])
def test_norms(ops, tokens: int, dtype: torch.dtype, device: torch.device) -> None:
    torch_ops, triton_ops = ops
    atol, rtol = ELEMENTWISE_TOL[dtype]
    x = random_tensor(tokens, HIDDEN, dtype=dtype, device=device, seed=1)
    residual = random_tensor(tokens, HIDDEN, dtype=dtype, device=device, seed=2)
    weight = 1 + 0.1 * random_tensor(HIDDEN, dtype=dtype, device=device, seed=3)
    plain = triton_ops.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(plain, torch_ops.rms_norm(x, weight, 1e-5), atol=atol, rtol=rtol)
    got, got_residual = triton_ops.add_rms_norm(x, residual, weight, 1e-5)
    want, want_residual = torch_ops.add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(got_residual, want_residual, atol=atol, rtol=rtol)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("tokens", [1, 5])
def test_rotate_views_of_a_fused_qkv(ops, tokens: int, dtype: torch.dtype, device) -> None:
    torch_ops, triton_ops = ops
    atol, rtol = ELEMENTWISE_TOL[dtype]
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = random_tensor(tokens, width, dtype=dtype, device=device, seed=4)
    qk = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, HEADS + KV_HEADS, HEAD_DIM)
    positions = torch.tensor([3, 70, 0, 511, 12][:tokens], device=device)
    angles = torch.outer(torch.arange(512.0), 1.0 / 10000 ** (torch.arange(0, 16, 2) / 16))
    cos_cache = torch.cat((angles.cos(), angles.cos()), dim=-1).to(device)
    sin_cache = torch.cat((-angles.sin(), angles.sin()), dim=-1).to(device)
    got = triton_ops.rotate(qk, HEADS, triton_ops.rotary_tables(positions, cos_cache, sin_cache))
    want = torch_ops.rotate(qk, HEADS, torch_ops.rotary_tables(positions, cos_cache, sin_cache))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol)


def test_silu_and_mul(ops, dtype: torch.dtype, device: torch.device) -> None:
    torch_ops, triton_ops = ops
    atol, rtol = ELEMENTWISE_TOL[dtype]
    gate_up = random_tensor(3, 2 * HIDDEN, dtype=dtype, device=device, seed=5)
    torch.testing.assert_close(
        triton_ops.silu_and_mul(gate_up), torch_ops.silu_and_mul(gate_up), atol=atol, rtol=rtol
    )


def test_ops_follow_the_attention_backend() -> None:
    assert isinstance(get_layer_ops("triton"), TritonLayerOps)
    assert isinstance(get_layer_ops("torch"), TorchLayerOps)


@interpreter_only
def test_engine_on_triton_backend_and_ops_equals_torch(tiny_llama_dir) -> None:
    """The whole model, prefill and decode steps, on Triton attention + Triton layer ops
    gives the torch path's greedy tokens and first-step logits."""
    import random

    from gpu_worker import Engine
    from shared.sampling import SamplingParams

    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 23, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    results = {}
    for backend in ("torch", "triton"):
        engine = Engine(
            model=str(tiny_llama_dir),
            device="cpu",
            attention_backend=backend,
            max_model_len=96,
            kv_cache_memory_gb=0.01,
        )
        assert isinstance(
            engine.model.ops, TritonLayerOps if backend == "triton" else TorchLayerOps
        )
        results[backend] = engine.generate(prompts, params)
    for ours, ref in zip(results["triton"], results["torch"], strict=True):
        assert ours.token_ids == ref.token_ids
        for a, b in zip(ours.logprobs, ref.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-4
