"""silu_and_mul against its reference (the model MLP's `F.silu(gate) * up`)."""

from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_and_mul, silu_and_mul_ref
from tests.helpers.kernel_checks import ELEMENTWISE_TOL, random_tensor


@pytest.mark.parametrize(("num_tokens", "inner"), [(1, 64), (3, 100), (2, 1536)])
def test_silu_and_mul_matches_reference(device, dtype, num_tokens, inner):
    x = 3 * random_tensor(num_tokens, 2 * inner, dtype=dtype, device=device)
    out = silu_and_mul(x)
    assert out.shape == (num_tokens, inner)
    assert out.dtype == dtype
    atol, rtol = ELEMENTWISE_TOL[dtype]
    torch.testing.assert_close(out.float(), silu_and_mul_ref(x).float(), atol=atol, rtol=rtol)


def test_silu_and_mul_gate_is_the_first_half(device):
    """Swapping the halves must change the answer: the gate goes through silu, up does not."""
    gate = torch.full((1, 4), -2.0, device=device)
    up = torch.full((1, 4), 3.0, device=device)
    out = silu_and_mul(torch.cat([gate, up], dim=-1))
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(out, expected)
