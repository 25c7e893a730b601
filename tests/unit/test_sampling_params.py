"""SamplingParams validation names the offending field."""

from __future__ import annotations

import pytest

from shared.sampling import SamplingParams, SamplingParamsError


def test_defaults_are_valid() -> None:
    SamplingParams().validate(vocab_size=100)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 101}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logit_bias": {5: 200.0}}, "logit_bias"),
        ({"logit_bias": {500: 1.0}}, "logit_bias"),
        ({"stop_token_ids": [100]}, "stop_token_ids"),
        ({"seed": 1 << 64}, "seed"),
    ],
)
def test_each_bound_names_its_field(fields: dict, param: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**fields).validate(vocab_size=100)
    assert info.value.param == param
    assert param in str(info.value)


def test_greedy_flag() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams().is_greedy
