"""The sampling half of the profiling run (`gpu_worker.runner.profiling`): after each dummy
forward, the costliest work a real step can do with its hidden states and logits, so that
its memory is in the measured peak. It lives with the engine because the runner sits below
the sampler.

Every dummy request asks for every option that allocates: repetition, frequency and
presence penalties (per-row vocabulary counts and prompt masks), min-p and a top-p the
candidate set cannot satisfy (the full-vocabulary sort), the most logprobs, and a seed on
every other row (seeded draws); the step also scores a full slice of prompt logprobs.
A TP follower, which neither samples nor scores, joins that slice's logits gather
(`follow_profile_scoring`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpu_worker.core.sequence import Sequence
from gpu_worker.runner.profiling import PostForward
from gpu_worker.sampling.prompt_logprobs import (
    SLICE_ROWS,
    follow_prompt_scoring,
    score_prompt_rows,
)
from gpu_worker.sampling.sampler import Sampler, SamplingRequest, new_sampler_state
from shared.sampling import MAX_LOGPROBS, SamplingParams


def costliest_params(row: int) -> SamplingParams:
    """The sampling options of dummy row `row` (seeded on odd rows). The high temperature
    flattens whatever logits the dummy forward gives, so the nucleus overruns the candidate
    set and every row takes the full-vocabulary sort, the sampler's largest allocation."""
    return SamplingParams(
        temperature=100.0,
        top_p=0.999,
        min_p=0.001,
        repetition_penalty=1.1,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        logprobs=MAX_LOGPROBS,
        seed=row if row % 2 else None,
    )


def profile_sampling(
    sampler: Sampler,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
    block_size: int,
) -> PostForward:
    """The `PostForward` of the profiling run: prompt logprobs over a slice of the step's
    rows, then `sampler` over the sampling rows with `costliest_params`; the dummy requests'
    rows are released after."""

    def run(logits: torch.Tensor, hidden: torch.Tensor) -> None:
        rows = min(hidden.shape[0], SLICE_ROWS)
        score_prompt_rows(
            hidden[:rows], [0] * rows, [MAX_LOGPROBS] * rows, compute_logits, vocab_size
        )
        requests: list[SamplingRequest] = [
            _request(row, vocab_size, block_size) for row in range(len(logits))
        ]
        sampler.sample(logits, requests)
        sampler.release([seq.request_id for seq in requests])

    return run


def follow_profile_scoring(compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> PostForward:
    """A TP follower's `PostForward`: its part of rank 0's prompt-logprob slice
    (`profile_sampling`), the one collective after the forward."""

    def run(logits: torch.Tensor, hidden: torch.Tensor) -> None:
        follow_prompt_scoring(hidden[: min(hidden.shape[0], SLICE_ROWS)], compute_logits)

    return run


def _request(row: int, vocab_size: int, block_size: int) -> Sequence:
    params = costliest_params(row)
    seq = Sequence(
        request_id=f"profile-{row}",
        prompt_token_ids=[row % vocab_size],
        sampling=params,
        block_size=block_size,
        sampler_state=new_sampler_state(params),
    )
    # Output tokens, so the penalties count something.
    for token in (row + 1, row + 2):
        seq.append_token(token % vocab_size)
    return seq
