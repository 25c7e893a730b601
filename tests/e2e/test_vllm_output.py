"""Output details vLLM users rely on, through real processes and the openai SDK: a stop
token is not part of the text, a length cut inside a character never ends the text in
U+FFFD, and every answer carries a stable system_fingerprint."""

from __future__ import annotations

import httpx
from openai import OpenAI

from tests.helpers.processes import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
HI = [{"role": "user", "content": "hi"}]
PERIOD, EOS = 30, 2  # ".", <|im_end|>
EMOJI_HEAD = 10813  # "ðŁ": the first two bytes (F0 9F) of a four-byte emoji


def test_a_stop_token_is_not_in_the_text(client: OpenAI) -> None:
    """Made certain by logit_bias, the stop token (a stop_token_ids entry, or EOS) ends the
    answer: its id is in token_ids and stop_reason, its text only on request."""
    forced = {"logit_bias": {str(PERIOD): 100}, "stop_token_ids": [PERIOD]}
    reply = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=4, extra_body={**forced, "return_token_ids": True}
    )
    choice = reply.choices[0]
    assert not choice.message.content
    assert (choice.finish_reason, choice.stop_reason) == ("stop", PERIOD)
    assert choice.token_ids == [PERIOD]
    stream = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=4, stream=True, extra_body=forced
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ""
    # EOS, with special tokens shown: still not in the text, unless asked for.
    eos = {"logit_bias": {str(EOS): 100}, "skip_special_tokens": False}
    for include, text in ((False, ""), (True, "<|im_end|>")):
        body = {**eos, "include_stop_str_in_output": include}
        reply = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body=body)
        assert (reply.choices[0].text, reply.choices[0].finish_reason) == (text, "stop")


def test_a_length_cut_inside_a_character_never_ends_in_a_replacement_char(
    client: OpenAI, render: ServerProcess
) -> None:
    """One token that holds half an emoji, then the length limit: the text stops before
    the incomplete character; the logprob's bytes still carry its two bytes."""
    forced = {"logit_bias": {str(EMOJI_HEAD): 100}}
    reply = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=1, logprobs=True, extra_body=forced
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.content
    assert choice.logprobs.content[0].bytes == [0xF0, 0x9F]
    body = {"messages": HI, "max_tokens": 1, "stream": True, **forced}
    text = httpx.post(f"{render.base_url}/v1/chat/completions", json=body).text
    assert "\\ufffd" not in text
    assert "\ufffd" not in text


def test_system_fingerprint_is_set_and_stable(client: OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
    completion = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    chunks = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, stream=True))
    fingerprints = {chat.system_fingerprint, completion.system_fingerprint}
    fingerprints |= {chunk.system_fingerprint for chunk in chunks}
    assert len(fingerprints) == 1
    assert fingerprints.pop().startswith("fp_")
