"""tests.helpers.waiting: the poll with a deadline that the process tests wait with."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.helpers.waiting import WaitTimeout, wait_until, wait_until_async


def test_returns_the_first_truthy_value() -> None:
    calls = itertools.count()
    assert wait_until(lambda: max(0, next(calls) - 2), 5, "a third call", interval_s=0) == 1


def test_fails_at_the_deadline_saying_what_and_the_last_value() -> None:
    with pytest.raises(WaitTimeout, match=r"after 0.05s waiting for the moon \(last: \[\]\)\nlog"):
        wait_until(list, 0.05, "the moon", interval_s=0.01, detail=lambda: "log")


def test_ignored_exceptions_mean_not_yet_and_others_fail_at_once() -> None:
    calls = itertools.count()

    def refuses_twice() -> bool:
        if next(calls) < 2:
            raise ConnectionError("not listening yet")
        return True

    assert wait_until(refuses_twice, 5, "a connection", interval_s=0, ignoring=(ConnectionError,))
    calls = itertools.count()
    with pytest.raises(ConnectionError):
        wait_until(refuses_twice, 5, "a connection", interval_s=0)
    assert next(calls) == 1  # raised on the first call, not retried


def test_the_async_twin_awaits_an_awaitable_predicate_and_times_out() -> None:
    async def ready() -> str:
        return "ready"

    assert asyncio.run(wait_until_async(ready, 5, "ready")) == "ready"
    with pytest.raises(WaitTimeout, match="waiting for never"):
        asyncio.run(wait_until_async(lambda: False, 0.05, "never", interval_s=0.01))
