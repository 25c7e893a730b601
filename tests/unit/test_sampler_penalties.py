"""Penalties from persistent rows: over many steps, joins, leaves and preemptions, the
same logits as counting every token of every row afresh (the sampler's old dense way)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from gpu_worker.core.sequence import Sequence
from gpu_worker.sampling.penalties import has_penalty
from gpu_worker.sampling.sampler import Sampler, new_sampler_state
from shared.sampling import SamplingParams

CPU = torch.device("cpu")
VOCAB = 40


def _seq(request_id: str, rng: random.Random, **params: Any) -> Sequence:
    sampling = SamplingParams(temperature=0.0, **params)
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
    return Sequence(request_id, prompt, sampling, sampler_state=new_sampler_state(sampling))


def _dense_reference(x: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Every row's counts built from all its tokens, as the sampler did before."""
    out = x.clone()
    for row, seq in enumerate(seqs):
        p = seq.sampling
        if not has_penalty(p):
            continue
        counts = torch.zeros(VOCAB)
        for token in seq.output_token_ids:
            counts[token] += 1
        seen = counts > 0
        if p.repetition_penalty != 1.0:
            prompt_seen = torch.zeros(VOCAB, dtype=torch.bool)
            prompt_seen[seq.prompt_token_ids] = True
            rep = p.repetition_penalty
            penalized = torch.where(out[row] > 0, out[row] / rep, out[row] * rep)
            out[row] = torch.where(seen | prompt_seen, penalized, out[row])
        out[row] -= p.frequency_penalty * counts + p.presence_penalty * seen
    return out


def _step(sampler: Sampler, seqs: list[Sequence], rng: random.Random) -> None:
    """Penalize one step's logits, check them against the reference, then append a token."""
    x = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(rng.randrange(99)))
    expected = _dense_reference(x, seqs)
    rows = [row for row, s in enumerate(seqs) if has_penalty(s.sampling)]
    sampler.penalties.apply(x, rows, [seqs[row] for row in rows])
    assert torch.allclose(x, expected, atol=1e-6), (x - expected).abs().max()
    for seq in seqs:
        # A few tokens from a small set, so counts above one are common.
        seq.append_token(rng.randrange(8) if rng.random() < 0.7 else rng.randrange(VOCAB))


def test_persistent_counts_match_the_dense_reference_through_joins_and_leaves() -> None:
    rng = random.Random(0)
    sampler = Sampler(VOCAB, CPU, eos_token_ids=[1])
    kinds: list[dict[str, float]] = [
        {"repetition_penalty": 1.7},
        {"frequency_penalty": 0.4},
        {"presence_penalty": -0.6},
        {"repetition_penalty": 0.6, "frequency_penalty": -0.3, "presence_penalty": 0.5},
        {},
    ]
    seqs = [_seq(f"a{i}", rng, **kind) for i, kind in enumerate(kinds)]
    for _ in range(5):
        _step(sampler, seqs, rng)
    assert sampler.penalties.num_live == 4  # the unpenalized request holds no row

    # One finishes, one is preempted (its row is freed too); a new request joins and
    # takes a freed row, which must start from its own tokens, not the old owner's.
    done, preempted = seqs[1], seqs[3]
    sampler.release([done.request_id, preempted.request_id, "never-sampled"])
    assert sampler.penalties.num_live == 2
    joined = _seq("b0", rng, frequency_penalty=1.0, presence_penalty=0.2)
    seqs = [seqs[0], seqs[2], joined, seqs[4]]
    for _ in range(3):
        _step(sampler, seqs, rng)
    # The preempted request comes back with its output so far: a fresh row, rebuilt.
    seqs.insert(1, preempted)
    for _ in range(4):
        _step(sampler, seqs, rng)
    assert sampler.penalties.num_live == 4
    # Rows come back and are reused: never more than the live requests needed at once.
    assert sampler.penalties.subtract.shape[0] == 8


def test_rows_grow_past_the_first_allocation_and_keep_their_counts() -> None:
    rng = random.Random(1)
    sampler = Sampler(VOCAB, CPU, eos_token_ids=[1])
    seqs = [_seq(f"g{i}", rng, frequency_penalty=0.5, repetition_penalty=1.3) for i in range(5)]
    for _ in range(3):
        _step(sampler, seqs, rng)
    seqs += [_seq(f"h{i}", rng, presence_penalty=0.5) for i in range(7)]  # 12 rows > 8
    for _ in range(3):
        _step(sampler, seqs, rng)
    assert sampler.penalties.subtract.shape[0] == 16


def test_a_new_request_under_a_finished_ones_id_starts_fresh() -> None:
    # Without a release (a caller that does not call it, or an id reused at once), the
    # row follows the request's state, not its id.
    rng = random.Random(2)
    sampler = Sampler(VOCAB, CPU, eos_token_ids=[1])
    old = _seq("same", rng, frequency_penalty=2.0)
    for _ in range(3):
        _step(sampler, [old], rng)
    new = _seq("same", rng, frequency_penalty=2.0)
    _step(sampler, [new], rng)
    assert sampler.penalties.num_live == 1


@pytest.mark.parametrize("greedy", [True, False])
def test_penalties_steer_sampling_over_steps(greedy: bool) -> None:
    # Through `sample`: a strong presence penalty walks a flat row through distinct
    # tokens, one per step, as each sampled token is counted at the next step.
    sampler = Sampler(VOCAB, CPU, eos_token_ids=[1])
    params = SamplingParams(temperature=0.0 if greedy else 0.002, presence_penalty=2.0, seed=3)
    seq = Sequence("walk", [0], params, sampler_state=new_sampler_state(params))
    logits = torch.linspace(1.0, 0.0, VOCAB)[None]  # token 0 most likely, then 1, ...
    for _ in range(6):
        seq.append_token(sampler.sample(logits, [seq]).token_ids[0])
    # A one-logit spread minus 2.0 sinks every seen token below all unseen ones.
    assert seq.output_token_ids == [0, 1, 2, 3, 4, 5]
