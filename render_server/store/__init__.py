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
    await store.cancel(tenant, response_id)                  # reaches the runner
    await store.delete(tenant, response_id)
    await store.close()

Tenants never see each other's records: a record is found only under the tenant it was
stored for (`http.endpoint.tenant_id`).

Two implementations: `MemoryStore` (memory.py), the default, holds records in the one
process (each of `--processes N` would have its own, so the server warns); `RedisStore`
(redis.py, `--response-store redis://HOST:PORT/DB` or `rediss://`) keeps them in a Redis
that every process and node shares, expired by Redis after the TTL, and carries cancels
over a pub/sub channel. A store that cannot be reached raises `StoreError` (a 503);
a record over `--response-store-max-record-bytes` raises `RecordTooLarge` (a 400).
"""

from __future__ import annotations

from render_server.store.base import RecordTooLarge, ResponseStore, StoreError
from render_server.store.memory import MemoryStore


def open_store(url: str, *, ttl_s: float, max_bytes: int, max_record_bytes: int) -> ResponseStore:
    """The store `url` names: memory:// (this process) or redis[s]://host:port/db. Opening
    connects to nothing yet: a Redis store connects on its first call."""
    if url == "memory://":
        return MemoryStore(ttl_s, max_bytes, max_record_bytes)
    if url.startswith(("redis://", "rediss://")):
        # Imported here: a server on the memory store never loads the redis client.
        from render_server.store.redis import RedisStore

        return RedisStore(url, ttl_s, max_record_bytes)
    # The URL is not echoed: it may hold a password.
    raise ValueError("unknown response store: use memory:// or redis[s]://HOST:PORT/DB")


__all__ = ["MemoryStore", "RecordTooLarge", "ResponseStore", "StoreError", "open_store"]
