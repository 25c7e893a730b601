"""RMSNorm and fused add + RMSNorm against their references and the model's RMSNorm."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.models.llama import RMSNorm
from kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from tests.helpers.kernel_checks import ELEMENTWISE_TOL, random_tensor

EPS = 1e-5


def _assert_close(actual, expected, dtype):
    atol, rtol = ELEMENTWISE_TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize(("num_tokens", "hidden"), [(1, 576), (7, 100), (3, 4096)])
def test_rms_norm_matches_reference(device, dtype, num_tokens, hidden):
    x = random_tensor(num_tokens, hidden, dtype=dtype, device=device)
    weight = 1 + 0.2 * random_tensor(hidden, dtype=dtype, device=device, seed=2)
    out = rms_norm(x, weight, EPS)
    assert out.dtype == dtype
    assert out.shape == x.shape
    _assert_close(out, rms_norm_ref(x, weight, EPS), dtype)


def test_rms_norm_matches_model_module(device, dtype):
    module = RMSNorm(576, EPS).to(device=device, dtype=dtype)
    with torch.no_grad():
        module.weight.copy_(1 + 0.2 * random_tensor(576, dtype=dtype, device=device, seed=2))
    x = random_tensor(2, 3, 576, dtype=dtype, device=device)  # leading dims are flattened
    with torch.no_grad():
        _assert_close(rms_norm(x, module.weight, EPS), module(x), dtype)


def test_rms_norm_promotes_to_weight_dtype(device):
    """fp16 activations with an fp32 weight give fp32, as `weight * h` does in torch."""
    x = random_tensor(3, 64, dtype=torch.float16, device=device)
    weight = random_tensor(64, dtype=torch.float32, device=device, seed=2)
    out = rms_norm(x, weight, EPS)
    assert out.dtype == torch.float32
    _assert_close(out, rms_norm_ref(x, weight, EPS), torch.float16)


@pytest.mark.parametrize(("num_tokens", "hidden"), [(1, 576), (5, 130)])
def test_fused_add_rms_norm_matches_reference(device, dtype, num_tokens, hidden):
    x = random_tensor(num_tokens, hidden, dtype=dtype, device=device)
    residual = random_tensor(num_tokens, hidden, dtype=dtype, device=device, seed=3)
    weight = 1 + 0.2 * random_tensor(hidden, dtype=dtype, device=device, seed=2)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    expected_out, expected_residual = fused_add_rms_norm_ref(x, residual, weight, EPS)
    assert torch.equal(new_residual, expected_residual)  # one rounding of the sum, like torch
    _assert_close(out, expected_out, dtype)
    assert torch.equal(x, x_before)
    assert torch.equal(residual, residual_before)
