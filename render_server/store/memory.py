"""The in-process response store: the default of a single render process.

Records live in one ordered dict, oldest first; each expires after the TTL, and the
oldest go first when the bytes held would pass the bound. Cancellation reaches only
this process, which is all there is.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from render_server.store.base import RecordTooLarge

_Key = tuple[str, str]


class MemoryStore:
    """A `ResponseStore` in this process's memory."""

    def __init__(self, ttl_s: float, max_bytes: int, max_record_bytes: int) -> None:
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.max_record_bytes = max_record_bytes
        self._records: OrderedDict[_Key, tuple[float, bytes]] = OrderedDict()
        self._bytes = 0
        self._running: dict[_Key, asyncio.Event] = {}

    async def put(self, tenant: str, response_id: str, record: bytes) -> None:
        if len(record) > self.max_record_bytes:
            raise RecordTooLarge(f"{len(record)} bytes, the limit is {self.max_record_bytes}")
        key = (tenant, response_id)
        self._drop(key)
        self._records[key] = (time.monotonic() + self.ttl_s, record)
        self._bytes += len(record)
        self._evict()

    async def get(self, tenant: str, response_id: str) -> bytes | None:
        key = (tenant, response_id)
        entry = self._records.get(key)
        if entry is None:
            return None
        expires, record = entry
        if expires <= time.monotonic():
            self._drop(key)
            return None
        return record

    async def delete(self, tenant: str, response_id: str) -> bool:
        return self._drop((tenant, response_id))

    @asynccontextmanager
    async def running(self, tenant: str, response_id: str) -> AsyncIterator[asyncio.Event]:
        key = (tenant, response_id)
        cancelled = asyncio.Event()
        self._running[key] = cancelled
        try:
            yield cancelled
        finally:
            if self._running.get(key) is cancelled:
                del self._running[key]

    async def cancel(self, tenant: str, response_id: str) -> None:
        cancelled = self._running.get((tenant, response_id))
        if cancelled is not None:
            cancelled.set()

    async def close(self) -> None:
        self._records.clear()
        self._bytes = 0

    def _drop(self, key: _Key) -> bool:
        entry = self._records.pop(key, None)
        if entry is None:
            return False
        self._bytes -= len(entry[1])
        return True

    def _evict(self) -> None:
        now = time.monotonic()
        # Every record has the same TTL, so the oldest stored expire first.
        while self._records:
            key, (expires, _) = next(iter(self._records.items()))
            if expires > now and self._bytes <= self.max_bytes:
                break
            self._drop(key)
