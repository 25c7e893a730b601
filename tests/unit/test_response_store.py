"""The response store (render_server/store): one behaviour suite run against MemoryStore
and RedisStore over a real redis-server, then what only Redis has (other processes, a
dead or hung server, a restart) and what only memory has (its byte bound).

"Another process" is a second RedisStore on the same URL: it shares nothing with the
first but Redis, as a second render process does. For the memory store it is the same
store, the only one its process has.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from pydantic import ValidationError

from render_server.settings import RenderSettings
from render_server.store import (
    MemoryStore,
    RecordTooLarge,
    ResponseStore,
    StoreError,
    open_store,
)
from render_server.store.redis import RedisStore
from tests.helpers.redis import RedisServer, start_redis
from tests.helpers.waiting import wait_until_async

T = TypeVar("T")
WAIT_S = 10.0
# A dead or hung Redis must cost a call about its timeouts (one retry), never a hang.
QUICK_TIMEOUT_S = 0.3
GIVE_UP_WITHIN_S = 3.0


def run(coroutine: Awaitable[T], timeout_s: float = 30.0) -> T:
    """Run a test's coroutine on a fresh loop, bounded: a hang fails, it does not stall."""

    async def bounded() -> T:
        return await asyncio.wait_for(coroutine, timeout_s)

    return asyncio.run(bounded())


@dataclass
class Stores:
    """Opens stores of one kind on one backend."""

    url: str

    def open(
        self, ttl_s: float = 60.0, max_bytes: int = 1 << 20, max_record_bytes: int = 1 << 16
    ) -> ResponseStore:
        return open_store(
            self.url, ttl_s=ttl_s, max_bytes=max_bytes, max_record_bytes=max_record_bytes
        )

    def other_process(self, store: ResponseStore) -> ResponseStore:
        """The same store as seen from another render process."""
        return self.open() if isinstance(store, RedisStore) else store


@pytest.fixture(params=["memory", "redis"])
def stores(request: pytest.FixtureRequest) -> Stores:
    if request.param == "memory":
        return Stores("memory://")
    server: RedisServer = request.getfixturevalue("redis_server")
    server.flush()
    return Stores(server.url)


async def closing(*stores: ResponseStore) -> None:
    for store in stores:
        await store.close()


def test_open_store_by_scheme(redis_server: RedisServer) -> None:
    assert isinstance(Stores("memory://").open(), MemoryStore)
    for url in (redis_server.url, "rediss://:secret@example.invalid:6380/1"):
        store = Stores(url).open()
        assert isinstance(store, RedisStore)
        assert "secret" not in store.address
        run(store.close())  # connects to nothing until its first call
    with pytest.raises(ValueError, match="unknown response store") as raised:
        Stores("mysql://user:secret@host/db").open()
    assert "secret" not in str(raised.value)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("mysql://user:secret@host/db", "use memory:// or redis://"),
        ("memory", "use memory:// or redis://"),
        ("redis:///0", "names no host"),
        ("redis://host:99999/0", "port"),
        ("redis://host/first", "database"),
    ],
)
def test_a_bad_store_url_fails_at_startup(url: str, problem: str) -> None:
    with pytest.raises(ValidationError) as raised:
        RenderSettings(response_store=url)
    # What render-serve prints (cli.parse_settings): the messages, without the input.
    [message] = [error["msg"] for error in raised.value.errors()]
    assert problem in message
    assert "secret" not in message


def test_good_store_urls_and_no_password_in_repr() -> None:
    for url in ("memory://", "redis://127.0.0.1:6379/0", "rediss://:secret@redis.internal"):
        settings = RenderSettings(response_store=url)
        assert settings.response_store == url
        assert "secret" not in repr(settings)


