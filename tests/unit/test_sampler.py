"""Sampler: each processing step against a hand-computed or softmax reference, on CPU."""

from __future__ import annotations

import itertools

import pytest
import torch

from gpu_worker.core.sequence import Sequence
from gpu_worker.sampling.sampler import Sampler, new_sampler_state
from shared.sampling import SamplingParams

CPU = torch.device("cpu")
EOS = 7
_ids = itertools.count()


def _request(params: SamplingParams, prompt: list[int] | None = None) -> Sequence:
    """A sequence as the engine makes one, with an id of its own: the sampler reads its
    id, params, tokens and sampler state."""
    state = new_sampler_state(params)
    return Sequence(f"r{next(_ids)}", list(prompt or []), params, sampler_state=state)


def _state(prompt: list[int] | None = None, **params: object) -> Sequence:
    return _request(SamplingParams(**params), prompt)


def _sampler(vocab: int) -> Sampler:
    return Sampler(vocab_size=vocab, device=CPU, eos_token_ids=[EOS])


def _random_logits(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed))


def _draw_counts(logits_row: torch.Tensor, draws: int, **params: object) -> torch.Tensor:
    """Token histogram of `draws` unseeded samples of one row, drawn as one batch."""
    torch.manual_seed(1234)
    vocab = logits_row.shape[0]
    states = [_state(**params) for _ in range(draws)]
    out = _sampler(vocab).sample(logits_row.expand(draws, vocab).clone(), states)
    return torch.bincount(torch.tensor(out.token_ids), minlength=vocab).double()


