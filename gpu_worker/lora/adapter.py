"""PEFT LoRA adapters: read, checked against the base model, held as fp32 (A, B) pairs.

A PEFT adapter directory holds `adapter_config.json` and `adapter_model.safetensors`, whose
tensors are named after the HF modules they adapt
(`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`, `.default` before
`.weight` in some versions). PEFT computes `base(x) + scale * B(A(x))` with A `[r, in]`,
B `[out, r]` and `scale = lora_alpha / r` (`/ sqrt(r)` with rsLoRA); dropout is off at
inference. The tensors say which modules are adapted; the config's `target_modules` only
has to name modules this worker can adapt. What the batched path cannot reproduce (biases,
DoRA, per-module ranks, saved modules, embeddings, the LM head, MoE experts) is refused with
a 400 naming it rather than served wrong.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from gpu_worker.lora.paths import ADAPTER_CONFIG, ADAPTER_WEIGHTS, InvalidLoRAError
from gpu_worker.models.config import ModelConfig

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The HF/PEFT module names an adapter may target."""

_ATTENTION_TARGETS = frozenset(LORA_TARGETS[:4])

LoRAKey = tuple[int, str]
"""(decoder layer index, target module name)."""

TargetShapes = Mapping[LoRAKey, tuple[int, int]]
"""Each adaptable (layer, target) -> its (in, out) features."""

_TENSOR = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)
_MODULE_OF_TENSOR = re.compile(r"^base_model\.model\.(.+?)\.lora_")

# Config fields that change the math when set (`True`, a non-empty list or dict): refused.
_UNSUPPORTED = {
    "use_dora": "DoRA",
    "lora_bias": "a LoRA bias",
    "fan_in_fan_out": "fan_in_fan_out",
    "modules_to_save": "modules_to_save",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "trainable_token_indices": "trainable tokens",
    "layer_replication": "layer replication",
    # Newer PEFT variants that change the forward pass, not only the initialisation.
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "arrow_config": "Arrow routing",
    "use_qalora": "QALoRA",
    "use_bdlora": "block-diagonal LoRA",
    "kasa_config": "KaSA",
    "monteclora_config": "MonteCLoRA",
}


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter in the worker's memory, ready to copy into a slot."""

    name: str
    rank: int
    scale: float
    """lora_alpha / rank, or lora_alpha / sqrt(rank) with rsLoRA."""
    target_modules: frozenset[str]
    """The LORA_TARGETS it adapts in at least one layer."""
    weights: Mapping[LoRAKey, tuple[torch.Tensor, torch.Tensor]]
    """(layer, target) -> (A [rank, in], B [out, rank]), fp32 on the CPU."""


def target_shapes(config: ModelConfig) -> dict[LoRAKey, tuple[int, int]]:
    """Every (layer, target) a model of `config` can adapt, with its (in, out) features.
    The MLP targets of MoE layers are absent: adapters of experts are not supported."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inner = config.hidden_size, config.intermediate_size
    per_target = {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inner),
        "up_proj": (hidden, inner),
        "down_proj": (inner, hidden),
    }
    shapes: dict[LoRAKey, tuple[int, int]] = {}
    for layer in range(config.num_layers):
        moe = config.num_experts > 0 and config.is_moe_layer(layer)
        for target, shape in per_target.items():
            if target in _ATTENTION_TARGETS or not moe:
                shapes[(layer, target)] = shape
    return shapes


def load_peft_adapter(
    name: str, adapter_dir: Path, model_config: ModelConfig, max_lora_rank: int
) -> LoRAAdapter:
    """Read and check the PEFT adapter in `adapter_dir` (a directory `resolve_adapter_dir`
    returned) for a model of `model_config`; an `InvalidLoRAError` names what is wrong."""
    config = _read_config(adapter_dir / ADAPTER_CONFIG)
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise InvalidLoRAError("adapter_config.json: r must be a positive integer")
    if rank > max_lora_rank:
        raise InvalidLoRAError(f"the adapter's rank {rank} exceeds --max-lora-rank {max_lora_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise InvalidLoRAError("adapter_config.json: lora_alpha must be a number")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = _read_weights(adapter_dir / ADAPTER_WEIGHTS, rank, target_shapes(model_config))
    return LoRAAdapter(
        name=name,
        rank=rank,
        scale=float(scale),
        target_modules=frozenset(target for _, target in weights),
        weights=weights,
    )


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        # The decoder's message quotes the file: say only that it is not JSON.
        raise InvalidLoRAError("adapter_config.json is not a readable JSON file") from None
    if not isinstance(config, dict):
        raise InvalidLoRAError("adapter_config.json is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise InvalidLoRAError("adapter_config.json: only LoRA adapters (peft_type LORA) load")
    if config.get("bias", "none") != "none":
        raise InvalidLoRAError("adapter_config.json: only bias 'none' is supported")
    for field, what in _UNSUPPORTED.items():
        if config.get(field):
            raise InvalidLoRAError(f"adapter_config.json: {what} is not supported")
    _check_targets(config.get("target_modules"))
    return config


def _check_targets(targets: object) -> None:
    """A list must name LORA_TARGETS (or paths ending in one); a string is PEFT's regex over
    module paths, which the tensors' names then decide."""
    if isinstance(targets, str):
        return
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise InvalidLoRAError("adapter_config.json: target_modules must be a list or a string")
    for target in targets:
        if target.rsplit(".", 1)[-1] not in LORA_TARGETS:
            raise InvalidLoRAError(
                f"adapter_config.json: target module {target!r} is not supported "
                f"(supported: {', '.join(LORA_TARGETS)})"
            )


