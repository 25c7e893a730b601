"""The transformers side of bench/engine.py: the same GGUF file through `generate` on
static left-padded batches."""

from __future__ import annotations

import logging
from typing import Any

import torch

from bench.common.timing import Clock
from bench.common.workload import Workload
from shared.model_source import ModelSource

PAD_TOKEN_ID = 2  # SmolLM2's <|im_end|>; pads are masked out, so any id would do


def hf_generate(model: Any, prompts: list[list[int]], new_tokens: int) -> None:
    """One static batch: left-pad, then decode exactly `new_tokens` for every row."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[PAD_TOKEN_ID] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # with max_new_tokens: EOS never ends a row early
            do_sample=False,
            pad_token_id=PAD_TOKEN_ID,
        )
    assert out.shape[1] == width + new_tokens


def run_hf(model: Any, work: Workload, batch_size: int) -> Clock:
    """The workload in static batches of `batch_size`, each decoding to its longest output."""

    def run() -> None:
        for i in range(0, len(work.prompts), batch_size):
            batch = work.prompts[i : i + batch_size]
            hf_generate(model, batch, max(work.output_lens[i : i + batch_size]))

    return Clock.measure(run)


def load_hf(source: ModelSource, dtype: torch.dtype) -> Any:
    """The model dequantized from its GGUF file, with its first-call costs paid."""
    from transformers import AutoModelForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    model = AutoModelForCausalLM.from_pretrained(
        str(source.path.parent), gguf_file=source.path.name, dtype=dtype
    )
    model = model.eval()
    hf_generate(model, [[100 + i for i in range(120)]] * 4, 8)  # first-call costs
    return model
