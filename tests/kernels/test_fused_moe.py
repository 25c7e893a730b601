"""fused_moe (grouped GEMMs over expert-sorted tokens) against its plain torch reference,
and the model's torch path (`moe_experts`) against the same reference."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.ops.layer_ops import moe_experts
from kernels.fused_moe import fused_moe, fused_moe_ref, moe_align_block_size
from tests.helpers.kernel_checks import random_tensor

# The reference rounds at other places than the kernel (fp16/bf16 matmul outputs).
MOE_TOL = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (6e-2, 6e-2),
}


def _routing(
    num_tokens: int, num_experts: int, top_k: int, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Skewed routing: expert 0 takes most tokens and the last expert none at all."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:, 0] += 2.0
    logits[:, -1] = -1e4
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return weights.to(device), ids.to(device)


def _experts(num_experts: int, inner: int, hidden: int, dtype, device, seed: int = 2):
    w13 = random_tensor(num_experts, 2 * inner, hidden, dtype=dtype, device=device, seed=seed)
    w2 = random_tensor(num_experts, hidden, inner, dtype=dtype, device=device, seed=seed + 1)
    return 0.2 * w13, 0.2 * w2


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "hidden", "inner"),
    [(5, 4, 2, 32, 16), (19, 8, 2, 48, 40), (3, 8, 1, 32, 16)],
    ids=["4x2", "8x2-odd-dims", "8x1-decode"],
)
def test_fused_moe_matches_reference(device, dtype, num_tokens, num_experts, top_k, hidden, inner):
    x = random_tensor(num_tokens, hidden, dtype=dtype, device=device)
    w13, w2 = _experts(num_experts, inner, hidden, dtype, device)
    weights, ids = _routing(num_tokens, num_experts, top_k, device, seed=num_tokens)
    assert torch.bincount(ids.flatten(), minlength=num_experts)[-1] == 0  # an idle expert
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.shape == x.shape
    assert out.dtype == dtype
    expected = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
    atol, rtol = MOE_TOL[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


def test_align_pads_each_expert_to_whole_blocks() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [2, 0]])  # expert 3 idle, expert 2 thrice
    sorted_ids, block_expert = moe_align_block_size(ids, 4, 4)
    pad = ids.numel()
    assert block_expert.tolist()[:3] == [0, 1, 2]
    assert set(block_expert.tolist()[3:]) == {-1}
    assert sorted_ids[:12].tolist() == [1, 5, pad, pad, 3, pad, pad, pad, 0, 2, 4, pad]


@pytest.mark.parametrize("top_k", [1, 2])
def test_torch_moe_experts_match_reference(top_k: int) -> None:
    """The CPU model's grouped torch path (one matmul pair per expert with tokens)."""
    cpu = torch.device("cpu")
    x = random_tensor(23, 32, dtype=torch.float32, device=cpu)
    w13, w2 = _experts(6, 24, 32, torch.float32, cpu)
    weights, ids = _routing(23, 6, top_k, cpu, seed=3)
    expected = fused_moe_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(moe_experts(x, w13, w2, weights, ids), expected)
