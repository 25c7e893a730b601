"""Speculative decoding as one component: the drafter that follows every request, the
drafts each step proposes, the verification of a step's drafted rows, the counts.

Before a step is scheduled, `propose` puts each decoding request's drafts into its
`Sequence.draft_token_ids` (vLLM's `spec_token_ids`), as many as the draft-length
controller finds worth their rows (gpu_worker.spec_decode.draft_length) and the request's
output and context leave room for; the scheduler only trims them to its budget and the
KV cache. The runner returns logits at all 1 + k rows; `verify` processes each row as the
sampler would at that position (`gpu_worker.sampling.target`) and keeps the accepted head
plus one token of the target's (gpu_worker.spec_decode.verify); after the scheduler kept
them, `step_done` shows the drafter what each request kept, times the step for the
controller and gives the kept tokens' logprobs. Every request speculates: penalties,
min_tokens, logit_bias, token filters and structured outputs are applied to every verify
row, and a constrained request's drafts end before the first one its grammar refuses.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from gpu_worker.core.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from gpu_worker.core.sequence import Sequence
from gpu_worker.sampling.sampler import Sampler
from gpu_worker.sampling.target import RequestDrafts, TargetLogits, target_probs
from gpu_worker.sampling.upload import upload
from gpu_worker.spec_decode.config import SpeculativeConfig
from gpu_worker.spec_decode.draft_length import DraftLengthController
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
        self.draft_length = (
            DraftLengthController(config.num_speculative_tokens)
            if config.draft_length == "adaptive"
            else None
        )
        """How many drafts pay for their rows, request by request; None with a fixed
        draft length."""

    def start(self, seq: Sequence) -> None:
        self.drafter.start_request(seq.request_id, seq.prompt_token_ids)

    def finish(self, request_id: str) -> None:
        """The request ended (finished or aborted): its drafter and controller state go."""
        self.drafter.finish_request(request_id)
        if self.draft_length is not None:
            self.draft_length.finish(request_id)

    def propose(self, scheduler: Scheduler) -> None:
        """Before `scheduler` schedules a step: each running request that decodes gets its
        drafts in `draft_token_ids`, every other running one none. A draft model drafts
        them here, in one batched round: no model work runs inside `schedule()`."""
        running = scheduler.running
        decoding = [s for s in running if s.num_computed_tokens == s.num_tokens - 1]
        limits: Mapping[str, int] | None = None
        if self.draft_length is not None:
            limits = self.draft_length.plan(
                [s.request_id for s in decoding],
                len(running) - len(decoding),
                self.drafter.catch_up_tokens,
            )
            self.drafter.expect(limits)
        for seq in running:
            seq.draft_token_ids = []
        budget = scheduler.config.max_num_batched_tokens - 1
        for seq in decoding:
            room = min(self.num_speculative_tokens, scheduler.draft_room(seq), budget)
            if limits is not None:
                room = min(room, limits.get(seq.request_id, 0))
            if room > 0:
                seq.draft_token_ids = self._drafts(seq, room)

    def _drafts(self, seq: Sequence, room: int) -> list[int]:
        """At most `room` of the drafter's tokens for `seq`, cut before the first its
        structured-output grammar refuses or that would complete it."""
        drafts = self.drafter.propose(seq.request_id, room)
        matcher = seq.sampler_state.matcher
        if matcher is None or not drafts:
            return drafts
        return drafts[: matcher.num_valid_drafts(drafts)]

    def step_done(
        self,
        output: SchedulerOutput,
        changed: list[Sequence],
        num_new: Mapping[str, int],
        started: float,
    ) -> dict[str, list[TokenLogprobs]]:
        """After the scheduler kept a step's tokens (`num_new` per request in `changed`):
        the drafter learns them (and lets finished requests go), the draft-length
        controller what the step cost since `started`; the verified requests' logprobs."""
        for seq in changed:
            self.drafter.add_tokens(
                seq.request_id, seq.output_token_ids[-num_new[seq.request_id] :]
            )
            if seq.is_finished:
                self.finish(seq.request_id)
        if self.draft_length is not None:
            self._time_decode_step(output.scheduled, started)
        return self.kept_logprobs(num_new)

    def _time_decode_step(self, scheduled: list[ScheduledSequence], started: float) -> None:
        """Tell the draft-length controller what a step of decodes only cost, end to end,
        and what the drafter's model ran in it; a step with prefill rows says nothing
        about a decode row's cost."""
        assert self.draft_length is not None
        drafting = self.drafter.take_steps()
        if scheduled and all(
            item.will_sample and item.num_new_tokens == 1 + len(item.draft_token_ids)
            for item in scheduled
        ):
            rows = sum(item.num_new_tokens for item in scheduled)
            self.draft_length.step_timed(rows, time.perf_counter() - started, drafting)
        else:
            self.draft_length.drafted(drafting)

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
        if self.draft_length is not None:
            for item, tokens in zip(items, result.token_ids, strict=True):
                self.draft_length.verified(
                    item.seq.request_id, len(item.draft_token_ids), len(tokens) - 1
                )
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