def _assert_matches(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Chi-square against `probs`; tokens with zero probability must never appear."""
    probs = probs.double()
    assert counts[probs == 0].sum() == 0
    expected = probs * counts.sum()
    live = probs > 0
    chi2 = ((counts[live] - expected[live]) ** 2 / expected[live]).sum().item()
    # Critical value at p = 0.001 for up to 8 degrees of freedom is about 26.1.
    assert chi2 < 26.1, (chi2, counts.tolist(), expected.tolist())


def test_greedy_is_argmax_on_the_fast_path() -> None:
    logits = _random_logits(5, 50)
    out = _sampler(50).sample(logits, [_state(temperature=0.0) for _ in range(5)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None
    assert out.top_ids is None
    assert out.num_top == [0] * 5


def test_padding_columns_are_never_sampled_and_logits_stay_untouched() -> None:
    logits = _random_logits(3, 12)
    logits[:, 10:] = 100.0  # padding past vocab_size
    before = logits.clone()
    out = _sampler(10).sample(logits, [_state(temperature=0.0, presence_penalty=1.0)] * 3)
    assert out.token_ids == before[:, :10].argmax(-1).tolist()
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "params",
    [{"temperature": 1e-3}, {"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}],
    ids=["temperature->0", "top_k=1", "tiny top_p", "min_p=1"],
)
def test_limits_that_collapse_to_greedy(params: dict[str, float]) -> None:
    logits = _random_logits(64, 100, seed=3)
    # A clear winner per row: at temperature 1e-3 two logits 0.005 apart are a coin flip
    # with odds e^-5, which the sampler's unseeded draws hit now and then.
    logits[torch.arange(64), logits.argmax(-1)] += 0.1
    for _ in range(3):
        out = _sampler(100).sample(logits, [_state(**params) for _ in range(64)])
        assert out.token_ids == logits.argmax(-1).tolist()


def test_temperature_sampling_matches_softmax() -> None:
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.5])
    counts = _draw_counts(row, 4000, temperature=0.7)
    _assert_matches(counts, torch.softmax(row / 0.7, -1))


def test_top_k_and_top_p_sample_the_renormalized_head() -> None:
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.5])
    probs = torch.softmax(row, -1)
    top3 = torch.zeros_like(probs)
    keep = probs.topk(3).indices
    top3[keep] = probs[keep] / probs[keep].sum()
    _assert_matches(_draw_counts(row, 4000, top_k=3), top3)
    # Sorted masses: 0.36, 0.22, 0.13, ...; top_p = 0.5 needs the first two to reach it.
    top2 = torch.zeros_like(probs)
    keep = probs.topk(2).indices
    top2[keep] = probs[keep] / probs[keep].sum()
    _assert_matches(_draw_counts(row, 4000, top_p=0.5), top2)


def test_min_p_drops_tokens_below_the_fraction_of_the_top_one() -> None:
    row = torch.log(torch.tensor([0.4, 0.3, 0.1, 0.05, 0.15]))
    expected = torch.tensor([0.4, 0.3, 0.0, 0.0, 0.15])  # min_p 0.3 -> floor 0.12
    _assert_matches(_draw_counts(row, 3000, min_p=0.3), expected / expected.sum())


LOGITS = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]


@pytest.mark.parametrize(
    ("penalties", "expected"),
    [
        ({"repetition_penalty": 2.0}, [1.0, -2.0, 0.5, 1.5, -4.0, 1.0]),
        ({"frequency_penalty": 0.5}, [2.0, -1.5, 0.5, 2.0, -2.0, 1.0]),
        ({"presence_penalty": 0.25}, [2.0, -1.25, 0.5, 2.75, -2.0, 1.0]),
        (
            {"repetition_penalty": 2.0, "frequency_penalty": 0.5, "presence_penalty": 0.25},
            [1.0, -2.75, 0.5, 0.25, -4.0, 1.0],
        ),
    ],
    ids=["repetition", "frequency", "presence", "all"],
)
def test_penalties_against_hand_computed_values(
    penalties: dict[str, float], expected: list[float]
) -> None:
    # Prompt {0, 4}; output 1 once and 3 twice. Repetition covers prompt and output,
    # frequency and presence only the output. The first row has no penalty, so the
    # second is penalized alone (the batch's penalized rows are a subset).
    penalized = _state(prompt=[0, 4], **penalties)
    penalized.output_token_ids.extend([1, 3, 3])
    x = torch.tensor([LOGITS, LOGITS])
    _sampler(6).penalties.apply(x, [1], [penalized])
    assert x[0].tolist() == LOGITS
    assert x[1].tolist() == pytest.approx(expected)


def test_presence_penalty_changes_the_greedy_pick() -> None:
    state = _state(temperature=0.0, presence_penalty=2.0)
    state.output_token_ids.append(3)
    out = _sampler(6).sample(torch.tensor([LOGITS]), [state])
    assert out.token_ids == [0]  # 3.0 - 2.0 falls below token 0's 2.0


def test_logit_bias_forces_a_token() -> None:
    logits = _random_logits(4, 30)
    states = [
        _state(temperature=0.0, logit_bias={5: 100.0}),
        _state(temperature=1.0, logit_bias={9: 100.0}),
        _state(temperature=0.0),
        _state(temperature=0.0, logit_bias={int(logits[3].argmax()): -100.0}),
    ]
    out = _sampler(30).sample(logits, states)
    assert out.token_ids[:3] == [5, 9, int(logits[2].argmax())]
    assert out.token_ids[3] != int(logits[3].argmax())


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, 10)
    logits[0, EOS] = 10.0
    logits[0, 3] = 9.0  # a stop id, next most likely
    state = _state(temperature=0.0, min_tokens=2, stop_token_ids=[3], ignore_eos=True)
    sampler = _sampler(10)
    picks = []
    for _ in range(3):
        token = sampler.sample(logits, [state]).token_ids[0]
        picks.append(token)
        state.output_token_ids.append(token)
    assert picks[0] not in (EOS, 3)
    assert picks[1] not in (EOS, 3)
    assert picks[2] == EOS


def _run_seeded(seed: int, steps: int, row: int, batch: int, others: dict[str, float]) -> list[int]:
    """`steps` tokens of one seeded request placed at `row` among `batch - 1` others."""
    target = _state(seed=seed, temperature=0.9, top_p=0.95)
    tokens = []
    for step in range(steps):
        logits = _random_logits(batch, 300, seed=step)
        logits[row] = _random_logits(1, 300, seed=1000 + step)[0]
        states = [_state(**others) for _ in range(batch)]
        states[row] = target
        token = _sampler(300).sample(logits, states).token_ids[row]
        target.output_token_ids.append(token)
        tokens.append(token)
    return tokens


def test_seeded_rows_are_reproducible_whatever_shares_the_batch() -> None:
    alone = _run_seeded(seed=-42, steps=12, row=0, batch=1, others={})
    assert len(set(alone)) > 1  # really sampling, not collapsing to greedy
    assert _run_seeded(-42, 12, 0, 1, {}) == alone
    assert _run_seeded(-42, 12, 3, 5, {"temperature": 0.0}) == alone
    assert _run_seeded(-42, 12, 6, 9, {"temperature": 1.2, "top_k": 5, "min_p": 0.1}) == alone
    assert _run_seeded(-42, 12, 1, 4, {"seed": 7, "logprobs": 3}) == alone
    assert _run_seeded(43, 12, 0, 1, {}) != alone


def test_unseeded_rows_differ_across_draws() -> None:
    logits = torch.zeros(32, 1000)
    sampler = _sampler(1000)
    first = sampler.sample(logits, [_state() for _ in range(32)]).token_ids
    second = sampler.sample(logits, [_state() for _ in range(32)]).token_ids
    assert first != second
    assert len(set(first)) > 16  # rows of one batch draw independently


def test_logprobs_are_raw_sorted_and_ranked() -> None:
    logits = _random_logits(4, 40, seed=5)
    states = [
        _state(logprobs=3, repetition_penalty=3.0, prompt=[1, 2, 3]),
        _state(temperature=0.0, logprobs=0),
        _state(),
        _state(temperature=2.0, logprobs=5),
    ]
    out = _sampler(40).sample(logits, states)
    raw = torch.log_softmax(logits, -1)
    ids = torch.tensor(out.token_ids)
    assert out.num_top == [3, 0, 0, 5]
    assert out.top_ids is not None
    assert out.top_logprobs is not None
    assert out.logprobs is not None
    assert out.ranks is not None
    assert out.top_ids.shape == out.top_logprobs.shape == (4, 5)
    assert torch.all(out.top_logprobs <= 0)
    assert torch.all(out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:])
    assert torch.equal(out.top_logprobs, raw.gather(1, out.top_ids))
    assert torch.allclose(out.logprobs, raw.gather(1, ids[:, None]).squeeze(1))
    expected_ranks = [int((raw[i] > raw[i, t]).sum()) + 1 for i, t in enumerate(out.token_ids)]
    assert out.ranks.tolist() == expected_ranks
    assert out.ranks[1] == 1
    assert out.top_ids[1, 0] == ids[1]


def test_mixed_batch_of_greedy_sampled_and_seeded_rows() -> None:
    logits = _random_logits(6, 200, seed=9)
    greedy_rows = [0, 3]
    seeded = {1: 11, 4: 12}
    states = [
        _state(temperature=0.0),
        _state(seed=11, temperature=1.0),
        _state(temperature=0.8, top_k=20),
        _state(temperature=0.0, frequency_penalty=0.0),
        _state(seed=12, temperature=0.5, top_p=0.9),
        _state(temperature=1.0, min_p=0.05),
    ]
    out = _sampler(200).sample(logits, states)
    for row in greedy_rows:
        assert out.token_ids[row] == int(logits[row].argmax())
    assert out.token_ids[2] in logits[2].topk(20).indices.tolist()
    for row, seed in seeded.items():
        assert states[row].sampling.seed == seed
        solo = _request(states[row].sampling)
        solo_out = _sampler(200).sample(logits[row : row + 1], [solo])
        assert solo_out.token_ids[0] == out.token_ids[row]


# ---- allowed_token_ids and bad_words ----------------------------------------------


def test_allowed_token_ids_restrict_their_rows_only() -> None:
    logits = _random_logits(4, 50, seed=21)
    allowed = [3, 17, 41]
    states = [
        _state(temperature=0.0, allowed_token_ids=allowed),
        _state(temperature=0.0),
        _state(temperature=1.5, allowed_token_ids=allowed),
        _state(temperature=1.5, top_k=2, allowed_token_ids=[8]),
    ]
    sampler = _sampler(50)
    for _ in range(20):
        out = sampler.sample(logits, states)
        assert out.token_ids[0] == allowed[int(logits[0, allowed].argmax())]
        assert out.token_ids[1] == int(logits[1].argmax())
        assert out.token_ids[2] in allowed
        assert out.token_ids[3] == 8
    assert sampler.token_filters.num_builds == 1  # same requests in the same rows


def test_allowed_token_ids_sample_the_renormalized_subset() -> None:
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.5])
    allowed = [0, 2, 4]
    probs = torch.zeros(8)
    probs[allowed] = torch.softmax(row[allowed], -1)
    _assert_matches(_draw_counts(row, 3000, allowed_token_ids=allowed), probs)


def test_one_token_bad_words_are_never_sampled() -> None:
    logits = _random_logits(3, 40, seed=22)
    top = logits.argmax(-1).tolist()
    states = [
        _state(temperature=0.0, bad_words_token_ids=[[top[0]]]),
        _state(temperature=0.0),
        _state(temperature=5.0, bad_words_token_ids=[[t] for t in range(20)]),
    ]
    sampler = _sampler(40)
    for _ in range(20):
        out = sampler.sample(logits, states)
        assert out.token_ids[0] == int(logits[0].topk(2).indices[1])
        assert out.token_ids[1] == top[1]
        assert out.token_ids[2] >= 20


def test_a_longer_bad_word_bans_its_last_token_only_after_its_prefix() -> None:
    logits = torch.zeros(2, 10)
    logits[:, 6] = 5.0  # the greedy pick, unless banned
    words = [[1, 2, 6], [4, 6], [9, 9, 9, 9]]
    after_prefix = _state(temperature=0.0, bad_words_token_ids=words)
    after_prefix.output_token_ids.extend([7, 1, 2])
    elsewhere = _state(temperature=0.0, bad_words_token_ids=words)
    elsewhere.output_token_ids.extend([1, 3])  # ends with neither prefix
    sampler = _sampler(10)
    assert sampler.sample(logits, [after_prefix, elsewhere]).token_ids == [0, 6]
    after_prefix.output_token_ids.append(4)  # [.., 4] is [4, 6]'s prefix
    elsewhere.output_token_ids.append(4)
    assert sampler.sample(logits, [after_prefix, elsewhere]).token_ids == [0, 0]
    # The prompt does not count: a prefix must be in the output.
    fresh = _state(prompt=[1, 2], temperature=0.0, bad_words_token_ids=words)
    assert sampler.sample(logits[:1], [fresh]).token_ids == [6]


def test_masks_are_rebuilt_when_the_rows_change_and_never_for_plain_batches() -> None:
    logits = _random_logits(3, 30, seed=23)
    plain = [_state(temperature=0.0) for _ in range(3)]
    sampler = _sampler(30)
    sampler.sample(logits, plain)
    assert sampler.token_filters.num_builds == 0
    restricted = _state(temperature=0.0, allowed_token_ids=[2])
    sampler.sample(logits, [plain[0], restricted, plain[1]])
    sampler.sample(logits, [plain[0], restricted, plain[1]])
    assert sampler.token_filters.num_builds == 1
    # The restricted request moves to another row: the masks must follow it.
    out = sampler.sample(logits, [restricted, plain[0], plain[1]])
    assert sampler.token_filters.num_builds == 2
    assert out.token_ids == [2, int(logits[1].argmax()), int(logits[2].argmax())]


def test_token_filters_keep_logprobs_raw() -> None:
    logits = _random_logits(1, 20, seed=24)
    state = _state(temperature=0.0, logprobs=2, allowed_token_ids=[5])
    out = _sampler(20).sample(logits, [state])
    assert out.token_ids == [5]
    assert out.logprobs is not None
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs[0].item() == pytest.approx(raw[0, 5].item())
