"""Speculative decoding's part of the engine: the drafter that follows every request, the
drafts the scheduler asks for, the verification of a step's drafted rows, the counts.

The scheduler asks `propose` for a decoding sequence's drafts and schedules it for 1 + k
tokens; the runner returns logits at all of them; `verify` keeps the accepted head plus
one token of the target's (gpu_worker.spec_decode.verify), and `kept` shows the drafter
what each request kept. Requests whose distribution verification does not reproduce yet
(`may_speculate`) get no drafts and decode one token a step.
"""

from __future__ import annotations

import torch

from gpu_worker.core.scheduler import ScheduledSequence
from gpu_worker.core.sequence import Sequence
from gpu_worker.sampling.penalties import has_penalty
from gpu_worker.sampling.target import target_probs
from gpu_worker.sampling.upload import upload
from gpu_worker.spec_decode.config import SpeculativeConfig
from gpu_worker.spec_decode.drafter import Drafter, make_drafter
from gpu_worker.spec_decode.verify import DraftedRequest, verify
from shared.sampling import SamplingParams


class Speculator:
    """The engine's speculative decoding, with its drafter."""

    def __init__(
        self, config: SpeculativeConfig, vocab_size: int, drafter: Drafter | None = None
    ) -> None:
        self.drafter = make_drafter(config) if drafter is None else drafter
        """The method's drafter: given for a draft model (which the engine builds), else
        the model-free one `config` names."""
        self.num_speculative_tokens = config.num_speculative_tokens
        self.vocab_size = vocab_size
        self.num_draft_tokens = 0
        """Tokens drafted since start."""
        self.num_accepted_tokens = 0
        """Of those, the ones verification accepted."""

    def start(self, seq: Sequence) -> None:
        self.drafter.start_request(seq.request_id, seq.prompt_token_ids)

    def finish(self, request_id: str) -> None:
        self.drafter.finish_request(request_id)

    def kept(self, seq: Sequence, num_new: int) -> None:
        """`seq` kept its last `num_new` output tokens this step (and may have finished)."""
        self.drafter.add_tokens(seq.request_id, seq.output_token_ids[-num_new:])
        if seq.is_finished:
            self.drafter.finish_request(seq.request_id)

    def propose(self, seq: Sequence, room: int) -> list[int]:
        """The scheduler's drafts for a decoding `seq`: at most `room` tokens, none for a
        request that may not speculate."""
        if not may_speculate(seq):
            return []
        return self.drafter.propose(seq.request_id, min(self.num_speculative_tokens, room))

    def verify(
        self, logits: torch.Tensor, rows: list[int], items: list[ScheduledSequence]
    ) -> dict[str, list[int]]:
        """Verify the drafts of `items` against their logits `rows` (k + 1 each, in order);
        the tokens each keeps. Greedy rows are read as logits (their argmax), sampled ones
        as the sampler's probabilities (`target_probs`)."""
        target = logits.index_select(0, upload(rows, torch.long, logits.device))
        target = target[:, : self.vocab_size].float()
        requests: list[DraftedRequest] = []
        sampled_rows: list[int] = []
        sampled_params: list[SamplingParams] = []
        first = 0
        for item in items:
            sampling = item.seq.sampling
            width = 1 + len(item.draft_token_ids)
            requests.append(
                DraftedRequest(
                    draft_token_ids=item.draft_token_ids,
                    target_row=first,
                    is_greedy=sampling.is_greedy,
                    seed=sampling.seed,
                    position=item.seq.num_output_tokens,
                )
            )
            if not sampling.is_greedy:
                sampled_rows.extend(range(first, first + width))
                sampled_params.extend([sampling] * width)
            first += width
        if sampled_rows:
            index = upload(sampled_rows, torch.long, target.device)
            target = target.index_copy(
                0, index, target_probs(target.index_select(0, index), sampled_params)
            )
        result = verify(target, requests)
        self.num_draft_tokens += sum(len(item.draft_token_ids) for item in items)
        self.num_accepted_tokens += sum(result.num_accepted)
        return {
            item.seq.request_id: tokens
            for item, tokens in zip(items, result.token_ids, strict=True)
        }


def may_speculate(seq: Sequence) -> bool:
    """Whether verification reproduces this request's distribution: `target_probs` models
    temperature, top-k, top-p and min-p alone. Penalties (which change with each kept
    token), min_tokens still pending, structured outputs, logprobs, logit_bias and token
    filters (bad words, allowed ids) get no drafts yet."""
    sampling = seq.sampling
    state = seq.sampler_state
    return not (
        has_penalty(sampling)
        or seq.num_output_tokens < sampling.min_tokens
        or state.matcher is not None
        or state.token_filter is not None
        or sampling.logprobs is not None
        or sampling.logit_bias
    )
