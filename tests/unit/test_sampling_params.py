"""SamplingParams validation names the offending field; the render tier turns request
fields into what reaches the worker."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from render_server.generation.sampling_params import (
    bad_words_token_ids,
    build_choices,
    check_priority,
    reject_unsupported,
    truncate_prompt,
)
from render_server.http.endpoint import request_cache_salt
from render_server.schemas.errors import ApiError
from render_server.schemas.generation import CompletionRequest
from render_server.templating.tokenizer import Tokenizer
from shared.model_card import ModelCard
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


# ---- the render tier's side: request fields -> what reaches the worker -------------------


def test_truncate_prompt_keeps_the_last_tokens() -> None:
    prompt = list(range(10))
    assert truncate_prompt(prompt, None, 100, None) == prompt
    assert truncate_prompt(prompt, 3, 100, None) == [7, 8, 9]
    assert truncate_prompt(prompt, 50, 100, None) == prompt
    # -1: as many as fit the context with room for the requested output (one if unset).
    assert truncate_prompt(prompt, -1, 8, 2) == list(range(4, 10))
    assert truncate_prompt(prompt, -1, 8, None) == list(range(3, 10))
    with pytest.raises(ApiError) as info:
        truncate_prompt(prompt, 101, 100, None)
    assert info.value.info.param == "truncate_prompt_tokens"


def test_bad_words_are_tokenized_as_vllm_does(smollm2_tokenizer: Tokenizer) -> None:
    def ids(text: str) -> list[int]:
        return smollm2_tokenizer.encode(text, add_special_tokens=False)

    # A word alone and after a space are different tokens: both sequences are banned.
    assert bad_words_token_ids(smollm2_tokenizer, ["Paris"]) == [ids("Paris"), ids(" Paris")]
    # Leading spaces are the tokenizer's business, not the word's.
    assert bad_words_token_ids(smollm2_tokenizer, ["  Paris"]) == [ids("Paris"), ids(" Paris")]
    # Multi-token words stay sequences.
    words = bad_words_token_ids(smollm2_tokenizer, ["antidisestablishment"])
    assert words[0] == ids("antidisestablishment")
    assert len(words[0]) > 1


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"use_beam_search": True}, "use_beam_search"),
        ({"length_penalty": 0.5}, "length_penalty"),
        ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
        ({"logits_processors": ["x"]}, "logits_processors"),
        ({"kv_transfer_params": {"a": 1}}, "kv_transfer_params"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
        ({"suffix": "x"}, "suffix"),
    ],
)
def test_unsupported_fields_are_refused_unless_at_their_default(
    fields: dict[str, Any], param: str
) -> None:
    body = CompletionRequest.model_validate({"prompt": "x", **fields})
    with pytest.raises(ApiError) as info:
        reject_unsupported(body)
    assert info.value.info.param == param
    # vLLM's default, sent explicitly, asks for nothing unsupported.
    default = CompletionRequest.model_fields[param].default
    reject_unsupported(CompletionRequest.model_validate({"prompt": "x", param: default}))


def test_priority_needs_priority_scheduling() -> None:
    fcfs = ModelCard(
        model_id="m", tokenizer_digest="d", vocab_size=10, eos_token_ids=[0], max_model_len=64
    )
    check_priority(0, fcfs)
    with pytest.raises(ApiError) as info:
        check_priority(-1, fcfs)
    assert info.value.info.param == "priority"
    check_priority(-1, msgspec.structs.replace(fcfs, scheduling_policy="priority"))


def _request(isolation: str, key: str | None) -> Any:
    """What request_cache_salt reads of a request: the isolation setting, the configured
    keys and the presented one."""
    api_keys = ["key-a", "key-b"] if isolation == "per-key" else []
    settings = SimpleNamespace(prefix_cache_isolation=isolation, api_keys=api_keys)
    app = SimpleNamespace(state=SimpleNamespace(render=SimpleNamespace(settings=settings)))
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    return SimpleNamespace(app=app, scope={"headers": headers})


def test_cache_salts_never_cross_tenants() -> None:
    # Without isolation the client's salt is the salt.
    assert request_cache_salt(_request("none", None), "s") == "s"
    assert request_cache_salt(_request("none", None), None) is None
    # Per key: every salt depends on the key, the client's own salt included, so no
    # tenant can pick another tenant's salt.
    salts = {
        request_cache_salt(_request("per-key", key), salt)
        for key in ("key-a", "key-b")
        for salt in (None, "s")
    }
    assert len(salts) == 4
    assert None not in salts
    assert request_cache_salt(_request("per-key", "key-a"), "s") == request_cache_salt(
        _request("per-key", "key-a"), "s"
    )


def test_only_the_first_choice_scores_the_prompt() -> None:
    fields = {"prompt": "x", "n": 3, "prompt_logprobs": 2, "seed": 7}
    body = CompletionRequest.model_validate(fields)
    choices = build_choices(body, max_tokens=4, logprobs=None, vocab_size=100, max_n=4)
    assert [c.sampling.prompt_logprobs for c in choices] == [2, None, None]
    assert [c.sampling.seed for c in choices] == [7, 8, 9]