def test_put_get_replace_delete(stores: Stores) -> None:
    async def main() -> None:
        store = stores.open()
        other = stores.other_process(store)
        try:
            assert await store.get("t", "resp_1") is None
            await store.put("t", "resp_1", b"first")
            assert await other.get("t", "resp_1") == b"first"
            await other.put("t", "resp_1", b"second")
            assert await store.get("t", "resp_1") == b"second"
            assert await other.delete("t", "resp_1") is True
            assert await store.get("t", "resp_1") is None
            assert await store.delete("t", "resp_1") is False
        finally:
            await closing(store, other)

    run(main())


def test_tenants_never_see_each_other(stores: Stores) -> None:
    async def main() -> None:
        store = stores.open()
        try:
            await store.put("alice", "resp_1", b"alice's")
            assert await store.get("bob", "resp_1") is None
            assert await store.get("", "resp_1") is None
            assert await store.delete("bob", "resp_1") is False
            await store.put("bob", "resp_1", b"bob's")
            assert await store.get("alice", "resp_1") == b"alice's"
            assert await store.get("bob", "resp_1") == b"bob's"
            # A separator in a tenant or an id cannot make one tenant's key another's.
            await store.put("a:b", "c", b"one")
            assert await store.get("a", "b:c") is None
        finally:
            await store.close()

    run(main())


def test_records_expire_after_the_ttl(stores: Stores) -> None:
    async def main() -> None:
        store = stores.open(ttl_s=0.2)
        try:
            await store.put("t", "resp_1", b"short-lived")
            assert await store.get("t", "resp_1") == b"short-lived"

            async def gone() -> bool:
                return await store.get("t", "resp_1") is None

            expired: bool = await wait_until_async(gone, WAIT_S, "the record to expire")
            assert expired
        finally:
            await store.close()

    run(main())


def test_a_record_over_the_cap_is_refused(stores: Stores) -> None:
    async def main() -> None:
        store = stores.open(max_record_bytes=10)
        try:
            await store.put("t", "fits", b"x" * 10)
            with pytest.raises(RecordTooLarge) as raised:
                await store.put("t", "too_big", b"x" * 11)
            assert isinstance(raised.value, StoreError)
            assert await store.get("t", "too_big") is None
            assert await store.get("t", "fits") == b"x" * 10
        finally:
            await store.close()

    run(main())


def test_cancel_reaches_the_running_response(stores: Stores) -> None:
    async def main() -> None:
        store = stores.open()
        other = stores.other_process(store)
        try:
            async with (
                store.running("t", "resp_1") as cancelled,
                store.running("t", "resp_2") as bystander,
                store.running("u", "resp_1") as other_tenant,
            ):
                assert not cancelled.is_set()
                await other.cancel("t", "resp_1")
                await asyncio.wait_for(cancelled.wait(), WAIT_S)
                # Only that response of that tenant: wait for a cancel sent after it.
                await other.cancel("t", "resp_2")
                await asyncio.wait_for(bystander.wait(), WAIT_S)
                assert not other_tenant.is_set()
            await other.cancel("t", "resp_1")  # nobody runs it any more: nothing happens
            await other.cancel("t", "never_ran")
        finally:
            await closing(store, other)

    run(main())


def test_memory_bound_drops_the_oldest() -> None:
    async def main() -> None:
        store = Stores("memory://").open(max_bytes=25, max_record_bytes=10)
        for index in range(3):
            await store.put("t", f"resp_{index}", b"x" * 10)
        assert await store.get("t", "resp_0") is None
        assert await store.get("t", "resp_1") == b"x" * 10
        assert await store.get("t", "resp_2") == b"x" * 10
        await store.put("t", "resp_1", b"y" * 10)  # replacing makes it the newest
        await store.put("t", "resp_3", b"z" * 10)
        assert await store.get("t", "resp_2") is None
        assert await store.get("t", "resp_1") == b"y" * 10

    run(main())


# ---- Redis only ------------------------------------------------------------------------


def _quick(url: str) -> RedisStore:
    return RedisStore(
        url,
        60.0,
        1 << 16,
        socket_timeout_s=QUICK_TIMEOUT_S,
        connect_timeout_s=QUICK_TIMEOUT_S,
    )


