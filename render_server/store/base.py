"""The response store's interface and errors (see the package's docstring)."""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager
from typing import Protocol


class StoreError(Exception):
    """The store could not be reached or refused an operation (a 503 to the client)."""


class RecordTooLarge(StoreError):
    """A record over the store's per-record bound (a 400 to the client)."""


class ResponseStore(Protocol):
    async def put(self, tenant: str, response_id: str, record: bytes) -> None:
        """Store or replace a record; it expires after the store's TTL."""
        ...

    async def get(self, tenant: str, response_id: str) -> bytes | None:
        """The record, or None when it is unknown, expired or another tenant's."""
        ...

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Forget a record; False when there was none."""
        ...

    def running(self, tenant: str, response_id: str) -> AbstractAsyncContextManager[asyncio.Event]:
        """Mark a response as running in this process for the block's duration; the event
        is set when `cancel` is called for it from any process."""
        ...

    async def cancel(self, tenant: str, response_id: str) -> None:
        """Ask the process running this response (if any) to stop it."""
        ...

    async def close(self) -> None: ...
