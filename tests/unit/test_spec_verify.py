"""Speculative verification: greedy rows decode as plain greedy decoding, sampled rows keep
the target's distribution exactly (chi-square over seeded samples, and the same test
rejects a broken rule), seeded rows ignore their batch, and the edge cases of k."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

import gpu_worker.spec_decode.verify as verify_module
from gpu_worker.core.sequence import Sequence
from gpu_worker.sampling.sampler import Sampler, new_sampler_state
from gpu_worker.spec_decode.verify import DraftedRequest, VerifyOutput, verify
from shared.sampling import SamplingParams

CPU = torch.device("cpu")
SAMPLES = 20_000
CHI2_CRITICAL_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}
"""Chi-square critical values at p = 0.001 by degrees of freedom."""

# A 6-token target at three positions (token 5 impossible at the first, 3 at the second)
# and a drafter's distributions that disagree with it (q0 puts mass on token 5).
P = torch.tensor(
    [
        [0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
        [0.05, 0.15, 0.40, 0.00, 0.10, 0.30],
        [0.10, 0.10, 0.20, 0.25, 0.35, 0.00],
    ],
    dtype=torch.float32,
)
Q = torch.tensor(
    [
        [0.10, 0.30, 0.05, 0.25, 0.10, 0.20],
        [0.30, 0.10, 0.20, 0.20, 0.10, 0.10],
    ],
    dtype=torch.float32,
)
ONE_HOT_DRAFTS = [0, 2]
CORRECT_WEIGHTS = verify_module.correction_weights
_ids = itertools.count()


def _request(
    drafts: list[int], row: int, *, seed: int | None = None, position: int = 0, greedy: bool = False
) -> DraftedRequest:
    return DraftedRequest(
        draft_token_ids=drafts, target_row=row, is_greedy=greedy, seed=seed, position=position
    )


def _chi2(tokens: list[int], probs: torch.Tensor) -> float:
    """Pearson's statistic of `tokens` against `probs`; infinite when a token of
    probability 0 appears."""
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    expected = probs.double() * counts.sum()
    live = expected > 0
    if counts[~live].sum() > 0:
        return float("inf")
    return float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())


def _fits(tokens: list[int], probs: torch.Tensor) -> bool:
    degrees = int((probs > 0).sum()) - 1
    return _chi2(tokens, probs) < CHI2_CRITICAL_P001[degrees]


def _speculate(full_q: bool, samples: int = SAMPLES) -> VerifyOutput:
    """`samples` seeded requests, each drafting 2 tokens against P: the one-hot drafts, or
    drafts drawn from Q (the rule is exact only for drafts drawn from the q it is given)."""
    if full_q:
        gen = torch.Generator().manual_seed(7)
        drafts = torch.stack([torch.multinomial(q, samples, True, generator=gen) for q in Q], 1)
        draft_lists = drafts.tolist()
        draft_probs: torch.Tensor | None = Q.repeat(samples, 1)
    else:
        draft_lists = [ONE_HOT_DRAFTS] * samples
        draft_probs = None
    requests = [_request(d, 3 * i, seed=10_000 + i) for i, d in enumerate(draft_lists)]
    return verify(P.repeat(samples, 1), requests, draft_probs)


def _emitted_at(out: VerifyOutput, position: int) -> list[int]:
    """The token emitted at `position` by the requests that got that far, all of them
    having accepted every draft before it."""
    return [
        t[position] for t, n in zip(out.token_ids, out.num_accepted, strict=True) if n >= position
    ]


@pytest.mark.parametrize("full_q", [False, True], ids=["one-hot q", "full q"])
def test_sampled_tokens_follow_the_target_at_every_position(full_q: bool) -> None:
    out = _speculate(full_q)
    # Position 0 and 1 go through acceptance and correction; position 2 is the bonus.
    for position in range(3):
        emitted = _emitted_at(out, position)
        assert len(emitted) > 1_000, position
        chi2 = _chi2(emitted, P[position])
        degrees = int((P[position] > 0).sum()) - 1
        assert chi2 < CHI2_CRITICAL_P001[degrees], (position, chi2)


def _correction_from_p(
    p: torch.Tensor, rejected: torch.Tensor, draft_token: torch.Tensor, q: torch.Tensor | None
) -> torch.Tensor:
    return p


def _one_hot_residual(
    p: torch.Tensor, rejected: torch.Tensor, draft_token: torch.Tensor, q: torch.Tensor | None
) -> torch.Tensor:
    return CORRECT_WEIGHTS(p, rejected, draft_token, None)


def _accept_ignoring_q(u: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
    return u < p


def _argmax_draws(
    target: torch.Tensor, rows: torch.Tensor, requests: list[DraftedRequest]
) -> torch.Tensor:
    """A sampled row decided as if greedy: its draws ignore their uniforms."""
    return target.index_select(0, rows.reshape(-1)).argmax(dim=-1).view(rows.shape)


@pytest.mark.parametrize(
    ("full_q", "name", "wrong"),
    [
        (False, "_draw_every_position", _argmax_draws),
        (True, "correction_weights", _correction_from_p),
        (True, "correction_weights", _one_hot_residual),
        (True, "accepts", _accept_ignoring_q),
    ],
    ids=[
        "one-hot, draws ignore their uniforms",
        "full q, correction from p",
        "full q, residual as if one-hot",
        "full q, acceptance ignores q",
    ],
)
def test_the_chi_square_rejects_a_broken_rule(
    monkeypatch: pytest.MonkeyPatch, full_q: bool, name: str, wrong: Callable[..., torch.Tensor]
) -> None:
    # Fewer samples: each broken rule lands its chi-square in the hundreds.
    monkeypatch.setattr(verify_module, name, wrong)
    assert not _fits(_emitted_at(_speculate(full_q, samples=3_000), 0), P[0])


def _greedy_reference(logits: torch.Tensor, request: DraftedRequest) -> list[int]:
    """Plain greedy decoding by the sampler, one position at a time, following the drafts
    while they agree with it (the target's rows assume the drafts as context)."""
    sampler = Sampler(vocab_size=logits.shape[1], device=CPU, eos_token_ids=[])
    params = SamplingParams(temperature=0.0)
    state = Sequence(f"g{next(_ids)}", [1], params, sampler_state=new_sampler_state(params))
    tokens: list[int] = []
    for j in range(len(request.draft_token_ids) + 1):
        row = logits[request.target_row + j][None, :]
        token = sampler.sample(row, [state]).token_ids[0]
        tokens.append(token)
        if j == len(request.draft_token_ids) or request.draft_token_ids[j] != token:
            break
    return tokens


def test_greedy_rows_decode_as_plain_greedy_decoding() -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = 50
    ks = [0, 1, 3, 5, 5, 2, 4, 5]
    logits = torch.randn(sum(k + 1 for k in ks), vocab, generator=gen)
    logits[0, [7, 9]] = 100.0  # a tie: the first of them, as the sampler's argmax
    argmax = logits.argmax(dim=-1).tolist()
    requests = []
    row = 0
    for i, k in enumerate(ks):
        # The first i % (k + 1) drafts agree with the target, the rest are its argmax + 1.
        agree = i % (k + 1)
        drafts = [argmax[row + j] if j < agree else (argmax[row + j] + 1) % vocab for j in range(k)]
        requests.append(_request(drafts, row, greedy=True))
        row += k + 1
    out = verify(logits, requests)
    assert out.token_ids == [_greedy_reference(logits, r) for r in requests]
    assert out.num_accepted == [i % (k + 1) for i, k in enumerate(ks)]
    assert out.token_ids[0] == [7]


def _random_batch(
    gen: torch.Generator, vocab: int = 40
) -> tuple[torch.Tensor, torch.Tensor, list[DraftedRequest]]:
    """A mixed batch: seeded, unseeded and greedy requests of k in 0..4, with their target
    probabilities and drafter distributions (drafts drawn from the latter)."""
    ks = [3, 0, 4, 1, 2, 4, 0, 3]
    target = torch.softmax(2 * torch.randn(sum(k + 1 for k in ks), vocab, generator=gen), dim=-1)
    q = torch.softmax(2 * torch.randn(sum(ks), vocab, generator=gen), dim=-1)
    requests = []
    row = draft_row = 0
    for i, k in enumerate(ks):
        drafts = [int(torch.multinomial(q[draft_row + j], 1, generator=gen)) for j in range(k)]
        kind = i % 3
        requests.append(
            _request(
                drafts, row, seed=100 + i if kind == 0 else None, position=5 * i, greedy=kind == 2
            )
        )
        row += k + 1
        draft_row += k
    return target, q, requests


def _repack(
    target: torch.Tensor, q: torch.Tensor, requests: list[DraftedRequest], order: list[int]
) -> tuple[torch.Tensor, list[DraftedRequest], torch.Tensor]:
    """verify's arguments for the requests `order` names, in that order, their rows copied
    into new tensors."""
    draft_starts = list(itertools.accumulate((len(r.draft_token_ids) for r in requests), initial=0))
    target_rows: list[torch.Tensor] = []
    draft_rows: list[torch.Tensor] = []
    moved = []
    row = 0
    for i in order:
        r = requests[i]
        k = len(r.draft_token_ids)
        target_rows.append(target[r.target_row : r.target_row + k + 1])
        draft_rows.append(q[draft_starts[i] : draft_starts[i] + k])
        moved.append(DraftedRequest(r.draft_token_ids, row, r.is_greedy, r.seed, r.position))
        row += k + 1
    return torch.cat(target_rows), moved, torch.cat(draft_rows)


def test_seeded_and_greedy_requests_do_not_depend_on_their_batch() -> None:
    target, q, requests = _random_batch(torch.Generator().manual_seed(11))
    before = (target.clone(), q.clone())
    torch.manual_seed(0)
    together = verify(target, requests, q).token_ids
    assert torch.equal(target, before[0])
    assert torch.equal(q, before[1])
    n = len(requests)
    # Each request alone, then all in reverse order (other rows, other neighbours); the
    # unseeded ones draw differently, from another state of torch's generator.
    torch.manual_seed(1)
    alone = [verify(*_repack(target, q, requests, [i])).token_ids[0] for i in range(n)]
    torch.manual_seed(2)
    backwards = verify(*_repack(target, q, requests, list(range(n))[::-1])).token_ids[::-1]
    reproducible = [i for i, r in enumerate(requests) if r.seed is not None or r.is_greedy]
    assert len(reproducible) < n
    for i in reproducible:
        assert alone[i] == together[i] == backwards[i], i


def test_seeds_decide_the_tokens() -> None:
    """The same request under 200 seeds emits more than one sequence, and each seed the
    same one twice."""
    row = torch.full((1, 6), 1 / 6)
    target = row.repeat(3, 1)
    requests = [_request([1, 2], 0, seed=s, position=4) for s in range(200)]
    outs = [verify(target, [r]).token_ids[0] for r in requests]
    assert outs == [verify(target, [r]).token_ids[0] for r in requests]
    assert len({tuple(o) for o in outs}) > 10
    moved = [
        verify(target, [_request([1, 2], 0, seed=s, position=5)]).token_ids[0] for s in range(200)
    ]
    assert moved != outs


def test_without_drafts_a_seeded_request_draws_as_the_sampler() -> None:
    """The bonus at a position takes the sampler's own uniform there, so a step without
    drafts continues a seeded request's stream as a step without speculation would."""
    logits = torch.randn(1, 6, generator=torch.Generator().manual_seed(2))
    target = torch.softmax(logits, dim=-1)
    sampler = Sampler(vocab_size=6, device=CPU, eos_token_ids=[])
    expected, got = [], []
    for seed in range(200):
        params = SamplingParams(seed=seed)
        state = Sequence(f"s{next(_ids)}", [1], params, sampler_state=new_sampler_state(params))
        state.output_token_ids.extend([3] * (seed % 7))
        expected.append(sampler.sample(logits, [state]).token_ids[0])
        got.append(verify(target, [_request([], 0, seed=seed, position=seed % 7)]).token_ids[0][0])
    assert got == expected
    assert len(set(got)) > 3


def test_with_deterministic_drafts_a_seeded_request_emits_its_tokens_without_them() -> None:
    """One-hot drafts are tested against each position's own draw, so whatever the drafts
    (all right, some right, none), the emitted tokens are the ones the request draws with
    no speculation: its seeded output cannot depend on what a drafter proposed."""
    target = torch.softmax(torch.randn(5, 6, generator=torch.Generator().manual_seed(4)), dim=-1)
    plain = []
    for j in range(5):  # one token a step, no drafts: the sampler's stream
        [token] = verify(target[j : j + 1], [_request([], 0, seed=9, position=30 + j)]).token_ids
        plain += token
    drafts_tried = [
        plain[:4],
        [plain[0], (plain[1] + 1) % 6, plain[2], plain[3]],
        [(plain[0] + 1) % 6] * 4,
        plain[:2],
    ]
    for drafts in drafts_tried:
        out = verify(target, [_request(drafts, 0, seed=9, position=30)])
        emitted = out.token_ids[0]
        assert emitted == plain[: len(emitted)], drafts
    assert verify(target, [_request(plain[:4], 0, seed=9, position=30)]).num_accepted == [4]


def test_no_drafts_emits_one_token_from_the_first_row() -> None:
    target = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.1, 0.2, 0.3, 0.4]])
    out = verify(target, [_request([], 0, seed=1), _request([], 1, greedy=True)])
    assert out.num_accepted == [0, 0]
    assert out.token_ids == [[2], [3]]
    assert verify(target, []) == VerifyOutput(num_accepted=[], token_ids=[])


