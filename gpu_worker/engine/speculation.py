"""Speculative decoding's part of the engine: the drafter that follows every request, the
drafts the scheduler asks for, the verification of a step's drafted rows, the counts.

The scheduler asks `propose` for a decoding sequence's drafts and schedules it for 1 + k
tokens; the runner returns logits at all of them; `verify` processes each row as the
sampler would at that position (`gpu_worker.sampling.target`) and keeps the accepted
head plus one token of the target's (gpu_worker.spec_decode.verify); `kept_logprobs`
gives the logprobs of the tokens each request kept, and `kept` shows the drafter what
each request kept. Every request speculates: penalties, min_tokens, logit_bias, token
filters and structured outputs are applied to every verify row, and a constrained
request's drafts end before the first one its grammar refuses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from gpu_worker.core.scheduler import ScheduledSequence
from gpu_worker.core.sequence import Sequence
from gpu_worker.sampling.sampler import Sampler
from gpu_worker.sampling.target import RequestDrafts, TargetLogits, target_probs
from gpu_worker.sampling.upload import upload
from gpu_worker.spec_decode.config import SpeculativeConfig
from gpu_worker.spec_decode.drafter import Drafter, make_drafter
from gpu_worker.spec_decode.verify import DraftedRequest, verify
from shared.protocol import TokenLogprobs
from shared.sampling import SamplingParams


@dataclass(frozen=True)
class _LogprobRows:
    """The raw target rows of a verify step's requests that asked for logprobs."""

    raw: torch.Tensor
    """[sum (k + 1), vocab] the model's logits, those requests' rows in order."""
    requests: list[tuple[str, int, list[int]]]
    """(request id, logprobs asked, tokens verification gave it), in row order: the
    request's j-th token was decided at its row j."""


