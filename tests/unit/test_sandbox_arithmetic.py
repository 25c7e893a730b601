"""The sandbox's bound on integers: no template holds a number whose arithmetic is one C call
long enough to escape the render deadline."""

from __future__ import annotations

import time

import pytest

from render_server.templating.errors import ChatTemplateTooLarge
from render_server.templating.sandbox import SandboxEnvironment

LIMIT_BITS = 1 << 16


def _render(source: str) -> str:
    return SandboxEnvironment(max_value_chars=4_000_000).from_string(source).render()


@pytest.mark.parametrize(
    "source",
    [
        # Squaring 3 thirty times makes a billion-bit number; 25 times took 12 s unchecked.
        "{% set ns = namespace(x=3) %}{% for i in range(30) %}{% set ns.x = ns.x * ns.x %}"
        "{% endfor %}",
        "{{ 3 ** 70000 }}",
        "{{ 2 ** 65535 * 2 }}",
        "{{ 2 ** 65535 + 2 ** 65535 }}",
        "{{ -(2 ** 65535) - 2 ** 65535 }}",
        # Built by a filter or a call rather than by arithmetic.
        "{{ ('f' * 20000) | int(base=16) }}",
        "{{ (1).from_bytes(('a' * 10000).encode(), 'big') }}",
        "{{ [2 ** 65535, 2 ** 65535] | sum }}",
    ],
)
def test_numbers_past_the_limit_are_refused_at_once(source: str) -> None:
    started = time.monotonic()
    with pytest.raises(ChatTemplateTooLarge, match=f"number of more than {LIMIT_BITS} bits"):
        _render(source)
    assert time.monotonic() - started < 0.5


def test_numbers_up_to_the_limit_still_compute() -> None:
    assert _render("{{ (2 ** 65535).bit_length() }}") == str(LIMIT_BITS)
    assert _render("{{ (2 ** 65535 - 1 + 2 ** 65535 // 2).bit_length() }}") == str(LIMIT_BITS)
    assert _render("{{ 7 * 6 }} {{ 2 ** -1 }} {{ 7 // 2 }} {{ 7 % 4 }} {{ -3 - 4 }}") == (
        "42 0.5 3 3 -7"
    )


def test_sum_adds_one_checked_item_at_a_time() -> None:
    assert _render("{{ [1, 2, 3] | sum }} {{ [{'n': 2}, {'n': 5}] | sum(attribute='n') }}") == (
        "6 7"
    )
    assert _render("{{ [[1], [2, 3]] | sum(start=[]) }}") == "[1, 2, 3]"
    # The builtin would concatenate all of it in one uninterruptible C call.
    with pytest.raises(ChatTemplateTooLarge, match="items"):
        _render("{{ ([[0] * 400000] * 20) | sum(start=[]) }}")
