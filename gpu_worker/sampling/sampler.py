"""Batched sampling over one engine step: logits [n, vocab] -> one token id per row.

Order of operations (vLLM v1's): the structured-output mask of constrained rows
(gpu_worker.sampling.structured), allowed_token_ids and bad_words
(gpu_worker.sampling.token_filters), logit_bias, min_tokens masking, penalties
(repetition, then frequency, then presence); greedy rows take the argmax here. Sampled rows then go
through temperature, min-p, top-k, top-p and an exponential race: argmax(probs / q) with
q ~ Exp(1), which draws from `probs` exactly. Seeded rows draw q from their own generator,
so their tokens depend only on their own seed and logits, not on the batch around them.

Every per-row decision is made in Python from the params, never by reading a device
tensor, so the only host<->device sync is the final `.tolist()` of the sampled ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from gpu_worker.sampling.penalties import PenaltyRows, has_penalty
from gpu_worker.sampling.state import SamplerState
from gpu_worker.sampling.structured import GrammarMasker, RequestMatcher
from gpu_worker.sampling.token_filters import TokenFilters, new_token_filter
from gpu_worker.sampling.upload import upload
from shared.sampling import SamplingParams


class SamplingRequest(Protocol):
    """One row of a step as the sampler reads it: the request's id, params and tokens (the
    engine's `Sequence` owns them) and the sampler's own state for it."""

    @property
    def request_id(self) -> str: ...

    @property
    def sampling(self) -> SamplingParams: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def sampler_state(self) -> SamplerState: ...


def new_sampler_state(
    params: SamplingParams, device: torch.device, matcher: RequestMatcher | None = None
) -> SamplerState:
    """A request's state, its generator seeded from params.seed on `device`."""
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(params.seed)
    return SamplerState(
        generator=generator,
        matcher=matcher,
        token_filter=new_token_filter(params),
        prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
    )


