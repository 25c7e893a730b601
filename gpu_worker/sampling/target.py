"""The distribution a sampled row draws from, as full-vocabulary probabilities.

Speculative decoding verifies drafts against the target's probabilities
(`gpu_worker.spec_decode.verify`), so they must be the sampler's own processing of a row:
temperature, then min-p, top-k and top-p as `Sampler._sample_random` applies them (top-k
keeps every token tied with the k-th value; top-p keeps the smallest head, in stable
descending order, whose mass after top-k reaches top_p). The sampler draws over a
bounded candidate set for speed; here every row is sorted over the whole vocabulary,
which only the few rows of a verify step pay for.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpu_worker.sampling.upload import upload
from shared.sampling import SamplingParams


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
