"""Prompt logprobs: how likely the model found each prompt token, scored in the prefill pass.

The logits at prompt position p score prompt token p + 1, so a request's chunk of prompt
rows gives the logprobs of the tokens right after them. Like the sampler's logprobs they
are raw: log_softmax of the model's logits, before any sampling parameter. Rows are scored
in slices of `SLICE_ROWS`, so a 2048-token chunk never holds its [2048, vocab] logits (and
their log_softmax) at once.

Under tensor parallelism each slice's logits are a gather over the ranks: rank 0 scores
(`score_prompt_rows`) while every other rank joins the same gathers over the same slices
(`follow_prompt_scoring`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from gpu_worker.sampling.upload import upload
from shared.protocol import TokenLogprobs

SLICE_ROWS = 256


def prompt_row_slices(num_rows: int) -> Iterator[slice]:
    """The slices of a step's prompt rows that are scored together."""
    for start in range(0, num_rows, SLICE_ROWS):
        yield slice(start, min(start + SLICE_ROWS, num_rows))


def follow_prompt_scoring(
    hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """A TP follower's part of `score_prompt_rows` over the same `hidden` rows: the logits
    of each slice (its share of rank 0's gathers), nothing scored."""
    for rows in prompt_row_slices(hidden.shape[0]):
        compute_logits(hidden[rows])


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
    for rows in prompt_row_slices(hidden.shape[0]):
        logits = compute_logits(hidden[rows])[:, :vocab_size]
        raw = torch.log_softmax(logits.to(torch.float32), dim=-1)
        targets = upload(target_ids[rows], torch.long, raw.device)
        chosen = raw.gather(1, targets[:, None])
        ranks = ((raw > chosen).sum(dim=-1) + 1).tolist()
        logprobs = chosen.squeeze(1).tolist()
        top_ids: list[list[int]] = [[] for _ in logprobs]
        top_logprobs: list[list[float]] = [[] for _ in logprobs]
        if k:
            top = torch.topk(raw, k, dim=-1)
            top_ids, top_logprobs = top.indices.tolist(), top.values.tolist()
        for i, row in enumerate(range(rows.start, rows.stop)):
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
