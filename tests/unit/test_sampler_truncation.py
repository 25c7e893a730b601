"""Top-k / top-p on the candidate set keep exactly the tokens the full stable sort keeps,
including rows whose nucleus needs more than the candidates (the fallback)."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.sampling.top_k_top_p import (
    CANDIDATES,
    apply_top_p_full,
    needs_truncation,
    top_k_top_p,
)

VOCAB = 3 * CANDIDATES


def _full_sort_reference(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """[m, vocab] bool of the kept tokens, the sampler's old way: mask below the k-th
    value, then a stable sort of the whole vocabulary for the nucleus."""
    x = x.clone()
    for row, k in enumerate(top_k):
        if 0 < k < x.shape[1]:
            kth = torch.topk(x[row], k).values[-1]
            x[row].masked_fill_(x[row] < kth, -torch.inf)
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_x, dim=-1)
    drop_sorted = (probs.cumsum(-1) - probs) >= torch.tensor(top_p)[:, None]
    drop_sorted &= torch.tensor([p < 1.0 for p in top_p])[:, None]
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return x.masked_fill(drop, -torch.inf).isfinite()


def _kept(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> tuple[torch.Tensor, list[int]]:
    """The kept mask as the sampler builds it: rows that need no truncation keep every
    token; the others go through the candidates and, for overflow rows, the fallback."""
    cut = [r for r in range(len(top_k)) if needs_truncation(top_k[r], top_p[r], VOCAB)]
    candidates = top_k_top_p(x[cut].clone(), [top_k[r] for r in cut], [top_p[r] for r in cut])
    kept = torch.ones_like(x, dtype=torch.bool)
    finite = candidates.logits.isfinite()
    kept[cut] = torch.zeros_like(x[cut], dtype=torch.bool).scatter_(1, candidates.token_ids, finite)
    # Kept candidates carry their own logits, untouched.
    assert torch.equal(candidates.logits[finite], x[cut].gather(1, candidates.token_ids)[finite])
    overflow = [cut[i] for i in candidates.overflow]
    for row in overflow:
        wide = x[row : row + 1].clone()
        apply_top_p_full(wide, [top_p[row]])
        kept[row] = wide[0].isfinite()
    return kept, overflow


def _logits(scales: list[float], seed: int = 0) -> torch.Tensor:
    """One row per scale: a large scale makes a peaked row (a short nucleus), a small one
    a flat row whose nucleus runs past the candidates."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randn(VOCAB, generator=gen) * s for s in scales])


@pytest.mark.parametrize(
    ("top_k", "top_p", "overflow"),
    [
        ([50, 1, 0, 2000, VOCAB, 7], [1.0] * 6, []),
        ([0] * 6, [0.9, 0.5, 0.99, 0.6, 1.0, 0.95], [3, 5]),
        # K = 2500 here (the largest top_k), so flat row 3 needs a higher top_p to overflow.
        ([40, 0, 2500, 0, 3, 0], [0.8, 0.9, 0.95, 0.99, 0.5, 1.0], [3]),
    ],
    ids=["top-k", "top-p", "both"],
)
def test_candidates_keep_what_the_full_sort_keeps(
    top_k: list[int], top_p: list[float], overflow: list[int]
) -> None:
    # Rows 3 and 5 are flat: their nucleus runs past the candidates.
    x = _logits([5.0, 8.0, 4.0, 0.5, 6.0, 0.3])
    kept, fell_back = _kept(x, top_k, top_p)
    assert torch.equal(kept, _full_sort_reference(x, top_k, top_p))
    assert fell_back == overflow


def test_ties_at_the_boundaries_are_kept_or_cut_as_the_stable_sort_does() -> None:
    # bf16-rounded logits tie often; the k-th value's ties all stay, and the nucleus cuts
    # ties in id order, whatever order topk returned them in.
    x = _logits([3.0, 3.0, 3.0], seed=1).to(torch.bfloat16).float()
    top_k, top_p = [100, 0, 30], [1.0, 0.7, 0.9]
    kept, _ = _kept(x, top_k, top_p)
    assert torch.equal(kept, _full_sort_reference(x, top_k, top_p))
    assert int(kept[0].sum()) >= 100


def test_the_candidates_of_a_row_do_not_depend_on_the_other_rows() -> None:
    # K follows the batch's largest top_k; a row's kept tokens, their logits and their
    # order (token ids ascending) must not change with it, ties included.
    x = _logits([5.0], seed=2).to(torch.bfloat16).float()
    # Five more tokens tied with the 50th value: the tie straddles top_k = 50.
    x[0, [7, 300, 1200, 2000, 3000]] = x[0].topk(50).values[-1]
    for top_k, top_p in ((0, 0.9), (50, 1.0), (50, 0.8)):
        alone = top_k_top_p(x.clone(), [top_k], [top_p])
        beside = top_k_top_p(torch.cat([x, x]), [top_k, 2900], [top_p, 1.0])
        kept_alone = alone.logits[0].isfinite()
        kept_beside = beside.logits[0].isfinite()
        assert int(kept_alone.sum()) > 1
        ids = alone.token_ids[0, kept_alone]
        assert ids.tolist() == sorted(ids.tolist())
        assert torch.equal(ids, beside.token_ids[0, kept_beside])
        assert torch.equal(alone.logits[0, kept_alone], beside.logits[0, kept_beside])
