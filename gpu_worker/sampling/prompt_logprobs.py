"""Prompt logprobs: how likely the model found each prompt token, scored in the prefill pass.

The logits at prompt position p score prompt token p + 1, so a request's chunk of prompt
rows gives the logprobs of the tokens right after them. Like the sampler's logprobs they
are raw: log_softmax of the model's logits, before any sampling parameter. Rows are scored
in slices of `SLICE_ROWS`, so a 2048-token chunk never holds its [2048, vocab] logits (and
their log_softmax) at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpu_worker.sampling.upload import upload
from shared.protocol import TokenLogprobs

SLICE_ROWS = 256


def score_prompt_rows(
    hidden: torch.Tensor,
    target_ids: list[int],
    num_top: list[int],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
) -> list[TokenLogprobs]:
    """Row i of `hidden` scores `target_ids[i]`: its logprob, its rank (1 = most likely)
    and the `num_top[i]` most likely tokens at that position."""
    k = max(num_top, default=0)
    entries: list[TokenLogprobs] = []
    for start in range(0, hidden.shape[0], SLICE_ROWS):
        end = min(start + SLICE_ROWS, hidden.shape[0])
        logits = compute_logits(hidden[start:end])[:, :vocab_size]
        raw = torch.log_softmax(logits.to(torch.float32), dim=-1)
        targets = upload(target_ids[start:end], torch.long, raw.device)
        chosen = raw.gather(1, targets[:, None])
        ranks = ((raw > chosen).sum(dim=-1) + 1).tolist()
        logprobs = chosen.squeeze(1).tolist()
        top_ids: list[list[int]] = [[] for _ in logprobs]
        top_logprobs: list[list[float]] = [[] for _ in logprobs]
        if k:
            top = torch.topk(raw, k, dim=-1)
            top_ids, top_logprobs = top.indices.tolist(), top.values.tolist()
        for i, row in enumerate(range(start, end)):
            n = num_top[row]
            entries.append(
                TokenLogprobs(logprobs[i], ranks[i], top_ids[i][:n], top_logprobs[i][:n])
            )
    return entries


def record_prompt_logprobs(
    gathered: list[TokenLogprobs | None], first_position: int, entries: list[TokenLogprobs]
) -> None:
    """Store the entries of positions `first_position`.. (scoring prompt tokens
    `first_position + 1`..) in a request's list, index = prompt token. A recompute after
    preemption scores positions again from 0: what it covers is replaced."""
    del gathered[first_position + 1 :]
    gathered.extend(entries)
