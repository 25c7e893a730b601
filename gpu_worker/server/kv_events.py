"""KV cache events on a ZMQ PUB socket, in vLLM's format, for llm-d's prefix-cache routing.

`gpu-worker --kv-events-endpoint tcp://...` publishes, after every engine step that
changed the cached blocks, one multipart message:

    [topic (utf-8), sequence number (8 bytes, big-endian, from 0), payload]

The payload is a msgpack `KVEventBatch`, vLLM's own structs (`vllm/distributed/kv_events.py`):
array-like and tagged by class name, so a batch is
`[ts, [["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium], ["BlockRemoved", block_hashes, medium], ["AllBlocksCleared"]], data_parallel_rank]`.

Block hashes are duet's 16-byte BLAKE2b digests (`shared.hashing`), sent as vLLM sends its
own with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` (its default): the last 8 bytes read as a
big-endian unsigned 64-bit integer (`external_block_hash`).

As in vLLM, an endpoint with a wildcard (`tcp://*:5557`) or an ipc path is bound, any
other is connected to (llm-d's indexer binds and the engines connect to it). vLLM's
optional replay socket (a ROUTER serving past batches by sequence number) is not offered:
a gap in the sequence numbers means events were lost, as with vLLM run without one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
import zmq

from gpu_worker.core.kv_cache import BlockRemoved, BlockStored, KVCacheEvent, KVCacheManager
from shared.hashing import BlockHash

logger = logging.getLogger(__name__)

MEDIUM = "GPU"
"""vLLM's name for the engine's own KV cache (as opposed to an offloading tier)."""
_SEND_HWM = 100_000


def external_block_hash(block_hash: BlockHash) -> int:
    """A block hash as vLLM puts it on the wire: its low 64 bits as an unsigned integer
    (`int.from_bytes(h, "big") & (2**64 - 1)`, which is the last 8 bytes)."""
    return int.from_bytes(block_hash[-8:], "big")


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """vLLM's KVCacheEvent: encoded as an array whose first item is the class name."""


class WireBlockStored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class WireBlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class WireAllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


WireEvent = WireBlockStored | WireBlockRemoved | WireAllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's events, oldest first."""

    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


def to_wire(event: KVCacheEvent, block_size: int) -> WireEvent:
    """vLLM's struct for one of the block manager's events."""
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return WireBlockStored(
            block_hashes=[external_block_hash(h) for h in event.block_hashes],
            parent_block_hash=None if parent is None else external_block_hash(parent),
            token_ids=event.token_ids,
            block_size=block_size,
            lora_id=None,
            medium=MEDIUM,
        )
    if isinstance(event, BlockRemoved):
        hashes = [external_block_hash(h) for h in event.block_hashes]
        return WireBlockRemoved(block_hashes=hashes, medium=MEDIUM)
    return WireAllBlocksCleared()


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, ipc or inproc endpoint, connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Takes a block manager's events after each step and publishes them as one batch.

    Made before the model loads (a bad endpoint fails at once), then pointed at the
    engine's block manager with `follow`. Runs on the worker's main thread, which owns
    the block manager: a PUB socket never blocks (past its high-water mark ZMQ drops,
    and the sequence numbers show the gap), so it needs no thread of its own.
    """

    def __init__(self, endpoint: str, *, topic: str = "", data_parallel_rank: int = 0) -> None:
        self._take_events: Callable[[], list[KVCacheEvent]] | None = None
        self._block_size = 0
        self._topic = topic.encode("utf-8")
        self._data_parallel_rank = data_parallel_rank
        self._encoder = msgspec.msgpack.Encoder()
        # A context of its own: the worker's sockets and this one start and stop apart.
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.set_hwm(_SEND_HWM)
        self._socket.setsockopt(zmq.LINGER, 0)
        if binds(endpoint):
            self._socket.bind(endpoint)
            self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._socket.connect(endpoint)
            self.endpoint = endpoint
        logger.info("publishing KV cache events on %s, topic %r", self.endpoint, topic)
        self._seq = 0
        self.dropped = 0
        """Batches ZMQ refused (no room under the high-water mark); their numbers are skipped."""

    def follow(self, kv: KVCacheManager) -> None:
        """Publish this block manager's events from now on."""
        kv.record_events()
        self._take_events = kv.take_events
        self._block_size = kv.block_size

    def publish_pending(self) -> None:
        """Publish whatever the block manager recorded since the last call, if anything."""
        if self._take_events is None:
            return
        events = self._take_events()
        if not events:
            return
        batch = KVEventBatch(
            ts=time.time(),
            events=[to_wire(event, self._block_size) for event in events],
            data_parallel_rank=self._data_parallel_rank,
        )
        seq = self._seq
        self._seq += 1
        frames = (self._topic, seq.to_bytes(8, "big"), self._encoder.encode(batch))
        try:
            self._socket.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()
