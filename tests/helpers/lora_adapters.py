"""Random PEFT LoRA adapters written by PEFT itself: the reference the worker's adapters
are checked against (`peft` is in the test extra).

PEFT files an adapter's tensors by its name within their names: a name that is part of a
module's (e.g. "mlp") takes the other adapters' tensors on save. Use names like "alpha".
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from gpu_worker.lora.adapter import target_shapes
from gpu_worker.models.config import ModelConfig

if TYPE_CHECKING:  # peft and transformers are imported where used: a GPU check may lack them
    import transformers
    from peft import PeftModel


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    """A random PEFT adapter: its rank, alpha and targets."""

    rank: int
    alpha: int
    targets: tuple[str, ...]
    use_rslora: bool = False
    seed: int = 0


def add_peft_adapters(
    hf: transformers.PreTrainedModel, specs: Mapping[str, AdapterSpec], out: Path
) -> PeftModel:
    """`hf` wrapped by PEFT with one adapter per spec, saved by PEFT to `out/<name>`.
    `init_lora_weights=False` draws B at random too (PEFT's default zeroes it)."""
    from peft import LoraConfig, get_peft_model

    model: PeftModel | None = None
    for name, spec in specs.items():
        config = LoraConfig(
            r=spec.rank,
            lora_alpha=spec.alpha,
            target_modules=list(spec.targets),
            init_lora_weights=False,
            use_rslora=spec.use_rslora,
        )
        torch.manual_seed(spec.seed)
        if model is None:
            model = get_peft_model(hf, config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    assert model is not None
    model.save_pretrained(str(out), selected_adapters=list(specs))
    return model.eval()


def write_random_adapter(out: Path, config: ModelConfig, spec: AdapterSpec) -> Path:
    """A PEFT-format adapter of `spec` for a model of `config`, written without PEFT (for
    the GPU checks, which run without it): A and B drawn at random with `spec.seed`."""
    out.mkdir(parents=True, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "target_modules": list(spec.targets),
        "use_rslora": spec.use_rslora,
        "bias": "none",
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config))
    gen = torch.Generator().manual_seed(spec.seed)
    tensors: dict[str, torch.Tensor] = {}
    for (layer, target), (in_features, out_features) in target_shapes(config).items():
        if target not in spec.targets:
            continue
        block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        name = f"base_model.model.model.layers.{layer}.{block}.{target}"
        tensors[f"{name}.lora_A.weight"] = torch.randn(spec.rank, in_features, generator=gen) / 8
        tensors[f"{name}.lora_B.weight"] = torch.randn(out_features, spec.rank, generator=gen) / 8
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out
