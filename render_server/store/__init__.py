"""Where stored Responses API responses live, shared by every render process and node.

Render servers are stateless and scale out (`--processes N`, several nodes), so a
response stored through one process must be readable, continuable, deletable and
cancellable through any other. A `ResponseStore` keeps opaque records (bytes the
Responses endpoint encodes) per tenant and id, under a TTL and a size bound, and carries
cancellations to whichever process runs the response:

    store = open_store(settings)            # memory:// (one process) or redis://...
    await store.put(tenant, response_id, record)
    record = await store.get(tenant, response_id)          # None: unknown or expired
    async with store.running(tenant, response_id) as cancelled:   # an asyncio.Event
        ...                                 # set when any process asks to cancel it
    found = await store.cancel(tenant, response_id)          # reaches the runner
    await store.delete(tenant, response_id)
    await store.close()

Tenants never see each other's records: a record is found only under the tenant it was
stored for (`http.endpoint.tenant_id`).
"""

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
