"""One random draw per row: inverse-CDF sampling from a uniform per row.

A row's token is the first whose cumulative weight passes u x total, the weights exp(logit
- max). The sums run in blocks of `BLOCK` tokens: fp32 inside a block, fp64 across blocks,
so no token's odds shift with its place in a 128k vocabulary (as one fp32 sum over it
would shift them), at a fraction of an fp64 sum's cost; a weight of 0, a token cut by any
filter, is never picked. A row needs one uniform, not one per vocabulary entry as a race
of exponentials does, so every row of the batch draws in one call:
- unseeded rows take theirs from torch's generator on the device;
- a seeded row's is a counter-based hash of (seed, number of tokens it has generated),
  computed on the host. It depends on nothing else, so the request's tokens are the same
  whatever shares its batch, and a preempted request that recomputes draws the same again.
"""

from __future__ import annotations

import torch

from gpu_worker.sampling.upload import upload

_MASK64 = (1 << 64) - 1
BLOCK = 1024
"""Tokens per fp32 partial sum of the CDF."""


def _mix64(z: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit ints whose every output bit depends
    on every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) for draw number `position` of the request seeded with `seed`."""
    key = _mix64((_mix64(seed & _MASK64) + position * 0x9E3779B97F4A7C15) & _MASK64)
    return (key >> 11) * 2.0**-53


def uniforms(seeds: list[int | None], positions: list[int], device: torch.device) -> torch.Tensor:
    """[m] fp64 uniforms: `seeded_uniform(seed, position)` for seeded rows, torch's
    generator for the others."""
    seeded = [(row, seed) for row, seed in enumerate(seeds) if seed is not None]
    values = [seeded_uniform(seed, positions[row]) for row, seed in seeded]
    if len(seeded) == len(seeds):
        return upload(values, torch.float64, device)
    u = torch.rand(len(seeds), dtype=torch.float64, device=device)
    if seeded:
        rows = upload([row for row, _ in seeded], torch.long, device)
        u.index_copy_(0, rows, upload(values, torch.float64, device))
    return u


def draw(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[m] index into each row of `logits` ([m, width], -inf for tokens that may not be
    drawn), drawn with probability softmax(row) by `u`. A row without a distribution (no
    finite logit, a +inf or a NaN: filters or a logit bias that left nothing, overflowed
    scaling) takes its argmax instead, so one odd request never indexes past its row."""
    m, width = logits.shape
    size = min(BLOCK, width)
    blocks = -(-width // size)
    # Written straight into a buffer of whole blocks, the tail zeros: a pad would copy.
    weights = torch.empty(m, blocks * size, dtype=torch.float32, device=logits.device)
    weights[:, width:] = 0.0
    torch.sub(logits, logits.amax(dim=-1, keepdim=True), out=weights[:, :width]).exp_()
    inner = weights.view(m, blocks, size).cumsum(dim=-1)
    ends = inner[:, :, -1].double().cumsum(dim=-1)
    total = ends[:, -1:]
    # u < 1, but u x total may round up to total; then no entry would pass it, so the
    # target stays strictly below the last one that adds weight (twice: across blocks in
    # fp64, then inside the block in fp32).
    target = torch.minimum(u[:, None] * total, _below(total))
    # Only a row whose total is not a positive finite number (see above) can pass the end.
    block = torch.searchsorted(ends, target, right=True).clamp_max_(blocks - 1)
    before = torch.where(block > 0, ends.gather(1, (block - 1).clamp_min(0)), 0.0)
    cdf = inner.gather(1, block[:, :, None].expand(m, 1, size)).squeeze(1)
    local = torch.minimum((target - before).float(), _below(cdf[:, -1:]))
    drawn = (block * size + torch.searchsorted(cdf, local, right=True)).squeeze(1)
    has_distribution = ((total > 0) & torch.isfinite(total)).squeeze(1)
    return torch.where(has_distribution, drawn, logits.argmax(dim=-1))


def _below(t: torch.Tensor) -> torch.Tensor:
    """The largest values below `t` (t > 0)."""
    return torch.nextafter(t, torch.zeros_like(t))
