"""Top-k and top-p on a bounded candidate set instead of a sort of the whole vocabulary.

Each truncated row keeps its K best logits (`torch.topk`): K covers the batch's largest
top_k plus `TIE_MARGIN` and, if a row has top_p alone, `CANDIDATES`. Top-k keeps the
candidates at or above the row's k-th value, ties included, as a mask of the vocabulary
would; top-p then keeps the smallest head of the candidates whose mass reaches top_p,
the mass measured against the row's whole distribution after top-k (its top-k, or the
full vocabulary for a row without top_k). Only a row with top_p alone whose K candidates
hold less than top_p of its mass needs more than them (a flat distribution): `overflow`
names those rows, and `apply_top_p_full` runs the full sort on them only, as every top-p
row did before.

The nucleus is cut in the stable sort's order (logit descending, then token id), and the
kept candidates come back in token-id order, the order of a draw over the vocabulary. So
what a row keeps, and what a seeded draw picks among it, depend on the row's own logits,
not on K, which the other rows of the batch set, nor on whether the row fell back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.sampling.upload import upload

CANDIDATES = 1024
"""Candidates per top-p row without top_k: enough for the nucleus of a language model's
next-token distribution at usual temperatures; flatter rows fall back to the full sort."""
TIE_MARGIN = 64
"""Candidates past a row's top_k, so that the tokens tied with its k-th value (common in
bf16 logits) are all among them, whatever K the rest of the batch sets."""


@dataclass
class Candidates:
    """The kept tokens of each truncated row, in canonical order."""

    logits: torch.Tensor
    """[m, K] fp32: the kept candidates' logits, -inf for the ones cut."""
    token_ids: torch.Tensor
    """[m, K] int64: their token ids, ascending along each row."""
    overflow: list[int]
    """Rows whose nucleus runs past the candidates: sample them over the full vocabulary
    after `apply_top_p_full`."""


def needs_truncation(top_k: int, top_p: float, vocab_size: int) -> bool:
    return 0 < top_k < vocab_size or top_p < 1.0


def top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> Candidates:
    """The candidates of `x` ([m, vocab] logits after temperature) for each row's top_k
    (0: none) and top_p (1.0: none)."""
    m, vocab = x.shape
    device = x.device
    has_k = [0 < k < vocab for k in top_k]
    needs = [k + TIE_MARGIN if on else CANDIDATES for k, on in zip(top_k, has_k, strict=True)]
    width = min(vocab, max(needs))
    logits, token_ids, by_value = _top(x, width)

    if any(has_k):
        # The k-th value, and every candidate tied with it, stays (as a mask of x < kth
        # would keep them); rows without top_k keep all their candidates.
        k_index = upload(
            [k - 1 if on else 0 for k, on in zip(top_k, has_k, strict=True)], torch.long, device
        )
        kth = logits.gather(1, k_index[:, None])
        kth.masked_fill_(upload([not on for on in has_k], torch.bool, device)[:, None], -torch.inf)
        logits.masked_fill_(logits < kth, -torch.inf)

    overflow: list[int] = []
    if any(p < 1.0 for p in top_p):
        mass = _row_log_mass(x, logits, has_k)
        probs = (logits - mass[:, None]).exp_()
        cum = probs.cumsum(dim=-1)
        # The first candidate has nothing before it, so it always survives; rows with
        # top_p = 1 are left out outright, since an fp32 cumsum may round past 1.0.
        p = upload(top_p, torch.float32, device)
        drop = (cum - probs) >= p[:, None]
        drop &= upload([q < 1.0 for q in top_p], torch.bool, device)[:, None]
        logits.masked_fill_(drop, -torch.inf)
        open_rows = [row for row in range(m) if top_p[row] < 1.0 and not has_k[row]]
        if open_rows and width < vocab:
            # The step's one read besides the sampled ids, and only on steps with such
            # rows: which of them the candidates do not cover.
            short = (cum[:, -1] < p).tolist()
            overflow = [row for row in open_rows if short[row]]
    # Back to token-id order for the draw.
    by_id = torch.empty_like(logits).scatter_(1, by_value, logits)
    return Candidates(by_id, token_ids, overflow)


def apply_top_p_full(x: torch.Tensor, top_p: list[float]) -> None:
    """Top-p over the whole vocabulary by a stable sort, in place on `x` ([m, vocab]
    logits, rows with top_p < 1 and no top_k): the fallback for `Candidates.overflow`."""
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
    sorted_probs = torch.softmax(sorted_x, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = mass_before >= upload(top_p, torch.float32, x.device)[:, None]
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    x.masked_fill_(drop, -torch.inf)


def _top(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `width` largest logits of each row in the stable sort's order (logit descending,
    ties by ascending id; topk leaves the order of ties to its implementation), their ids
    ascending, and where each of the first sits among the second."""
    values, ids = torch.topk(x, width, dim=-1)
    ids, by_id = ids.sort(dim=-1)
    values, by_value = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    return values, ids, by_value


def _row_log_mass(x: torch.Tensor, logits: torch.Tensor, has_k: list[bool]) -> torch.Tensor:
    """[m] log of each row's total mass after top-k: over its candidates for a top_k row
    (they are its whole support), over the full vocabulary otherwise."""
    if all(has_k):
        return torch.logsumexp(logits, dim=-1)
    full = torch.logsumexp(x, dim=-1)
    if not any(has_k):
        return full
    on = upload(has_k, torch.bool, x.device)
    return torch.where(on, torch.logsumexp(logits, dim=-1), full)
