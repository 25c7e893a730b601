"""`--speculative-config` parses vLLM's JSON with vLLM's defaults and refuses bad values
with the offending field's name in the message."""

from __future__ import annotations

import pytest

from gpu_worker.spec_decode.config import SpeculativeConfig, parse_speculative_config
from gpu_worker.spec_decode.drafter import make_drafter
from gpu_worker.spec_decode.ngram import NgramProposer
from gpu_worker.spec_decode.suffix import SuffixProposer


def test_ngram_defaults_are_vllms() -> None:
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}')
    assert config == SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)


@pytest.mark.parametrize(
    ("given", "bounds"),
    [
        ('"prompt_lookup_max": 3', (3, 3)),
        ('"prompt_lookup_min": 2', (2, 2)),
        ('"prompt_lookup_min": 1, "prompt_lookup_max": 4', (1, 4)),
    ],
)
def test_one_ngram_bound_sets_the_other(given: str, bounds: tuple[int, int]) -> None:
    config = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 3, ' + given + "}"
    )
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == bounds


def test_suffix_defaults_and_k_from_tree_depth() -> None:
    config = parse_speculative_config('{"method": "suffix"}')
    assert config.num_speculative_tokens == 24
    assert config.suffix_decoding_max_cached_requests == 10000
    assert config.suffix_decoding_max_spec_factor == 1.0
    assert config.suffix_decoding_min_token_prob == 0.1
    deeper = parse_speculative_config(
        '{"method": "suffix", "suffix_decoding_max_tree_depth": 8, '
        '"suffix_decoding_max_cached_requests": 0, "suffix_decoding_min_token_prob": 0.5}'
    )
    assert deeper.num_speculative_tokens == 8
    assert deeper.suffix_decoding_max_cached_requests == 0
    assert deeper.suffix_decoding_min_token_prob == 0.5


def test_draft_model_and_the_model_shorthand() -> None:
    explicit = parse_speculative_config(
        '{"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2}'
    )
    shorthand = parse_speculative_config('{"model": "tiny", "num_speculative_tokens": 2}')
    assert explicit == shorthand
    assert explicit.method == "draft_model"
    assert explicit.model == "tiny"


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
        ('{"num_speculative_tokens": 2}', "method"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": "4"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "typo"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, '
            '"prompt_lookup_min": 4, "prompt_lookup_max": 2}',
            "prompt_lookup_max",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}',
            "prompt_lookup_min",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 4}',
            "suffix_decoding_max_tree_depth",
        ),
        ('{"method": "suffix", "model": "tiny"}', "model"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "model"),
        (
            '{"method": "suffix", "suffix_decoding_max_tree_depth": 0}',
            "suffix_decoding_max_tree_depth",
        ),
        (
            '{"method": "suffix", "suffix_decoding_max_cached_requests": -1}',
            "suffix_decoding_max_cached_requests",
        ),
        (
            '{"method": "suffix", "suffix_decoding_max_spec_factor": -0.5}',
            "suffix_decoding_max_spec_factor",
        ),
        (
            '{"method": "suffix", "suffix_decoding_min_token_prob": 1.5}',
            "suffix_decoding_min_token_prob",
        ),
        (
            '{"method": "suffix", "suffix_decoding_max_cached_nodes": 0}',
            "suffix_decoding_max_cached_nodes",
        ),
    ],
)
def test_bad_configs_name_their_field(text: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        parse_speculative_config(text)


@pytest.mark.parametrize("text", ["", "[1, 2]", '{"method": ', "ngram"])
def test_not_a_json_object(text: str) -> None:
    with pytest.raises(ValueError, match="--speculative-config"):
        parse_speculative_config(text)


def test_the_method_picks_the_drafter() -> None:
    ngram = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2}')
    suffix = parse_speculative_config('{"method": "suffix"}')
    draft = parse_speculative_config('{"model": "tiny", "num_speculative_tokens": 2}')
    assert isinstance(make_drafter(ngram), NgramProposer)
    assert isinstance(make_drafter(suffix), SuffixProposer)
    with pytest.raises(ValueError, match="draft_model"):
        make_drafter(draft)
