"""Random PEFT LoRA adapters written by PEFT itself: the reference the worker's adapters
are checked against (`peft` is in the test extra).

PEFT files an adapter's tensors by its name within their names: a name that is part of a
module's (e.g. "mlp") takes the other adapters' tensors on save. Use names like "alpha".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model


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
