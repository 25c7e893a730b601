"""Verification of drafted tokens against the target model's distributions, one call per step.

A request drafted k >= 0 tokens; the target ran once over them and gave k + 1 rows: row j
is the next-token distribution after the request's tokens and drafts 0..j-1. Verification
keeps the longest acceptable head of the drafts and adds one token of the target's own:
the correction at the first rejected draft, or the bonus from row k when all pass. So a
request emits 1..k+1 tokens, and they are distributed exactly as the target's would be
without speculation:
- a greedy request accepts a draft while it is its row's argmax (the first on ties, as the
  sampler's greedy path takes it); the correction or bonus is an argmax too, so the tokens
  equal plain greedy decoding, token for token;
- a sampled request uses speculative sampling (Leviathan et al. 2023, Chen et al. 2023):
  draft x, proposed with probability q(x), is accepted with probability min(1, p(x)/q(x));
  at the first rejection the correction is drawn from norm(max(0, p - q)); the bonus from
  p. A drafter that proposes deterministically (n-gram, suffix) has a one-hot q: accept x
  with probability p(x), and on rejection draw from p with x removed. That is done here
  by drawing each position's token as the sampler would (its own uniform there) and
  accepting the draft while it equals the draw, the first draw that differs being the
  correction: the same law, and a seeded request emits exactly the tokens it would emit
  without speculation, whichever drafts (or other requests' outputs) it was shown.

Randomness: a seeded request's uniforms depend on its seed, the output position of the
token being decided and their purpose (`Purpose`) alone, so its tokens are the same
whatever shares its batch. The draw at a position uses the sampler's own uniform there
(`draw.seeded_uniform(seed, position)`); acceptance tests use a separate stream. Positions
follow the emitted tokens, so a step never reuses a uniform an earlier step looked at.
Unseeded requests take torch's generator on the device.

All requests are processed at once on padded [batch, k_max + 1] tensors; the only host
work is building those index lists (O(sum k)) and the seeded uniforms, and the only
host<->device sync is the final read of the accepted counts and the last tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch

from gpu_worker.sampling.draw import draw, seeded_uniform
from gpu_worker.sampling.upload import upload


class Purpose(IntEnum):
    """What a seeded uniform decides at an output position; each has its own stream."""

    DRAW = 0
    """The token drawn at the position (correction or bonus): the sampler's stream."""
    ACCEPT = 1
    """The acceptance test of the draft at the position."""


_PURPOSE_STRIDE = 1 << 62
"""Position offset between purposes' streams; no request reaches 2^62 tokens."""


def purpose_uniform(seed: int, position: int, purpose: Purpose) -> float:
    """A uniform in [0, 1) for `purpose` at output `position` of the request seeded `seed`."""
    return seeded_uniform(seed, position + int(purpose) * _PURPOSE_STRIDE)


@dataclass(frozen=True)
class DraftedRequest:
    """One request of a verify step, as the host knows it (no device data)."""

    draft_token_ids: list[int]
    """Its k >= 0 proposed tokens, in order."""
    target_row: int
    """The first of its k + 1 consecutive rows in the step's `target` tensor."""
    is_greedy: bool
    """Temperature 0: argmax acceptance, no randomness."""
    seed: int | None
    """Its sampling seed; None draws from torch's generator."""
    position: int
    """Tokens it had generated before this step: the output index of the first token the
    step decides (the sampler's `len(output_token_ids)`)."""


@dataclass(frozen=True)
class VerifyOutput:
    """What one verify step decided, per request in the order given."""

    num_accepted: list[int]
    """Drafts accepted, 0..k: the head `draft_token_ids[:num_accepted]`."""
    token_ids: list[list[int]]
    """Tokens to emit: the accepted drafts, then the correction or bonus (1..k+1 tokens)."""