@dataclass
class SamplerOutput:
    """What one step sampled; the logprob tensors stay on the device (no sync)."""

    token_ids: list[int]
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

    def sample(self, logits: torch.Tensor, states: list[SamplingRequest]) -> SamplerOutput:
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
            return SamplerOutput(token_ids=_argmax_rows(logits).tolist(), num_top=num_top)

        # A copy: the caller's logits stay raw, and the ops below work in place.
        x = logits.to(torch.float32, copy=True)
        if constrained:
            # First, so every later step (bias, penalties, top-k/p) sees only allowed tokens.
            self.grammar.apply(x, constrained, [m for _, m in active])
        if filtered:
            self.token_filters.apply(x, filters, states)
        if uses_bias:
            self._apply_logit_bias(x, params)
        if bans:
            rows, cols = zip(*bans, strict=True)
            x[self._upload(rows, torch.long), self._upload(cols, torch.long)] = float("-inf")
        if penalized:
            self.penalties.apply(x, penalized, [states[row] for row in penalized])

        is_greedy = [p.is_greedy for p in params]
        if all(is_greedy):
            token_ids = _argmax_rows(x)
        else:
            token_ids = self._sample_random(x, states)
            if any(is_greedy):
                greedy = self._upload(is_greedy, torch.bool)
                token_ids = torch.where(greedy, _argmax_rows(x), token_ids)

        out = SamplerOutput(token_ids=[], num_top=num_top)
        if wants_logprobs:
            self._fill_logprobs(out, logits, token_ids, max(num_top))
        # The one host<->device sync of the step.
        out.token_ids = token_ids.tolist()
        return out

    def _upload(self, values: list | tuple, dtype: torch.dtype) -> torch.Tensor:
        return upload(values, dtype, self.device)

    def _min_tokens_bans(self, states: list[SamplingRequest]) -> list[tuple[int, int]]:
        """(row, token) pairs to mask: EOS and stop ids of rows still short of min_tokens."""
        bans: list[tuple[int, int]] = []
        for row, s in enumerate(states):
            if len(s.output_token_ids) < s.sampling.min_tokens:
                banned = set(self.eos_token_ids) | set(s.sampling.stop_token_ids)
                bans.extend((row, t) for t in sorted(banned) if t < self.vocab_size)
        return bans

    def _apply_logit_bias(self, x: torch.Tensor, params: list[SamplingParams]) -> None:
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        for row, p in enumerate(params):
            for token_id, bias in (p.logit_bias or {}).items():
                if 0 <= token_id < self.vocab_size:
                    rows.append(row)
                    cols.append(token_id)
                    vals.append(bias)
        if rows:
            index = (self._upload(rows, torch.long), self._upload(cols, torch.long))
            x.index_put_(index, self._upload(vals, torch.float32), accumulate=True)

    def _sample_random(self, x: torch.Tensor, states: list[SamplingRequest]) -> torch.Tensor:
        """Temperature, min-p, top-k, top-p, then one exponential-race draw per row."""
        params = [s.sampling for s in states]
        # Greedy rows get temperature 1 to stay finite; the caller overrides their pick.
        temps = [p.temperature if not p.is_greedy else 1.0 for p in params]
        x = x / self._upload(temps, torch.float32)[:, None]

        min_p = [p.min_p for p in params]
        if any(m > 0.0 for m in min_p):
            probs = torch.softmax(x, dim=-1)
            # The top token always passes (p_max >= min_p * p_max); min_p = 0 drops nothing.
            floor = self._upload(min_p, torch.float32)[:, None] * probs.amax(-1, keepdim=True)
            x.masked_fill_(probs < floor, float("-inf"))

        top_k = [p.top_k if 0 < p.top_k < self.vocab_size else 0 for p in params]
        if any(top_k):
            values = torch.topk(x, max(top_k), dim=-1).values
            k_index = self._upload([max(k, 1) - 1 for k in top_k], torch.long)[:, None]
            kth = values.gather(1, k_index)
            # Disabled rows get a -inf threshold so nothing of theirs is dropped.
            disabled = self._upload([k == 0 for k in top_k], torch.bool)[:, None]
            kth.masked_fill_(disabled, float("-inf"))
            x.masked_fill_(x < kth, float("-inf"))

        top_p = [p.top_p for p in params]
        if any(p < 1.0 for p in top_p):
            sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
            sorted_probs = torch.softmax(sorted_x, dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            # The first token has mass_before 0 < top_p, so it always survives; rows with
            # top_p = 1 are excluded outright, since fp32 cumsum may round past 1.0.
            drop_sorted = mass_before >= self._upload(top_p, torch.float32)[:, None]
            drop_sorted &= self._upload([p < 1.0 for p in top_p], torch.bool)[:, None]
            drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
            x.masked_fill_(drop, float("-inf"))

        probs = torch.softmax(x, dim=-1)
        # Ones, not empty: rows that draw nothing (greedy) must not hold NaN garbage.
        q = torch.ones_like(probs)
        generators = [s.sampler_state.generator for s in states]
        if any(g is None and not p.is_greedy for g, p in zip(generators, params, strict=True)):
            _exponential_(q)
        for row, (generator, p) in enumerate(zip(generators, params, strict=True)):
            if generator is not None and not p.is_greedy:
                # Drawn on its own tensor, the same shape every step, so the values depend
                # only on the generator's state, never on the row index or batch size.
                q[row] = _exponential_(torch.empty(x.shape[1], device=x.device), generator)
        # q == 0 would turn a masked token's 0 / 0 into NaN, which argmax picks.
        q.clamp_min_(torch.finfo(torch.float32).tiny)
        return _argmax_rows(probs / q)

    def _fill_logprobs(
        self, out: SamplerOutput, logits: torch.Tensor, token_ids: torch.Tensor, k: int
    ) -> None:
        raw = torch.log_softmax(logits.to(torch.float32), dim=-1)
        chosen = raw.gather(1, token_ids[:, None])
        out.logprobs = chosen.squeeze(1)
        out.ranks = (raw > chosen).sum(dim=-1) + 1
        top = torch.topk(raw, k, dim=-1)
        out.top_ids, out.top_logprobs = top.indices, top.values


def _exponential_(t: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill `t` with Exp(1) draws in place, by inverting the CDF: -log(1 - U).

    The same distribution as `Tensor.exponential_`, which costs several times as much on
    CPU, a noticeable share of a batch-32 decode step when every row samples
    (bench/RESULTS.md, Design choices)."""
    return t.uniform_(generator=generator).neg_().log1p_().neg_()


def _argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest value, the first one on ties (as argmax). On CPU,
    `max(dim)` is no slower than `argmax` over a 49k vocabulary on CPU, faster on some
    (bench/RESULTS.md, Design choices), and no slower on CUDA."""
    return x.max(dim=-1).indices
