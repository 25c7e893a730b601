"""A request's own chat template (--trust-request-chat-template) that reaches for an
attribute the sandbox blocks is a 400 naming the sandbox, whichever way it gets there: by
name, through the `attr` filter, or inside a format string. It never renders as an empty
(or shortened) prompt."""

from __future__ import annotations

import httpx
import pytest

MESSAGES = [{"role": "user", "content": "hi"}]
BLOCKED = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''|attr('__class__')|attr('__mro__') }}",
    "{{ raise_exception.__globals__ }}",
    "{{ ('{0.__class__}'|attr('format'))(1) }}",
    "{{ messages[0]|attr('__class__') }}hello",
]


@pytest.mark.parametrize("template", BLOCKED)
@pytest.mark.parametrize("path", ["/v1/chat/completions/render", "/tokenize"])
def test_a_blocked_attribute_is_a_400_naming_the_sandbox(
    client: httpx.Client, path: str, template: str
) -> None:
    response = client.post(path, json={"messages": MESSAGES, "chat_template": template})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "blocked by the sandbox" in error["message"], error
    assert "unsafe" in error["message"], error


def test_safe_attributes_still_render(client: httpx.Client) -> None:
    template = "{{ messages[0]['content']|attr('upper') is defined }}|{{ 'x'.upper() }}"
    response = client.post("/tokenize", json={"messages": MESSAGES, "chat_template": template})
    assert response.status_code == 200, response.text
    text = client.post("/detokenize", json={"tokens": response.json()["tokens"]}).json()["prompt"]
    assert text == "True|X"
