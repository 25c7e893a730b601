"""A step's prompt logprobs: its prompt rows scored and kept by each sequence until its
first delta carries them (the scoring itself: gpu_worker.sampling.prompt_logprobs)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpu_worker.core.scheduler import ScheduledSequence
from gpu_worker.sampling.prompt_logprobs import record_prompt_logprobs, score_prompt_rows


def score_step_prompts(
    scheduled: list[ScheduledSequence],
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
) -> None:
    """Score this step's prompt-logprob rows (the runner's `prompt_hidden`, in batch
    order) into each sequence's sampler state."""
    items = [(item, item.prompt_logprob_positions) for item in scheduled]
    items = [(item, positions) for item, positions in items if positions]
    targets: list[int] = []
    num_top: list[int] = []
    for item, positions in items:
        targets.extend(item.seq.all_token_ids[positions.start + 1 : positions.stop + 1])
        num_top.extend([item.seq.sampling.prompt_logprobs or 0] * len(positions))
    entries = score_prompt_rows(hidden, targets, num_top, compute_logits, vocab_size)
    start = 0
    for item, positions in items:
        gathered = item.seq.sampler_state.prompt_logprobs
        assert gathered is not None, "new_sampler_state starts it for such requests"
        record_prompt_logprobs(gathered, positions.start, entries[start : start + len(positions)])
        start += len(positions)