async def _every_call_fails_quickly(store: RedisStore) -> None:
    calls: list[Callable[[], Awaitable[Any]]] = [
        lambda: store.put("t", "resp_1", b"record"),
        lambda: store.get("t", "resp_1"),
        lambda: store.delete("t", "resp_1"),
        lambda: store.cancel("t", "resp_1"),
    ]
    for call in calls:
        started = time.monotonic()
        with pytest.raises(StoreError, match="Redis failed the") as raised:
            await call()
        assert time.monotonic() - started < GIVE_UP_WITHIN_S
        # The message reaches clients: it must not name where Redis is.
        assert store.address.rpartition(":")[2] not in str(raised.value)
    # A response still runs, and a cancel through this process still reaches it.
    started = time.monotonic()
    async with store.running("t", "resp_1") as cancelled:
        await store.cancel("t", "resp_1")
        assert cancelled.is_set()
    assert time.monotonic() - started < GIVE_UP_WITHIN_S


def test_no_redis_listening_is_a_store_error() -> None:
    from tests.helpers.processes import free_port

    async def main() -> None:
        store = _quick(f"redis://127.0.0.1:{free_port()}/0")
        try:
            await _every_call_fails_quickly(store)
        finally:
            await store.close()

    run(main())


def test_a_hung_redis_is_a_store_error_and_the_next_call_reconnects(tmp_path: Path) -> None:
    server = start_redis(tmp_path)

    async def main() -> None:
        store = _quick(server.url)
        try:
            await store.put("t", "resp_1", b"before")  # a pooled connection exists now
            server.pause()
            try:
                await _every_call_fails_quickly(store)
            finally:
                server.resume()
            # A write that timed out may still land once Redis wakes: only say it works.
            await store.put("t", "resp_2", b"after")
            assert await store.get("t", "resp_2") == b"after"
        finally:
            await store.close()

    try:
        run(main())
    finally:
        server.stop()


def test_cancels_arrive_again_after_redis_restarts(tmp_path: Path) -> None:
    server = start_redis(tmp_path)

    async def main() -> None:
        runner, canceller = _quick(server.url), _quick(server.url)
        try:
            async with runner.running("t", "resp_1") as cancelled:
                server.stop()
                with pytest.raises(StoreError):
                    await canceller.cancel("t", "resp_1")
                server.start()

                async def cancel_reaches() -> bool:
                    # Until the listener has subscribed again, a cancel is lost: resend.
                    await canceller.cancel("t", "resp_1")
                    return cancelled.is_set()

                reached: bool = await wait_until_async(
                    cancel_reaches, WAIT_S, "a cancel after the restart", ignoring=(StoreError,)
                )
                assert reached
        finally:
            await closing(runner, canceller)

    try:
        run(main())
    finally:
        server.stop()


def test_close_stops_the_listener(redis_server: RedisServer) -> None:
    async def main() -> None:
        before = asyncio.all_tasks()
        store = Stores(redis_server.url).open()
        async with store.running("t", "resp_1"), store.running("t", "resp_2"):
            assert len(asyncio.all_tasks() - before) == 1  # one listener, however many run
        await store.close()
        assert asyncio.all_tasks() == before

    run(main())


def test_a_response_started_while_redis_is_down_gets_cancels_once_it_is_back(
    tmp_path: Path,
) -> None:
    server = start_redis(tmp_path)
    server.stop()

    async def main() -> None:
        runner, canceller = _quick(server.url), _quick(server.url)
        try:
            async with runner.running("t", "resp_1") as cancelled:
                server.start()

                async def cancel_reaches() -> bool:
                    await canceller.cancel("t", "resp_1")
                    return cancelled.is_set()

                reached: bool = await wait_until_async(
                    cancel_reaches, WAIT_S, "a cancel once Redis is up", ignoring=(StoreError,)
                )
                assert reached
        finally:
            await closing(runner, canceller)

    try:
        run(main())
    finally:
        server.stop()
