"""The sparse mixture-of-experts feed-forward block that Mixtral and Qwen3-MoE share.

A router picks each token's top-k experts from a softmax over its logits; each expert is a
SwiGLU MLP. The experts' weights are stacked, `[experts, 2 * inner, hidden]` for gate/up
(gate rows first, like `MLP.gate_up_proj`) and `[experts, hidden, inner]` for down, which is
both transformers 5's in-memory layout and what the grouped kernels read. The arithmetic is
the layer ops' `fused_moe` (torch: a matmul pair per expert with tokens; Triton:
kernels/fused_moe.py).

Checkpoints store one matrix per expert (`mlp.experts.3.gate_proj.weight`) or, in a GGUF
file, one per projection for all experts; `stack_expert_weights` turns either into the
stacked tensors as they stream past, holding at most one layer's stack at a time.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from gpu_worker.models.config import ModelConfig
from gpu_worker.models.llama import MLP
from gpu_worker.ops.layer_ops import LayerOps


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits `[tokens, experts]` -> fp32 weights and expert ids `[tokens, top_k]`:
    top-k of the fp32 softmax, rescaled to sum to one if `renormalize` (transformers'
    MixtralTopKRouter always, Qwen3MoeTopKRouter by `norm_topk_prob`)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Experts(nn.Module):
    """The stacked SwiGLU weights of every expert of one layer."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        num, inner, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(num, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(num, hidden, inner))


class SparseMoeBlock(nn.Module):
    """Router (`gate`, HF's name) plus experts; a drop-in for `MLP` in a decoder layer."""

    def __init__(self, config: ModelConfig, ops: LayerOps) -> None:
        super().__init__()
        self.ops = ops
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Logits in the model dtype, softmax in fp32: transformers' rounding.
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        return self.ops.fused_moe(
            x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids
        )


def moe_or_dense_mlp(config: ModelConfig, ops: LayerOps, layer: int) -> nn.Module:
    """`LlamaForCausalLM.build_mlp` for MoE families: experts where the config says so."""
    return SparseMoeBlock(config, ops) if config.is_moe_layer(layer) else MLP(config, ops)


_EXPERT_TENSOR = re.compile(r"^(.*\.experts)(?:\.(\d+))?\.(gate_proj|up_proj|down_proj)\.weight$")


class _LayerStack:
    """One layer's stacked expert tensors, filled as the checkpoint's parts arrive."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.gate_up: torch.Tensor | None = None
        self.down: torch.Tensor | None = None
        self.missing = {
            (part, e) for part in ("gate_proj", "up_proj", "down_proj") for e in range(num_experts)
        }

    def add(self, part: str, expert: int | None, tensor: torch.Tensor) -> None:
        """Copy one expert's matrix (`expert` given) or all experts' (`[experts, ...]`)."""
        experts = range(self.num_experts) if expert is None else [expert]
        keys = {(part, e) for e in experts}
        if not keys <= self.missing:
            raise ValueError(f"expert tensor {part} {expert} given twice or out of range")
        self.missing -= keys
        rows, cols = tensor.shape[-2:]
        if part == "down_proj":
            if self.down is None:
                self.down = tensor.new_empty((self.num_experts, rows, cols))
            target = self.down
        else:
            if self.gate_up is None:
                self.gate_up = tensor.new_empty((self.num_experts, 2 * rows, cols))
            # Gate rows first, then up: the layout `MLP.gate_up_proj` and the kernels use.
            half = slice(0, rows) if part == "gate_proj" else slice(rows, 2 * rows)
            target = self.gate_up[:, half]
        if expert is None:
            target.copy_(tensor)
        else:
            target[expert].copy_(tensor)


def stack_expert_weights(
    weights: Iterable[tuple[str, torch.Tensor]], num_experts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass the checkpoint through, with each layer's expert matrices replaced by the two
    stacked tensors `{prefix}.experts.gate_up_proj` and `.down_proj`, yielded once the
    layer is complete. Expert names are `{prefix}.experts.{e}.{gate,up,down}_proj.weight`
    (one expert) or `{prefix}.experts.{gate,up,down}_proj.weight` (`[experts, ...]`)."""
    pending: dict[str, _LayerStack] = {}
    for name, tensor in weights:
        match = _EXPERT_TENSOR.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, expert, part = match.groups()
        stack = pending.setdefault(prefix, _LayerStack(num_experts))
        stack.add(part, None if expert is None else int(expert), tensor)
        if not stack.missing:
            del pending[prefix]
            assert stack.gate_up is not None and stack.down is not None
            yield f"{prefix}.gate_up_proj", stack.gate_up
            yield f"{prefix}.down_proj", stack.down
    for prefix, stack in pending.items():
        some = sorted(stack.missing)[:4]
        raise ValueError(
            f"checkpoint lacks {len(stack.missing)} expert tensors of {prefix}: {some}"
        )