def _read_weights(
    path: Path, rank: int, shapes: TargetShapes
) -> dict[LoRAKey, tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[tuple[int, str, str], torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt", device="cpu") as tensors:
            for tensor_name in tensors.keys():  # noqa: SIM118 (safe_open is not iterable)
                layer, target, half = _parse_name(tensor_name)
                halves[(layer, target, half)] = tensors.get_tensor(tensor_name)
    except (SafetensorError, OSError):
        # Its message may quote the header: say only that the file is not safetensors.
        raise InvalidLoRAError(
            "adapter_model.safetensors is not a valid safetensors file"
        ) from None
    weights: dict[LoRAKey, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer, target, half in halves:
        if half == "B":
            continue
        b = halves.get((layer, target, "B"))
        if b is None:
            raise InvalidLoRAError(f"layer {layer} {target}: lora_A without lora_B")
        weights[(layer, target)] = _checked_pair(
            layer, target, halves[(layer, target, "A")], b, rank, shapes
        )
    if len(weights) * 2 != len(halves):
        raise InvalidLoRAError("adapter_model.safetensors: a lora_B without its lora_A")
    if not weights:
        raise InvalidLoRAError("adapter_model.safetensors holds no LoRA weights")
    return weights


def _parse_name(tensor_name: str) -> tuple[int, str, str]:
    """(layer, target, "A" | "B") of a PEFT tensor name, or the 400 naming its module."""
    match = _TENSOR.match(tensor_name)
    if match is not None:
        layer, block, target, half = match.groups()
        expected_block = "self_attn" if target in _ATTENTION_TARGETS else "mlp"
        if target in LORA_TARGETS and block == expected_block:
            return int(layer), target, half
    module = _MODULE_OF_TENSOR.match(tensor_name)
    shown = module.group(1) if module is not None else tensor_name
    raise InvalidLoRAError(f"LoRA on module {shown!r} is not supported")


def _checked_pair(
    layer: int, target: str, a: torch.Tensor, b: torch.Tensor, rank: int, shapes: TargetShapes
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = shapes.get((layer, target))
    if shape is None:
        raise InvalidLoRAError(f"layer {layer} {target}: no such projection in the base model")
    in_features, out_features = shape
    if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
        raise InvalidLoRAError(
            f"layer {layer} {target}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
            f"do not fit the model ({rank}, {in_features}) and ({out_features}, {rank})"
        )
    if not (a.is_floating_point() and b.is_floating_point()):
        raise InvalidLoRAError(f"layer {layer} {target}: LoRA weights must be floating point")
    a, b = a.float(), b.float()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise InvalidLoRAError(f"layer {layer} {target}: LoRA weights hold inf or NaN")
    return a, b
