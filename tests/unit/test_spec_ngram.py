"""Prompt lookup drafts exactly: the longest n first, its earliest match, k tokens at most,
and the same drafts as a plain Python search on random sequences."""

from __future__ import annotations

import random

import numpy as np
import pytest

from gpu_worker.spec_decode.config import SpeculativeConfig
from gpu_worker.spec_decode.ngram import NgramProposer, ngram_draft
from tests.helpers.spec_reference import naive_ngram_draft


def test_copies_what_followed_the_prompts_phrase() -> None:
    prompt = [7, 8, 9, 10, 11, 12, 13, 14]
    output = [3, 9, 10, 11]
    assert ngram_draft(prompt + output, 4, 2, 3) == [12, 13, 14, 3]


def test_no_match_proposes_nothing() -> None:
    assert ngram_draft([1, 2, 3, 4, 5, 6], 3, 2, 4) == []
    assert ngram_draft([1, 2, 9, 2], 3, 2, 4) == []  # a 1-token match is below min_n
    assert ngram_draft([], 3, 2, 4) == []
    assert ngram_draft([5], 3, 2, 4) == []


def test_longer_n_wins_over_an_earlier_shorter_match() -> None:
    # "3" alone matches at index 1 (then 100); "2 3" matches at index 4 (then 200).
    tokens = [9, 3, 100, 0, 2, 3, 200, 201, 2, 3]
    assert ngram_draft(tokens, 2, 1, 3) == [200, 201]
    assert ngram_draft(tokens, 2, 1, 1) == [100, 0]


def test_repeated_phrase_takes_the_earliest_copy() -> None:
    tokens = [1, 2, 50, 1, 2, 60, 1, 2]
    assert ngram_draft(tokens, 1, 2, 2) == [50]


def test_k_caps_the_draft_and_the_sequence_end_cuts_it() -> None:
    tokens = [4, 5, 6, 7, 8, 4, 5]
    assert ngram_draft(tokens, 2, 2, 2) == [6, 7]
    assert ngram_draft(tokens, 10, 2, 2) == [6, 7, 8, 4, 5]
    assert ngram_draft(tokens, 0, 2, 2) == []


def test_a_run_of_one_token_overlaps_its_own_match() -> None:
    assert ngram_draft([5, 5, 5, 5], 3, 2, 3) == [5]


def test_list_and_array_inputs_agree_and_are_not_mutated() -> None:
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 1, 4, 1]
    array = np.array(tokens, dtype=np.int64)
    assert ngram_draft(array, 3, 1, 3) == ngram_draft(tokens, 3, 1, 3) == [5, 9, 2]
    assert array.tolist() == tokens


@pytest.mark.parametrize(("min_n", "max_n"), [(1, 1), (1, 3), (2, 5), (3, 3)])
def test_matches_the_naive_search_on_random_sequences(min_n: int, max_n: int) -> None:
    rng = random.Random(min_n * 10 + max_n)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        k = rng.randrange(0, 6)
        expected = naive_ngram_draft(tokens, min_n, max_n, k)
        assert ngram_draft(tokens, k, min_n, max_n) == expected, tokens


def test_proposer_follows_each_request_as_its_tokens_arrive() -> None:
    config = SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=4
    )
    proposer = NgramProposer(config)
    rng = random.Random(7)
    prompts = {rid: [rng.randrange(5) for _ in range(rng.randrange(1, 6))] for rid in "abc"}
    tokens = {rid: list(prompt) for rid, prompt in prompts.items()}
    for rid, prompt in prompts.items():
        proposer.start_request(rid, prompt)
    for _ in range(60):  # the buffers grow past their first size several times
        for rid in "abc":
            step = [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
            proposer.add_tokens(rid, step)
            tokens[rid] += step
            assert proposer.propose(rid, 8) == ngram_draft(tokens[rid], 3, 1, 4)
    proposer.finish_request("a")
    proposer.finish_request("never-started")
    with pytest.raises(KeyError):
        proposer.propose("a", 3)
    assert proposer.propose("b", 2) == ngram_draft(tokens["b"], 2, 1, 4)