def verify(
    target: torch.Tensor,
    requests: Sequence[DraftedRequest],
    draft_probs: torch.Tensor | None = None,
) -> VerifyOutput:
    """Accept each request's drafts against `target` and add its correction or bonus token.

    `target` ([rows, vocab], float, on the step's device; read, not mutated): a sampled
    request's k + 1 rows, from `target_row` on, are its probabilities after its own
    processing (penalties, temperature, min-p, top-k / top-p), each summing to 1. A greedy
    request's rows are read for their argmax alone: give it the processed logits the
    sampler's greedy path takes, since a softmax may round two near logits to one
    probability and the tie would then go to the first of them. Other rows are ignored.
    `draft_probs` ([sum k, vocab], float, same device; read): the drafter's distributions,
    request after request, row j of a request the one draft j was drawn from; None when
    the drafter proposes deterministically (q one-hot).
    """
    device = target.device
    batch = len(requests)
    if batch == 0:
        return VerifyOutput(num_accepted=[], token_ids=[])
    num_drafts = [len(r.draft_token_ids) for r in requests]
    k_max = max(num_drafts)
    width = k_max + 1
    greedy = [r.is_greedy for r in requests]

    drafts = _Drafts.pad(requests, k_max, device)
    # Row of each (request, position) in `target`; padding repeats a request's last row.
    positions = torch.arange(width, device=device)[None, :]
    first_rows = upload([r.target_row for r in requests], torch.long, device)
    rows = first_rows[:, None] + torch.minimum(positions, drafts.count[:, None])
    argmax = target.max(dim=-1).indices if any(greedy) else None
    sampled = [b for b, g in enumerate(greedy) if not g]
    index = upload(sampled, torch.long, device)
    # Deterministic drafts: every sampled position's own draw, which decides both.
    draws = None
    if sampled and draft_probs is None:
        sampled_requests = [requests[b] for b in sampled]
        draws = _draw_every_position(target, rows.index_select(0, index), sampled_requests)
    if k_max > 0:
        accepted = _accepted(
            target, rows[:, :k_max], drafts, draft_probs, argmax, requests, index, draws
        )
        valid = torch.arange(k_max, device=device)[None, :] < drafts.count[:, None]
        # The head of consecutive acceptances: a rejection ends the run.
        num_accepted = (accepted & valid).long().cumprod(dim=1).sum(dim=1)
    else:
        num_accepted = torch.zeros(batch, dtype=torch.long, device=device)

    decided_row = rows.gather(1, num_accepted[:, None]).squeeze(1)
    if not sampled:
        assert argmax is not None  # every request is greedy
        last = argmax[decided_row]
    else:
        if draws is not None:
            picks = draws.gather(1, num_accepted[index][:, None]).squeeze(1)
        else:
            picks = _draw_last(
                target.index_select(0, decided_row[index]),
                num_accepted[index],
                drafts.select(index),
                draft_probs,
                _uniforms([requests[b] for b in sampled], width, Purpose.DRAW, device),
            )
        last = picks if argmax is None else argmax[decided_row].index_copy_(0, index, picks)

    # The step's host<->device sync.
    counts, tokens = torch.stack([num_accepted, last]).tolist()
    return VerifyOutput(
        num_accepted=counts,
        token_ids=[
            r.draft_token_ids[:n] + [t] for r, n, t in zip(requests, counts, tokens, strict=True)
        ],
    )


@dataclass(frozen=True)
class _Drafts:
    """The batch's drafts as padded device tensors (padding: token 0, row 0, never used)."""

    token_ids: torch.Tensor
    """[batch, k_max] long."""
    rows: torch.Tensor
    """[batch, k_max] long: each draft's row in `draft_probs` (packed request after request)."""
    count: torch.Tensor
    """[batch] long: each request's k."""

    @staticmethod
    def pad(requests: Sequence[DraftedRequest], k_max: int, device: torch.device) -> _Drafts:
        """Padded on the device from the flat drafts: O(batch) host work, no sync."""
        count = upload([len(r.draft_token_ids) for r in requests], torch.long, device)
        flat = [t for r in requests for t in r.draft_token_ids]
        if not flat:
            empty = torch.zeros(len(requests), 0, dtype=torch.long, device=device)
            return _Drafts(token_ids=empty, rows=empty, count=count)
        start = count.cumsum(dim=0) - count
        j = torch.arange(k_max, device=device)[None, :]
        rows = torch.where(j < count[:, None], start[:, None] + j, 0)
        return _Drafts(token_ids=upload(flat, torch.long, device)[rows], rows=rows, count=count)

    def select(self, index: torch.Tensor) -> _Drafts:
        return _Drafts(self.token_ids[index], self.rows[index], self.count[index])


def accepts(u: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
    """Whether drafts pass: u < min(1, p(x) / q(x)), elementwise over same-shaped tensors of
    uniforms, the target's and the drafter's probabilities of the drafts (`q` None: one-hot,
    q(x) = 1). Written without the division: a draft with q(x) = 0, which its drafter could
    not have drawn, passes wherever p(x) > 0; one with p(x) = 0 never does."""
    return u < p if q is None else u * q < p


def correction_weights(
    p: torch.Tensor,
    rejected: torch.Tensor,
    draft_token: torch.Tensor,
    q: torch.Tensor | None,
) -> torch.Tensor:
    """[m, vocab] unnormalized weights of the token drawn last: max(0, p - q) for a rejected
    row (p with its draft removed when q is one-hot, `q` None), p for a row whose drafts all
    passed. `p` [m, vocab]: the target row of the decided position; `rejected` [m] bool;
    `draft_token` [m] long: the rejected draft (any id where not rejected); `q` [m, vocab]
    or None. Nothing is mutated. A rejected row whose residual has no mass (p = q up to
    rounding, so rejection had probability ~0) falls back to p."""
    if q is None:
        at = draft_token[:, None]
        kept = p.gather(1, at).masked_fill_(rejected[:, None], 0.0)
        residual = p.clone().scatter_(1, at, kept)
    else:
        residual = torch.where(rejected[:, None], (p - q).clamp_min(0.0), p)
    return torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)


