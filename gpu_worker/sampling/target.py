"""A verify step's target: each drafted row processed as the sampler would process it.

Speculative decoding verifies drafts against the target's distributions
(`gpu_worker.spec_decode.verify`), so a request's row j, the next token after its output
and its first j drafts, must be what the sampler makes of that position when decoding
plainly with those drafts already emitted (`TargetLogits`), in the sampler's order: the
structured-output mask after the grammar consumed the j drafts, allowed_token_ids and bad
words (a longer bad word's prefix may end in the drafts), logit_bias, min_tokens (EOS and
stop ids masked while the row's position is short of it), then the penalties with the j
drafts counted as output. Greedy rows read the processed logits' argmax; sampled rows
then take `target_probs`: temperature, min-p, top-k and top-p as
`Sampler._sample_random` applies them (top-k keeps every token tied with the k-th value;
top-p keeps the smallest head, in stable descending order, whose mass after top-k reaches
top_p). The sampler draws over a bounded candidate set for speed; here every row is
sorted over the whole vocabulary, which only the few rows of a verify step pay for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpu_worker.sampling.logit_bias import add_logit_bias
from gpu_worker.sampling.penalties import PenaltyRows, has_penalty
from gpu_worker.sampling.state import SamplerState, SamplingRequest
from gpu_worker.sampling.structured import GrammarMasker, RequestMatcher
from gpu_worker.sampling.token_filters import TokenFilters
from gpu_worker.sampling.upload import upload
from shared.sampling import SamplingParams


@dataclass(frozen=True)
class RequestDrafts:
    """One request of a verify step: its tokens so far and the drafts it is verified on."""

    request: SamplingRequest
    draft_token_ids: list[int]


@dataclass(frozen=True)
class _DraftRow:
    """Row `depth` of a drafted request, as the sampler's processing reads a row: the
    request with its first `depth` drafts as output."""

    drafted: RequestDrafts
    depth: int

    @property
    def request_id(self) -> str:
        return self.drafted.request.request_id

    @property
    def sampling(self) -> SamplingParams:
        return self.drafted.request.sampling

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.drafted.request.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.drafted.request.output_token_ids + self.drafts_before

    @property
    def drafts_before(self) -> list[int]:
        return self.drafted.draft_token_ids[: self.depth]

    @property
    def sampler_state(self) -> SamplerState:
        return self.drafted.request.sampler_state


class TargetLogits:
    """Processes a verify step's rows as the sampler processes a row (module docstring).

    The penalties' persistent rows are the sampler's own (`Sampler.penalties`), so a
    request's counts are kept once whichever path it samples by; the grammar masker and
    the token filters are this object's, so verify steps do not disturb the sampler's
    reused host buffer or its cached masks of the plain batch."""

    def __init__(
        self,
        vocab_size: int,
        device: torch.device,
        eos_token_ids: list[int],
        penalties: PenaltyRows,
    ) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids = list(eos_token_ids)
        self.grammar = GrammarMasker(vocab_size, self.device, self.eos_token_ids)
        self.token_filters = TokenFilters(vocab_size, self.device)
        self.penalties = penalties

    def process(self, logits: torch.Tensor, requests: Sequence[RequestDrafts]) -> torch.Tensor:
        """[rows, vocab] fp32 processed copy of `logits` ([rows, vocab], read, not
        mutated), whose rows are each request's k + 1 rows in order."""
        x = logits.to(torch.float32, copy=True)
        rows = [_DraftRow(d, j) for d in requests for j in range(len(d.draft_token_ids) + 1)]
        first_rows: list[int] = []
        first = 0
        for drafted in requests:
            first_rows.append(first)
            first += len(drafted.draft_token_ids) + 1
        self._apply_grammar(x, requests, first_rows)
        filters = [row.sampler_state.token_filter for row in rows]
        if any(filters):
            self.token_filters.apply(x, filters, rows)
        add_logit_bias(x, [row.sampling for row in rows], self.vocab_size)
        self._apply_min_tokens(x, rows)
        penalized = [i for i, row in enumerate(rows) if has_penalty(row.sampling)]
        if penalized:
            self.penalties.apply(
                x,
                penalized,
                [rows[i].drafted.request for i in penalized],
                [rows[i].drafts_before for i in penalized],
            )
        return x

    def _apply_grammar(
        self, x: torch.Tensor, requests: Sequence[RequestDrafts], first_rows: list[int]
    ) -> None:
        constrained: list[tuple[int, RequestMatcher, list[int]]] = [
            (first, m, d.draft_token_ids)
            for d, first in zip(requests, first_rows, strict=True)
            if (m := d.request.sampler_state.matcher) is not None and m.is_active
        ]
        if constrained:
            self.grammar.apply_drafted(
                x,
                [first for first, _, _ in constrained],
                [m for _, m, _ in constrained],
                [drafts for _, _, drafts in constrained],
            )

    def _apply_min_tokens(self, x: torch.Tensor, rows: Sequence[_DraftRow]) -> None:
        """EOS and stop ids to -inf on the rows whose position is short of min_tokens."""
        at_rows: list[int] = []
        at_cols: list[int] = []
        for i, row in enumerate(rows):
            sampling = row.sampling
            position = len(row.drafted.request.output_token_ids) + row.depth
            if position < sampling.min_tokens:
                banned = set(self.eos_token_ids) | set(sampling.stop_token_ids)
                banned_ids = [t for t in sorted(banned) if t < self.vocab_size]
                at_rows.extend([i] * len(banned_ids))
                at_cols.extend(banned_ids)
        if at_rows:
            x[self._upload(at_rows, torch.long), self._upload(at_cols, torch.long)] = -torch.inf

    def _upload(self, values: list[int] | list[float], dtype: torch.dtype) -> torch.Tensor:
        return upload(values, dtype, self.device)


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[m, vocab] fp32 probabilities of `logits` ([m, vocab], read, not mutated) after each
    row's temperature, min-p, top-k and top-p (`params[row]`, none of them greedy); each
    row sums to 1."""
    device = logits.device
    x = logits.to(torch.float32, copy=True)
    x.div_(upload([p.temperature for p in params], torch.float32, device)[:, None])
    min_p = [p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        # p < min_p x p_max, in logits: x < x_max + log(min_p) (min_p = 0: -inf, none).
        floor = x.amax(dim=-1) + upload(min_p, torch.float32, device).log()
        x.masked_fill_(x < floor[:, None], -torch.inf)
    vocab = x.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if min(top_k) < vocab or min(top_p) < 1.0:
        values, order = x.sort(dim=-1, descending=True, stable=True)
        kth = values.gather(1, upload([k - 1 for k in top_k], torch.long, device)[:, None])
        values.masked_fill_(values < kth, -torch.inf)  # ties with the k-th value stay
        probs = values.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # the mass ahead of each token
        cut = before >= upload(top_p, torch.float32, device)[:, None]
        cut[:, 0] = False  # the most likely token always stays
        values.masked_fill_(cut, -torch.inf)
        x = torch.empty_like(x).scatter_(1, order, values)
    return x.softmax(dim=-1)
