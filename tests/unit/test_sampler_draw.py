"""One draw per row in one call: the inverse CDF picks only allowed tokens, seeded
uniforms are reproducible and uniform, and a seeded request's tokens do not depend on
its batch, even where the candidate set's width (set by other rows) changes."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

import gpu_worker.sampling.draw as draw_module
from gpu_worker.core.sequence import Sequence
from gpu_worker.sampling.draw import draw, seeded_uniform
from gpu_worker.sampling.sampler import Sampler, new_sampler_state
from gpu_worker.sampling.top_k_top_p import CANDIDATES, top_k_top_p
from shared.sampling import SamplingParams

CPU = torch.device("cpu")
_ids = itertools.count()


def _seq(output: list[int] | None = None, **params: Any) -> Sequence:
    sampling = SamplingParams(**params)
    seq = Sequence(f"d{next(_ids)}", [1, 2], sampling, sampler_state=new_sampler_state(sampling))
    seq.output_token_ids.extend(output or [])
    return seq


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    live = expected > 0
    assert counts[~live].sum() == 0
    return float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())


def test_draw_picks_only_finite_tokens_even_at_the_ends_of_u() -> None:
    logits = torch.tensor([[-torch.inf, 1.0, -torch.inf, 0.0, -torch.inf]] * 3)
    u = torch.tensor([0.0, 0.5, 1.0 - 2.0**-53], dtype=torch.float64)
    # Weights e^0 = 1 and e^-1: token 1 holds the first 0.731 of the mass.
    assert draw(logits, u).tolist() == [1, 1, 3]


@pytest.mark.parametrize("width", [48, 3000])  # one block, several blocks
def test_a_row_without_a_distribution_takes_its_argmax_beside_normal_rows(width: int) -> None:
    """No finite logit, a +inf, a NaN: such a row has no softmax to draw from (the worker
    once indexed past the row and died on one); it takes its argmax, in range, and the
    normal rows of the batch draw as they would alone."""
    normal = torch.randn(2, width)
    odd = torch.full((3, width), float("-inf"))
    odd[1, 7], odd[2, 5] = float("inf"), float("nan")
    logits = torch.cat([normal[:1], odd, normal[1:]])
    u = torch.tensor([0.3, 0.999, 0.5, 0.0, 0.7], dtype=torch.float64)
    tokens = draw(logits, u)
    assert tokens[1:4].tolist() == [0, 7, 5]
    alone = draw(normal, u[[0, 4]])
    assert tokens[[0, 4]].tolist() == alone.tolist()


def test_draw_maps_a_grid_of_u_onto_the_softmax_across_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 2.5 blocks (the last one padded; small blocks keep the grid cheap): u on an even
    # grid lands on each token as often as its probability, to within one grid step, and
    # never on a masked token.
    monkeypatch.setattr(draw_module, "BLOCK", 16)
    width = 40
    logits = torch.randn(1, width, generator=torch.Generator().manual_seed(5)) * 2
    logits[0, ::7] = -torch.inf
    grid = 100_000
    u = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    picks = draw(logits.expand(grid, width), u)
    freq = torch.bincount(picks, minlength=width).double() / grid
    probs = torch.softmax(logits[0].double(), -1)
    assert freq[::7].sum() == 0
    assert (freq - probs).abs().max() <= 1.0 / grid + 1e-6
    assert picks.tolist() == sorted(picks.tolist())  # the CDF is monotone in u


def test_seeded_uniforms_are_reproducible_and_uniform() -> None:
    assert seeded_uniform(7, 3) == seeded_uniform(7, 3)
    assert seeded_uniform(7, 3) != seeded_uniform(7, 4) != seeded_uniform(8, 3)
    # One seed along its positions, and one position across seeds: 20 equal bins each.
    for values in (
        [seeded_uniform(12345, p) for p in range(4000)],
        [seeded_uniform(s, 0) for s in range(4000)],
    ):
        assert all(0.0 <= v < 1.0 for v in values)
        counts = torch.bincount((torch.tensor(values) * 20).long(), minlength=20).double()
        # p = 0.001 for 19 degrees of freedom: 43.8.
        assert _chi2(counts, torch.full((20,), 0.05)) < 43.8


def test_seeded_draws_follow_the_distribution() -> None:
    # 4000 requests in one batch, each its own seed, or one seed at 4000 positions.
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.5])
    probs = torch.softmax(row / 0.7, -1)
    for seqs in (
        [_seq(temperature=0.7, seed=s) for s in range(4000)],
        [_seq([0] * p, temperature=0.7, seed=99) for p in range(4000)],
    ):
        out = Sampler(8, CPU, eos_token_ids=[7]).sample(row.expand(4000, 8).clone(), seqs)
        counts = torch.bincount(torch.tensor(out.token_ids), minlength=8).double()
        assert _chi2(counts, probs) < 26.1  # p = 0.001, 7 degrees of freedom


def _seeded_tokens(
    neighbours: list[dict[str, Any]],
    row: int,
    steps: int = 8,
    vocab: int = 2 * CANDIDATES,
    scale: float = 3.0,
) -> list[int]:
    """A seeded top-p request's tokens at `row` among `neighbours`, on tied (bf16) logits
    N(0, scale^2) over a vocabulary wider than the candidate set."""
    target = _seq(temperature=1.0, top_p=0.9, seed=2024)
    sampler = Sampler(vocab, CPU, eos_token_ids=[0])
    tokens = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        logits = (torch.randn(len(neighbours) + 1, vocab, generator=gen) * 3).bfloat16().float()
        mine = (torch.randn(vocab, generator=gen.manual_seed(100 + step)) * scale).bfloat16()
        seqs = [_seq(**params) for params in neighbours]
        seqs.insert(row, target)
        logits[row] = mine.float()
        token = sampler.sample(logits, seqs).token_ids[row]
        target.output_token_ids.append(token)
        tokens.append(token)
    return tokens


def test_a_seeded_request_ignores_its_batch_and_the_candidate_width() -> None:
    alone = _seeded_tokens([], 0)
    assert len(set(alone)) > 4
    assert _seeded_tokens([], 0) == alone
    neighbours: list[list[dict[str, Any]]] = [
        [{"temperature": 0.0}, {"temperature": 1.0}],
        [{"top_k": 1900}, {"temperature": 0.5, "seed": 1}],  # 1900 candidates, not 1024
        [{"top_p": 0.999, "temperature": 5.0}],  # a flat row: the full-sort fallback
        [{"top_k": 3, "top_p": 0.5, "seed": 2024}, {"min_p": 0.2}, {"presence_penalty": 1.0}],
    ]
    for i, others in enumerate(neighbours):
        assert _seeded_tokens(others, i % (len(others) + 1)) == alone, others


def test_a_seeded_row_draws_the_same_whether_or_not_it_falls_back() -> None:
    # Flatter logits: 1,024 candidates hold less than 0.9 of a row's mass, the 1,964 that
    # a top_k = 1900 neighbour brings hold more. Alone, the row takes the full sort;
    # beside that neighbour, its candidates: the same tokens either way.
    vocab, scale = 4 * CANDIDATES, 1.6
    row = (torch.randn(1, vocab, generator=torch.Generator().manual_seed(100)) * scale).bfloat16()
    assert top_k_top_p(row.float(), [0], [0.9]).overflow == [0]
    assert top_k_top_p(row.float().expand(2, vocab), [0, 1900], [0.9, 1.0]).overflow == []
    alone = _seeded_tokens([], 0, vocab=vocab, scale=scale)
    assert len(set(alone)) > 4
    assert _seeded_tokens([{"top_k": 1900}], 0, vocab=vocab, scale=scale) == alone
