"""Batched sampling over one engine step: logits [n, vocab] -> one token id per row.

Order of operations (vLLM v1's): the structured-output mask of constrained rows
(gpu_worker.sampling.structured), allowed_token_ids and bad_words
(gpu_worker.sampling.token_filters), logit_bias, min_tokens masking, penalties
(repetition, then frequency, then presence, from persistent per-request rows:
gpu_worker.sampling.penalties); greedy rows take the argmax here. Sampled rows then go
through temperature, min-p, top-k and top-p, on a bounded candidate set
(gpu_worker.sampling.top_k_top_p), and one inverse-CDF draw per row, all rows in one call
(gpu_worker.sampling.draw): a seeded row's uniform hashes its seed and its token count, so
its tokens depend only on its own seed and logits, not on the batch around them.

Every per-row decision is made in Python from the params, never by reading a device
tensor, so the sampled ids stay on the device (`SamplerOutput.sampled`): the engine moves
them to the host in one copy (gpu_worker.sampling.sampled_tokens), the next step's inputs
may read them where they are. The one sync inside is, on steps with top-p rows that have
no top-k, one read of which of them need more than their candidates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gpu_worker.sampling.draw import draw, uniforms
from gpu_worker.sampling.logit_bias import add_logit_bias
from gpu_worker.sampling.penalties import PenaltyRows, has_penalty
from gpu_worker.sampling.state import SamplerState, SamplingRequest
from gpu_worker.sampling.structured import GrammarMasker, RequestMatcher
from gpu_worker.sampling.token_filters import TokenFilters, new_token_filter
from gpu_worker.sampling.top_k_top_p import apply_top_p_full, needs_truncation, top_k_top_p
from gpu_worker.sampling.upload import upload
from shared.sampling import SamplingParams


def new_sampler_state(
    params: SamplingParams, matcher: RequestMatcher | None = None
) -> SamplerState:
    """A request's state. Nothing in it lives on a device: seeded draws hash the seed, and
    penalty rows belong to the sampler."""
    return SamplerState(
        matcher=matcher,
        token_filter=new_token_filter(params),
        prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
    )


@dataclass
class SamplerOutput:
    """What one step sampled, on the device (no sync)."""

    sampled: torch.Tensor
    """[n] int64 the sampled id of each row."""
    logprobs: torch.Tensor | None = None
    """[n] fp32 raw logprob (log_softmax of the model logits) of each sampled token."""
    ranks: torch.Tensor | None = None
    """[n] int64 rank of each sampled token under the raw logprobs (1 = most likely)."""
    top_ids: torch.Tensor | None = None
    """[n, k] int64 ids of the k most likely tokens, k = max logprobs asked in the batch."""
    top_logprobs: torch.Tensor | None = None
    """[n, k] fp32 raw logprobs of top_ids, descending."""
    num_top: list[int] = field(default_factory=list)
    """How many of the k top entries each row asked for (0 if none)."""

    @property
    def token_ids(self) -> list[int]:
        """The sampled ids on the host (a sync: the engine reads them through
        `SampledTokenCopy` instead)."""
        return self.sampled.tolist()


class Sampler:
    """Turns one step's logits into tokens for every scheduled sequence."""

    def __init__(self, vocab_size: int, device: torch.device, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids = list(eos_token_ids)
        self.grammar = GrammarMasker(vocab_size, self.device, self.eos_token_ids)
        self.token_filters = TokenFilters(vocab_size, self.device)
        self.penalties = PenaltyRows(vocab_size, self.device)

    def release(self, request_ids: list[str]) -> None:
        """Free the persistent rows of requests that left the running set (finished,
        aborted or preempted); a preempted request takes a new row when it samples again."""
        self.penalties.release(request_ids)

    def sample(self, logits: torch.Tensor, states: Sequence[SamplingRequest]) -> SamplerOutput:
        """Sample one token per row of `logits` ([n, >= vocab_size]) for `states[row]`."""
        # Columns past vocab_size are padding of the embedding table, never real tokens.
        logits = logits[:, : self.vocab_size]
        params = [s.sampling for s in states]
        num_top = [p.logprobs or 0 for p in params]
        wants_logprobs = any(p.logprobs is not None for p in params)
        bans = self._min_tokens_bans(states)
        penalized = [row for row, p in enumerate(params) if has_penalty(p)]
        uses_bias = any(p.logit_bias for p in params)
        active = [
            (row, m)
            for row, s in enumerate(states)
            if (m := s.sampler_state.matcher) is not None and m.is_active
        ]
        constrained = [row for row, _ in active]
        filters = [s.sampler_state.token_filter for s in states]
        filtered = any(filters)
        if all(p.is_greedy for p in params) and not (
            wants_logprobs or bans or penalized or uses_bias or constrained or filtered
        ):
            return SamplerOutput(sampled=_argmax_rows(logits), num_top=num_top)

        # A copy: the caller's logits stay raw, and the ops below work in place.
        x = logits.to(torch.float32, copy=True)
        if constrained:
            # First, so every later step (bias, penalties, top-k/p) sees only allowed tokens.
            self.grammar.apply(x, constrained, [m for _, m in active])
        if filtered:
            self.token_filters.apply(x, filters, states)
        if uses_bias:
            add_logit_bias(x, params, self.vocab_size)
        if bans:
            rows, cols = zip(*bans, strict=True)
            x[self._upload(rows, torch.long), self._upload(cols, torch.long)] = float("-inf")
        if penalized:
            self.penalties.apply(x, penalized, [states[row] for row in penalized])

        sampled = [row for row, p in enumerate(params) if not p.is_greedy]
        if not sampled:
            token_ids = _argmax_rows(x)
        elif len(sampled) == len(params):
            token_ids = self._sample_random(x, states)
        else:
            # Greedy rows pick from the processed logits before the sampled rows scale theirs.
            token_ids = _argmax_rows(x)
            index = self._upload(sampled, torch.long)
            picks = self._sample_random(x.index_select(0, index), [states[r] for r in sampled])
            token_ids.index_copy_(0, index, picks)

        out = SamplerOutput(sampled=token_ids, num_top=num_top)
        if wants_logprobs:
            self._fill_logprobs(out, logits, token_ids, max(num_top))
        return out

    def _upload(self, values: list | tuple, dtype: torch.dtype) -> torch.Tensor:
        return upload(values, dtype, self.device)

    def _min_tokens_bans(self, states: Sequence[SamplingRequest]) -> list[tuple[int, int]]:
        """(row, token) pairs to mask: EOS and stop ids of rows still short of min_tokens."""
        bans: list[tuple[int, int]] = []
        for row, s in enumerate(states):
            if s.output_position < s.sampling.min_tokens:
                banned = set(self.eos_token_ids) | set(s.sampling.stop_token_ids)
                bans.extend((row, t) for t in sorted(banned) if t < self.vocab_size)
        return bans

    def _sample_random(self, x: torch.Tensor, states: Sequence[SamplingRequest]) -> torch.Tensor:
        """Temperature, min-p, top-k and top-p on `x` ([m, vocab], every row sampled, in
        place), then one draw per row: over its candidates for a truncated row, over the
        vocabulary otherwise."""
        params = [s.sampling for s in states]
        x.div_(self._upload([p.temperature for p in params], torch.float32)[:, None])
        min_p = [p.min_p for p in params]
        if any(m > 0.0 for m in min_p):
            # p < min_p x p_max, in logits: x < x_max + log(min_p) (min_p = 0: -inf, none).
            floor = x.amax(dim=-1) + self._upload(min_p, torch.float32).log()
            x.masked_fill_(x < floor[:, None], -torch.inf)
        u = uniforms([p.seed for p in params], [s.output_position for s in states], self.device)

        cut = [r for r, p in enumerate(params) if needs_truncation(p.top_k, p.top_p, x.shape[1])]
        if not cut:
            return draw(x, u)
        candidates = top_k_top_p(
            self._rows(x, cut), [params[r].top_k for r in cut], [params[r].top_p for r in cut]
        )
        overflow = [cut[i] for i in candidates.overflow]
        if overflow:
            # Their nucleus runs past the candidates: the full sort on these rows only; they
            # draw over the vocabulary with the untruncated rows.
            wide = self._rows(x, overflow)
            apply_top_p_full(wide, [params[r].top_p for r in overflow])
            if wide is not x:
                x.index_copy_(0, self._upload(overflow, torch.long), wide)
        inside = [i for i, r in enumerate(cut) if r not in overflow]
        on_candidates = [cut[i] for i in inside]
        full = sorted(set(range(len(states))) - set(on_candidates))

        token_ids = torch.empty(len(states), dtype=torch.long, device=x.device)
        if inside:
            logits = self._rows(candidates.logits, inside)
            picks = draw(logits, self._rows(u, on_candidates))
            chosen = self._rows(candidates.token_ids, inside).gather(1, picks[:, None])
            token_ids[self._upload(on_candidates, torch.long)] = chosen.squeeze(1)
        if full:
            picks = draw(self._rows(x, full), self._rows(u, full))
            token_ids[self._upload(full, torch.long)] = picks
        return token_ids

    def _rows(self, t: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """`t[rows]`, or `t` itself when `rows` is every row in order."""
        if rows == list(range(t.shape[0])):
            return t
        return t.index_select(0, self._upload(rows, torch.long))

    def _fill_logprobs(
        self, out: SamplerOutput, logits: torch.Tensor, token_ids: torch.Tensor, k: int
    ) -> None:
        raw = torch.log_softmax(logits.to(torch.float32), dim=-1)
        chosen = raw.gather(1, token_ids[:, None])
        out.logprobs = chosen.squeeze(1)
        out.ranks = (raw > chosen).sum(dim=-1) + 1
        top = torch.topk(raw, k, dim=-1)
        out.top_ids, out.top_logprobs = top.indices, top.values


def _argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest value, the first one on ties (as argmax). On CPU,
    `max(dim)` is no slower than `argmax` over a 49k vocabulary on CPU, faster on some
    (bench/RESULTS.md, Design choices), and no slower on CUDA."""
    return x.max(dim=-1).indices
