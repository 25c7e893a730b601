"""The shared response store: one Redis for every render process and node.

A record is one string key, `duet:resp:{tenant digest}:{response id}`, written with
`SET ... PX ttl`, so Redis expires it; the bytes Redis holds are bounded by the TTL, the
per-record cap and Redis's own `maxmemory` policy. The tenant goes into the key as a
fixed-length digest: no tenant string, however it is spelled, can name another tenant's
keys.

Cancellation crosses processes on one pub/sub channel. `cancel` publishes the record's
key; every process runs one listener task (started by its first `running`, stopped by
`close`) that sets the event of the response it runs under that key. A cancel published
while a listener is reconnecting is lost, as a cancel for a response nobody runs is.

Every command has short socket timeouts and one retry (a pooled connection that Redis
closed since is reopened), so a dead Redis costs a request a few seconds at most and a
`StoreError` (503), never a hang; the next call connects again. `running` alone never
fails: a response runs without cross-process cancels while its listener resubscribes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from render_server.store.base import RecordTooLarge, StoreError

logger = logging.getLogger(__name__)

KEY_PREFIX = "duet:resp:"
CANCEL_CHANNEL = "duet:resp:cancel"
_LISTENER_RETRY_S = 1.0
"""Pause between attempts of a listener that lost its connection."""


@contextlib.contextmanager
def _unavailable(doing: str, address: str) -> Iterator[None]:
    """Any failure to talk to Redis becomes a StoreError: the endpoint answers 503. The
    cause is logged, not put in the error, which reaches clients: it names the address."""
    try:
        yield
    except (RedisError, OSError) as exc:  # OSError: TimeoutError and socket errors too
        logger.warning("response store %s: %s failed: %s", address, doing, exc)
        raise StoreError(f"Redis failed the {doing}") from exc


class RedisStore:
    """A `ResponseStore` in Redis, shared by every process that names the same URL."""

    def __init__(
        self,
        url: str,
        ttl_s: float,
        max_record_bytes: int,
        *,
        socket_timeout_s: float = 2.0,
        connect_timeout_s: float = 1.0,
    ) -> None:
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.max_record_bytes = max_record_bytes
        self._socket_timeout_s = socket_timeout_s
        # The address without credentials, for messages and logs.
        self.address = urlsplit(url).netloc.rpartition("@")[2]
        # Options in the URL's query (e.g. ?socket_timeout=5) win over these defaults.
        self._redis = aioredis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        self._running: dict[str, asyncio.Event] = {}
        self._listener: asyncio.Task[None] | None = None
        self._starting_listener = asyncio.Lock()

    async def put(self, tenant: str, response_id: str, record: bytes) -> None:
        if len(record) > self.max_record_bytes:
            raise RecordTooLarge(f"{len(record)} bytes, the limit is {self.max_record_bytes}")
        with _unavailable("put", self.address):
            await self._redis.set(self._key(tenant, response_id), record, px=self.ttl_ms)

    async def get(self, tenant: str, response_id: str) -> bytes | None:
        with _unavailable("get", self.address):
            record = await self._redis.get(self._key(tenant, response_id))
        assert record is None or isinstance(record, bytes)  # the client never decodes
        return record

    async def delete(self, tenant: str, response_id: str) -> bool:
        with _unavailable("delete", self.address):
            deleted: int = await self._redis.delete(self._key(tenant, response_id))
        return deleted > 0

    @asynccontextmanager
    async def running(self, tenant: str, response_id: str) -> AsyncIterator[asyncio.Event]:
        # Subscribed before the block starts, so that a cancel sent once it runs arrives.
        # Never a StoreError: the response runs (and a cancel through this process still
        # stops it) while the listener keeps trying to subscribe.
        await self._listen()
        key = self._key(tenant, response_id)
        cancelled = asyncio.Event()
        self._running[key] = cancelled
        try:
            yield cancelled
        finally:
            if self._running.get(key) is cancelled:
                del self._running[key]

    async def cancel(self, tenant: str, response_id: str) -> None:
        key = self._key(tenant, response_id)
        local = self._running.get(key)
        if local is not None:  # it runs here: no need to ask the others
            local.set()
            return
        with _unavailable("cancel", self.address):
            await self._redis.publish(CANCEL_CHANNEL, key)

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
            self._listener = None
        await self._redis.aclose()

    @staticmethod
    def _key(tenant: str, response_id: str) -> str:
        digest = hashlib.sha256(tenant.encode()).hexdigest()[:32]
        return f"{KEY_PREFIX}{digest}:{response_id}"

    async def _listen(self) -> None:
        """Start this process's listener unless it runs, subscribed when Redis answers
        within its timeouts, else left to subscribe in the background."""
        async with self._starting_listener:
            if self._listener is None or self._listener.done():
                pubsub: PubSub | None = None
                with contextlib.suppress(StoreError):
                    pubsub = await self._subscribe()
                self._listener = asyncio.create_task(self._deliver(pubsub), name="store-cancel")

    async def _subscribe(self) -> PubSub:
        """A pubsub on the cancel channel, returned once Redis confirmed the subscription
        (within a socket timeout)."""
        pubsub = self._redis.pubsub()
        try:
            with _unavailable("subscribe", self.address):
                await pubsub.subscribe(CANCEL_CHANNEL)
                deadline = time.monotonic() + self._socket_timeout_s
                while (remaining := deadline - time.monotonic()) > 0:
                    message: dict[str, Any] | None = await pubsub.get_message(timeout=remaining)
                    if message is not None and message["type"] == "subscribe":
                        return pubsub
                raise TimeoutError("no confirmation of the subscription")
        except BaseException:
            await pubsub.aclose()
            raise

    async def _deliver(self, pubsub: PubSub | None) -> None:
        """The listener: set the event of each running response a cancel names; without
        a subscription (Redis was unreachable, or the connection dropped), subscribe again
        on a new connection until Redis answers."""
        try:
            while True:
                if pubsub is None:
                    pubsub = await self._resubscribe()
                try:
                    async for message in pubsub.listen():
                        if message["type"] == "message":
                            cancelled = self._running.get(message["data"].decode())
                            if cancelled is not None:
                                cancelled.set()
                    return  # no longer subscribed: the next `running` starts another
                except (RedisError, OSError) as exc:
                    logger.warning(
                        "response store %s: cancellation channel lost (%s); reconnecting",
                        self.address,
                        exc,
                    )
                await pubsub.aclose()
                pubsub = None
        finally:
            if pubsub is not None:
                await pubsub.aclose()

    async def _resubscribe(self) -> PubSub:
        while True:
            await asyncio.sleep(_LISTENER_RETRY_S)
            with contextlib.suppress(StoreError):
                pubsub = await self._subscribe()
                logger.info("response store %s: cancellation channel back", self.address)
                return pubsub