def _accepted(
    target: torch.Tensor,
    rows: torch.Tensor,
    drafts: _Drafts,
    draft_probs: torch.Tensor | None,
    argmax: torch.Tensor | None,
    requests: Sequence[DraftedRequest],
    sampled: torch.Tensor,
    draws: torch.Tensor | None,
) -> torch.Tensor:
    """[batch, k_max] bool: whether each draft passes its own test, whatever the ones
    before it did (padding included; the caller masks it). `rows` [batch, k_max]: the
    target row each draft is tested against; `argmax` [rows of target]: None without
    greedy requests; `sampled` the sampled requests' indices and `draws` [len(sampled),
    k_max + 1] their draws at each position, for deterministic drafts (else None)."""
    tokens = drafts.token_ids
    greedy = [r.is_greedy for r in requests]
    passes_greedy = None if argmax is None else tokens == argmax[rows]
    if passes_greedy is not None and all(greedy):
        return passes_greedy
    if draws is not None:
        passes_sampled = draws[:, : tokens.shape[1]] == tokens.index_select(0, sampled)
        if passes_greedy is None:
            return passes_sampled
        return passes_greedy.index_copy(0, sampled, passes_sampled)
    p = target[rows, tokens].double()
    q = None if draft_probs is None else draft_probs[drafts.rows, tokens].double()
    passes = accepts(_uniforms(requests, tokens.shape[1], Purpose.ACCEPT, target.device), p, q)
    if passes_greedy is None:
        return passes
    is_greedy = upload(greedy, torch.bool, target.device)[:, None]
    return torch.where(is_greedy, passes_greedy, passes)


def _draw_last(
    p: torch.Tensor,
    num_accepted: torch.Tensor,
    drafts: _Drafts,
    draft_probs: torch.Tensor | None,
    u: torch.Tensor,
) -> torch.Tensor:
    """[m] the correction or bonus token of each of m sampled requests: `p` [m, vocab] the
    target row of the position decided, `num_accepted` [m], `u` [m, k_max + 1] the
    requests' DRAW uniforms from their first position on."""
    k_max = drafts.token_ids.shape[1]
    if k_max == 0:
        weights = p  # no drafts anywhere: every token is a bonus
    else:
        at = num_accepted.clamp_max(k_max - 1)[:, None]
        rejected = num_accepted < drafts.count
        q = None
        if draft_probs is not None:
            q = draft_probs.index_select(0, drafts.rows.gather(1, at).squeeze(1))
        weights = correction_weights(p, rejected, drafts.token_ids.gather(1, at).squeeze(1), q)
    return draw(weights.float().log(), u.gather(1, num_accepted[:, None]).squeeze(1))


def _draw_every_position(
    target: torch.Tensor, rows: torch.Tensor, requests: Sequence[DraftedRequest]
) -> torch.Tensor:
    """[m, width] the token each of m sampled requests draws at each of its positions, as
    the sampler draws it there: `rows` [m, width] the target rows, DRAW uniforms."""
    width = rows.shape[1]
    u = _uniforms(requests, width, Purpose.DRAW, target.device)
    logits = target.index_select(0, rows.reshape(-1)).float().log()
    return draw(logits, u.reshape(-1)).view(rows.shape)


def _uniforms(
    requests: Sequence[DraftedRequest], width: int, purpose: Purpose, device: torch.device
) -> torch.Tensor:
    """[len(requests), width] fp64: `purpose_uniform(seed, position + j, purpose)` in
    column j of a seeded sampled request's row, torch's generator for the other rows (a
    greedy row's are never read, so its seed costs no hashing)."""
    seeded = [
        (row, r.seed, r.position)
        for row, r in enumerate(requests)
        if r.seed is not None and not r.is_greedy
    ]
    values = [
        purpose_uniform(seed, position + j, purpose)
        for _, seed, position in seeded
        for j in range(width)
    ]
    if len(seeded) == len(requests):
        return upload(values, torch.float64, device).view(len(requests), width)
    u = torch.rand(len(requests), width, dtype=torch.float64, device=device)
    if seeded:
        index = upload([row for row, _, _ in seeded], torch.long, device)
        u.index_copy_(0, index, upload(values, torch.float64, device).view(len(seeded), width))
    return u
