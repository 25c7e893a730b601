"""Prompt lookup drafts exactly: the longest n first, its earliest match, k tokens at most,
and the same drafts as a plain Python search on random sequences."""

from __future__ import annotations

import random

import numpy as np
import pytest

from gpu_worker.spec_decode.ngram import NgramProposer


def _naive(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition: for n from max_n down, the earliest earlier copy of the last n."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        pattern = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == pattern:
                return tokens[start + n : start + n + k]
    return []


def test_copies_what_followed_the_prompts_phrase() -> None:
    prompt = [7, 8, 9, 10, 11, 12, 13, 14]
    output = [3, 9, 10, 11]
    assert NgramProposer(2, 3).propose(prompt + output, 4) == [12, 13, 14, 3]


def test_no_match_proposes_nothing() -> None:
    proposer = NgramProposer(2, 4)
    assert proposer.propose([1, 2, 3, 4, 5, 6], 3) == []
    assert proposer.propose([1, 2, 9, 2], 3) == []  # a 1-token match is below min_n
    assert proposer.propose([], 3) == []
    assert proposer.propose([5], 3) == []


def test_longer_n_wins_over_an_earlier_shorter_match() -> None:
    # "3" alone matches at index 1 (then 100); "2 3" matches at index 4 (then 200).
    tokens = [9, 3, 100, 0, 2, 3, 200, 201, 2, 3]
    assert NgramProposer(1, 3).propose(tokens, 2) == [200, 201]
    assert NgramProposer(1, 1).propose(tokens, 2) == [100, 0]


def test_repeated_phrase_takes_the_earliest_copy() -> None:
    tokens = [1, 2, 50, 1, 2, 60, 1, 2]
    assert NgramProposer(2, 2).propose(tokens, 1) == [50]


def test_k_caps_the_draft_and_the_sequence_end_cuts_it() -> None:
    tokens = [4, 5, 6, 7, 8, 4, 5]
    proposer = NgramProposer(2, 2)
    assert proposer.propose(tokens, 2) == [6, 7]
    assert proposer.propose(tokens, 10) == [6, 7, 8, 4, 5]
    assert proposer.propose(tokens, 0) == []


def test_a_run_of_one_token_overlaps_its_own_match() -> None:
    assert NgramProposer(2, 3).propose([5, 5, 5, 5], 3) == [5]


def test_list_and_array_inputs_agree_and_are_not_mutated() -> None:
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 1, 4, 1]
    array = np.array(tokens, dtype=np.int64)
    proposer = NgramProposer(1, 3)
    assert proposer.propose(array, 3) == proposer.propose(tokens, 3) == [5, 9, 2]
    assert array.tolist() == tokens


@pytest.mark.parametrize(("min_n", "max_n"), [(1, 1), (1, 3), (2, 5), (3, 3)])
def test_matches_the_naive_search_on_random_sequences(min_n: int, max_n: int) -> None:
    rng = random.Random(min_n * 10 + max_n)
    proposer = NgramProposer(min_n, max_n)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        k = rng.randrange(0, 6)
        assert proposer.propose(tokens, k) == _naive(tokens, min_n, max_n, k), tokens


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(0, 2)