@pytest.mark.parametrize("full_q", [False, True], ids=["one-hot q", "full q"])
def test_a_draft_the_target_cannot_emit_is_rejected_and_never_the_correction(
    full_q: bool,
) -> None:
    # Drafts [0, 1, 2]: p(0) = 1 at row 0, p(1) = 0 at row 1.
    target = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.0, 0.5], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.4, 0.3, 0.3], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8]]) if full_q else None
    out = verify(
        target.repeat(100, 1),
        [_request([0, 1, 2], 4 * s, seed=s) for s in range(100)],
        None if q is None else q.repeat(100, 1),
    )
    assert out.num_accepted == [1] * 100
    assert {t[1] for t in out.token_ids} == {0, 2}


def test_all_rejected_and_all_accepted() -> None:
    # Row 0 rules out draft 1; rows 2..4 are certain of drafts 0, 1, then a bonus of 2.
    target = torch.tensor(
        [[0.5, 0.0, 0.5], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    )
    rejected = [_request([1, 1], 0, seed=s) for s in range(50)]
    accepted = [_request([0, 1], 2, seed=s) for s in range(50)] + [_request([0, 1], 2)]
    out = verify(target, rejected + accepted)
    assert out.num_accepted == [0] * 50 + [2] * 51
    assert {t[0] for t in out.token_ids[:50]} == {0, 2}
    assert out.token_ids[50:] == [[0, 1, 2]] * 51


def test_a_drafter_that_agrees_with_the_target_is_always_accepted() -> None:
    gen = torch.Generator().manual_seed(5)
    target = torch.softmax(torch.randn(4, 8, generator=gen), dim=-1)
    requests = [_request([3, 1, 6], 0, seed=s) for s in range(100)]
    out = verify(target, requests, target[:3].repeat(100, 1))
    assert out.num_accepted == [3] * 100


def test_greedy_and_sampled_rows_mix() -> None:
    target = torch.tensor(
        [[0.1, 0.6, 0.3], [0.7, 0.2, 0.1], [0.2, 0.2, 0.6], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    )
    greedy_hit = _request([1, 0], 0, greedy=True)  # both argmaxes: accepted, then bonus 2
    greedy_miss = _request([2], 0, greedy=True)  # not the argmax 1: corrected to it
    sure = _request([1], 3, seed=9)  # certain of its draft, then of its bonus 2
    unsure = _request([0], 0)  # unseeded, p(0) = 0.1
    out = verify(target, [greedy_hit, sure, greedy_miss, unsure])
    assert out.token_ids[:3] == [[1, 0, 2], [1, 2], [1]]
    assert out.num_accepted[:3] == [2, 1, 0]
    assert out.token_ids[3] in ([0, 0], [0, 1], [0, 2], [1], [2])
