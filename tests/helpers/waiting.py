"""Waiting in tests for something another thread or process does: a poll with a deadline.

`wait_until` (and `wait_until_async`, its twin for a coroutine on an event loop) calls a
predicate until it returns something truthy, and returns that value, so a test can wait for
a message or a state and then look at it. Past the deadline the test fails with what it was
waiting for, how long it waited and the predicate's last value, instead of hanging or
failing later on a vaguer assertion. A predicate that itself blocks (a socket poll, a
heartbeat read) sets `interval_s=0`.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, cast

T = TypeVar("T")

DEFAULT_INTERVAL_S = 0.05


class WaitTimeout(AssertionError):
    """What a test waited for did not happen before its deadline."""


class _Poll:
    """The bookkeeping both twins share: deadline, last value, and the failure message."""

    def __init__(
        self,
        timeout_s: float,
        what: str,
        ignoring: tuple[type[BaseException], ...],
        detail: Callable[[], object] | None,
    ) -> None:
        self.timeout_s = timeout_s
        self.what = what
        self.ignoring = ignoring
        self.detail = detail
        self.deadline = time.monotonic() + timeout_s
        self.last: object = None

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def timeout(self) -> WaitTimeout:
        message = f"timed out after {self.timeout_s:g}s waiting for {self.what}"
        message += f" (last: {self.last!r})"
        if self.detail is not None:
            message += f"\n{self.detail()}"
        return WaitTimeout(message)


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float,
    what: str,
    *,
    interval_s: float = DEFAULT_INTERVAL_S,
    ignoring: tuple[type[BaseException], ...] = (),
    detail: Callable[[], object] | None = None,
) -> T:
    """Call `predicate` every `interval_s` until it returns something truthy; return that.

    `what` completes "timed out waiting for ...". Exceptions of the `ignoring` types count
    as "not yet" (a server still starting refuses connections); any other exception, an
    assertion included, fails at once. `detail` is called only on timeout, for context the
    message should carry (a server's log). The predicate runs at least once, and once more
    at the deadline, so a slow predicate is not cut short by its own last call.
    """
    poll = _Poll(timeout_s, what, ignoring, detail)
    while True:
        try:
            value = predicate()
        except ignoring as exc:
            poll.last = exc
        else:
            if value:
                return value
            poll.last = value
        remaining = poll.remaining()
        if remaining <= 0:
            raise poll.timeout()
        time.sleep(min(interval_s, remaining))


async def wait_until_async(
    predicate: Callable[[], T | Awaitable[T]],
    timeout_s: float,
    what: str,
    *,
    interval_s: float = DEFAULT_INTERVAL_S,
    ignoring: tuple[type[BaseException], ...] = (),
    detail: Callable[[], object] | None = None,
) -> T:
    """`wait_until` for a coroutine: sleeps with `asyncio.sleep`, so the event loop keeps
    running what the test waits for; `predicate` may return an awaitable."""
    poll = _Poll(timeout_s, what, ignoring, detail)
    while True:
        try:
            result = predicate()
            value = cast(T, await result if inspect.isawaitable(result) else result)
        except ignoring as exc:
            poll.last = exc
        else:
            if value:
                return value
            poll.last = value
        remaining = poll.remaining()
        if remaining <= 0:
            raise poll.timeout()
        await asyncio.sleep(min(interval_s, remaining))
