"""OpenAI's `logit_bias`: a bias added to chosen tokens' logits, row by row."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpu_worker.sampling.upload import upload
from shared.sampling import SamplingParams


def add_logit_bias(x: torch.Tensor, params: Sequence[SamplingParams], vocab_size: int) -> None:
    """Add row i's `params[i].logit_bias` to `x` ([m, vocab], in place), in one scatter.
    Ids past the model's vocabulary are skipped: the render tier checks ids against the
    tokenizer, whose vocabulary may be larger than a model's logits."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for row, sampling in enumerate(params):
        for token_id, bias in (sampling.logit_bias or {}).items():
            if 0 <= token_id < vocab_size:
                rows.append(row)
                cols.append(token_id)
                values.append(bias)
    if rows:
        index = (upload(rows, torch.long, x.device), upload(cols, torch.long, x.device))
        x.index_put_(index, upload(values, torch.float32, x.device), accumulate=True)
