"""The sampler before issue 18, kept as bench/sampler.py's baseline: `BaselineSampler`
(top-k by a mask of the whole vocabulary, top-p by its stable sort, an exponential race
whose seeded rows draw from their own generators) and its `DensePenalties`."""

from __future__ import annotations

from collections.abc import Sequence as Rows

import torch

from gpu_worker.sampling.sampler import Sampler, SamplingRequest
from gpu_worker.sampling.upload import upload


class DensePenalties:
    """The baseline's penalties: a dense [n, vocab] count table rebuilt each step from
    every output token of every penalized row, and a stack of cached prompt masks."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._prompt_masks: dict[str, torch.Tensor] = {}

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._prompt_masks.pop(request_id, None)

    def apply(
        self, x: torch.Tensor, batch_rows: list[int], requests: list[SamplingRequest]
    ) -> None:
        n, vocab = x.shape
        rows: list[int] = []
        cols: list[int] = []
        for row, s in zip(batch_rows, requests, strict=True):
            rows.extend([row] * len(s.output_token_ids))
            cols.extend(s.output_token_ids)
        counts = torch.zeros(n, vocab, dtype=torch.float32, device=x.device)
        if rows:
            index = (upload(rows, torch.long, self.device), upload(cols, torch.long, self.device))
            counts.index_put_(index, torch.ones(len(rows), device=x.device), accumulate=True)
        in_output = counts > 0
        rep, freq, presence = [1.0] * n, [0.0] * n, [0.0] * n
        for row, s in zip(batch_rows, requests, strict=True):
            rep[row] = s.sampling.repetition_penalty
            freq[row] = s.sampling.frequency_penalty
            presence[row] = s.sampling.presence_penalty
        if any(r != 1.0 for r in rep):
            masks = [torch.zeros(vocab, dtype=torch.bool, device=x.device)] * n
            for row, s in zip(batch_rows, requests, strict=True):
                if rep[row] != 1.0:
                    masks[row] = self._prompt_mask(s)
            seen = torch.stack(masks) | in_output
            penalty = upload(rep, torch.float32, self.device)[:, None].expand(n, vocab)
            penalized = torch.where(x > 0, x / penalty, x * penalty)
            x.copy_(torch.where(seen, penalized, x))
        f = upload(freq, torch.float32, self.device)
        p = upload(presence, torch.float32, self.device)
        x.sub_(f[:, None] * counts + p[:, None] * in_output)

    def _prompt_mask(self, request: SamplingRequest) -> torch.Tensor:
        mask = self._prompt_masks.get(request.request_id)
        if mask is None:
            mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            mask[upload(request.prompt_token_ids, torch.long, self.device)] = True
            self._prompt_masks[request.request_id] = mask
        return mask


class BaselineSampler(Sampler):
    """The sampler before issue 18: `DensePenalties`; top-k by a mask of the whole
    vocabulary and top-p by its stable sort; an exponential race over the vocabulary whose
    seeded rows draw one by one from their own `torch.Generator`. What issue 18 left alone
    (masks, bias, logprobs) is the current code, so the two differ only where it changed."""

    def __init__(self, vocab_size: int, device: torch.device, eos_token_ids: list[int]) -> None:
        super().__init__(vocab_size, device, eos_token_ids)
        self.penalties = DensePenalties(vocab_size, self.device)  # type: ignore[assignment]
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, request: SamplingRequest) -> torch.Generator | None:
        seed = request.sampling.seed
        if seed is None:
            return None
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self._generators[request.request_id] = generator
        return generator

    def _sample_random(self, x: torch.Tensor, states: Rows[SamplingRequest]) -> torch.Tensor:
        params = [s.sampling for s in states]
        x = x / self._upload([p.temperature for p in params], torch.float32)[:, None]
        min_p = [p.min_p for p in params]
        if any(m > 0.0 for m in min_p):
            probs = torch.softmax(x, dim=-1)
            floor = self._upload(min_p, torch.float32)[:, None] * probs.amax(-1, keepdim=True)
            x.masked_fill_(probs < floor, float("-inf"))
        top_k = [p.top_k if 0 < p.top_k < self.vocab_size else 0 for p in params]
        if any(top_k):
            values = torch.topk(x, max(top_k), dim=-1).values
            kth = values.gather(
                1, self._upload([max(k, 1) - 1 for k in top_k], torch.long)[:, None]
            )
            kth.masked_fill_(self._upload([k == 0 for k in top_k], torch.bool)[:, None], -torch.inf)
            x.masked_fill_(x < kth, float("-inf"))
        top_p = [p.top_p for p in params]
        if any(p < 1.0 for p in top_p):
            sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
            sorted_probs = torch.softmax(sorted_x, dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop_sorted = mass_before >= self._upload(top_p, torch.float32)[:, None]
            drop_sorted &= self._upload([p < 1.0 for p in top_p], torch.bool)[:, None]
            drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
            x.masked_fill_(drop, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        q = torch.ones_like(probs)
        generators = [self._generator(s) for s in states]
        if any(g is None for g in generators):
            _exponential_(q)
        for row, generator in enumerate(generators):
            if generator is not None:
                q[row] = _exponential_(torch.empty(x.shape[1], device=x.device), generator)
        q.clamp_min_(torch.finfo(torch.float32).tiny)
        return (probs / q).max(dim=-1).indices


def _exponential_(t: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    return t.uniform_(generator=generator).neg_().log1p_().neg_()