class Speculator:
    """The engine's speculative decoding, with its drafter."""

    def __init__(
        self, config: SpeculativeConfig, sampler: Sampler, drafter: Drafter | None = None
    ) -> None:
        self.drafter = make_drafter(config) if drafter is None else drafter
        """The method's drafter: given for a draft model (which the engine builds), else
        the model-free one `config` names."""
        self.num_speculative_tokens = config.num_speculative_tokens
        self.vocab_size = sampler.vocab_size
        self.target = TargetLogits(
            sampler.vocab_size, sampler.device, sampler.eos_token_ids, sampler.penalties
        )
        self.method = config.method
        """The method's name, for the heartbeats' metrics."""
        self.num_draft_tokens = 0
        """Tokens drafted since start."""
        self.num_accepted_tokens = 0
        """Of those, the ones verification accepted."""
        self.num_drafts = 0
        """Verify events since start: a request with at least one draft in a step (vLLM's
        num_drafts), so accepted / drafts + 1 is the mean tokens a verify yields."""
        self.accepted_per_position = [0] * config.num_speculative_tokens
        """Index j: drafts accepted at draft position j (vLLM's per-position counts)."""
        self._logprob_rows: _LogprobRows | None = None
        """The last verify's rows for `kept_logprobs`; None once taken."""

    def start(self, seq: Sequence) -> None:
        self.drafter.start_request(seq.request_id, seq.prompt_token_ids)

    def expect(self, limits: Mapping[str, int]) -> None:
        """The coming step's most drafts per request (the draft-length controller's plan)."""
        self.drafter.expect(limits)

    def finish(self, request_id: str) -> None:
        self.drafter.finish_request(request_id)

    def kept(self, seq: Sequence, num_new: int) -> None:
        """`seq` kept its last `num_new` output tokens this step (and may have finished)."""
        self.drafter.add_tokens(seq.request_id, seq.output_token_ids[-num_new:])
        if seq.is_finished:
            self.drafter.finish_request(seq.request_id)

    def propose(self, seq: Sequence, room: int) -> list[int]:
        """The scheduler's drafts for a decoding `seq`: at most `room` tokens, cut before
        the first its structured-output grammar refuses or that would complete it."""
        drafts = self.drafter.propose(seq.request_id, min(self.num_speculative_tokens, room))
        matcher = seq.sampler_state.matcher
        if matcher is None or not drafts:
            return drafts
        return drafts[: matcher.num_valid_drafts(drafts)]

    def verify(
        self, logits: torch.Tensor, rows: list[int], items: list[ScheduledSequence]
    ) -> dict[str, list[int]]:
        """Verify the drafts of `items` against their logits `rows` (k + 1 each, in order);
        the tokens each keeps. Every row is processed as the sampler would process it
        (`TargetLogits`); greedy rows are then read as logits (their argmax), sampled ones
        as the sampler's probabilities (`target_probs`). The logprobs of the tokens are
        `kept_logprobs`' to give, once the scheduler has kept them."""
        raw = logits.index_select(0, upload(rows, torch.long, logits.device))
        raw = raw[:, : self.vocab_size]
        target = self.target.process(
            raw, [RequestDrafts(item.seq, item.draft_token_ids) for item in items]
        )
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
        self._count(items, result.num_accepted)
        self._logprob_rows = _logprob_rows(raw, requests, items, result.token_ids)
        return {
            item.seq.request_id: tokens
            for item, tokens in zip(items, result.token_ids, strict=True)
        }

    def _count(self, items: list[ScheduledSequence], num_accepted: list[int]) -> None:
        """Add a verify step's drafts and acceptances to the counters."""
        per_position = self.accepted_per_position
        for item, accepted in zip(items, num_accepted, strict=True):
            num_drafted = len(item.draft_token_ids)
            self.num_draft_tokens += num_drafted
            self.num_drafts += 1 if num_drafted else 0
            self.num_accepted_tokens += accepted
            for position in range(accepted):
                per_position[position] += 1

    def kept_logprobs(self, num_new: Mapping[str, int]) -> dict[str, list[TokenLogprobs]]:
        """The logprobs of the tokens the last `verify`'s requests kept (their first
        `num_new[request id]`, of those that asked), as the sampler reports them: from the
        model's raw logits at the row that decided each token. Empty when that verify was
        already taken or had none."""
        rows, self._logprob_rows = self._logprob_rows, None
        if rows is None:
            return {}
        picks: list[int] = []
        token_ids: list[int] = []
        asked: list[tuple[str, int, int]] = []  # request id, top-n, tokens kept
        first = 0
        for request_id, num_top, tokens in rows.requests:
            kept = min(num_new.get(request_id, 0), len(tokens))
            picks.extend(range(first, first + kept))
            token_ids.extend(tokens[:kept])
            if kept:
                asked.append((request_id, num_top, kept))
            first += len(tokens)
        if not picks:
            return {}
        device = rows.raw.device
        logprobs = torch.log_softmax(
            rows.raw.index_select(0, upload(picks, torch.long, device)).float(), dim=-1
        )
        chosen = logprobs.gather(1, upload(token_ids, torch.long, device)[:, None])
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        top = torch.topk(logprobs, max(n for _, n, _ in asked), dim=-1)
        chosen_list = chosen.squeeze(1).tolist()
        ranks_list = ranks.tolist()
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
        out: dict[str, list[TokenLogprobs]] = {}
        at = 0
        for request_id, num_top, kept in asked:
            out[request_id] = [
                TokenLogprobs(
                    logprob=chosen_list[i],
                    rank=int(ranks_list[i]),
                    top_token_ids=top_ids[i][:num_top],
                    top_logprobs=top_values[i][:num_top],
                )
                for i in range(at, at + kept)
            ]
            at += kept
        return out


def _logprob_rows(
    raw: torch.Tensor,
    requests: list[DraftedRequest],
    items: list[ScheduledSequence],
    token_ids: list[list[int]],
) -> _LogprobRows | None:
    """The rows `kept_logprobs` may need: those of the requests that asked for logprobs,
    up to the row of their last token (the rows after a rejection decide nothing)."""
    rows: list[int] = []
    asked: list[tuple[str, int, list[int]]] = []
    for request, item, tokens in zip(requests, items, token_ids, strict=True):
        num_top = item.seq.sampling.logprobs
        if num_top is None:
            continue
        rows.extend(range(request.target_row, request.target_row + len(tokens)))
        asked.append((item.seq.request_id, num_top, tokens))
    if not asked:
        return None
    return _LogprobRows(raw.index_select(0, upload(rows, torch.long, raw.device)), asked)
